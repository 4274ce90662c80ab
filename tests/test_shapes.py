"""Every kernel path on the Llama family's real shapes, against HF transformers (fp32, the reference).

Each named shape of benchmarks/shapes.py is written small (2 layers, a smaller hidden size where the
vocabulary would make it slow) but keeps what the kernels branch on: head_dim (64 / 128), the GQA
ratio (1 to 8), qkv bias, tied or untied embeddings, rope scaling, the real vocabulary (up to 152k) and
an intermediate size that is no multiple of the bf16 GEMM's 48-column tile (one odd). cobatch (`LLM`,
fp32) must then produce HF's greedy tokens, token for token, and its logprobs, alone (prefill, decode),
in a batch of prompts of different lengths (paged attention, mixed steps), with chunked prefill, on the
torch attention path, over all prompt positions (prompt logprobs) and when sampling top-k over the
whole vocabulary. The C layer loop against the Python one runs where the bf16 kernels exist.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

from benchmarks.shapes import SHAPES, config_json, write_checkpoint
from cobatch import LLM, SamplingParams
from cobatch.config import SchedulerConfig
from cobatch.engine import Engine
from cobatch.models.loader import load_model, load_model_config
from cobatch.models.model_config import ModelConfig, RopeScaling
from cobatch.runner.model_runner import ModelRunner
from tests.test_native_decoder import _forward, _mixed_step, with_dense_kernels

NEW_TOKENS = 8
PROMPT_LENGTHS = (3, 17, 40, 9)
BUDGET = 24  # tokens a step: 3 + 17 + 4 of the 40-token prompt first, which then goes on in chunks
_LINEAR_ROPE = RopeScaling("linear", factor=4.0)

# name -> what the small variant changes (2 layers everywhere). A vocabulary over 100k takes hidden 128
# (the embedding dominates: 152k x 128); the intermediate sizes are the real ones / 16 (or odd).
SMALL: dict[str, dict[str, object]] = {
    "smollm2-135m": {},  # the real widths: hd 64, GQA 3, tied, I 1536 = 32 x 48
    "qwen2.5-0.5b": {"hidden_size": 128, "intermediate_size": 304},  # vocab 151936, bias, GQA 7
    "llama-3.2-1b": {"hidden_size": 128, "intermediate_size": 512},  # llama3 rope, vocab 128256, GQA 4
    "tinyllama-1.1b": {"hidden_size": 256, "intermediate_size": 351},  # untied, GQA 8, odd I, dynamic rope
    "qwen2.5-1.5b": {"hidden_size": 128, "intermediate_size": 560},  # hd 128, GQA 6, vocab 151936
    "llama-2-7b": {"hidden_size": 256, "intermediate_size": 688, "rope_scaling": _LINEAR_ROPE},  # MHA, hd 128
    "qwen3-0.6b": {"hidden_size": 128, "intermediate_size": 192},  # q / k head norms, hd 128 x 16 > H, GQA 2
    "smollm3-3b": {"hidden_size": 128, "intermediate_size": 344, "no_rope_layers": (1,)},  # NoPE layer, GQA 4
}
# config.json keys a variant adds to what its shape writes: dynamic NTK scaling, which is the default
# rope up to max_position_embeddings (and max_model_len stays within it).
CONFIG_EXTRAS: dict[str, dict[str, object]] = {"tinyllama-1.1b": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}}
INIT_STD = 0.1  # peaked enough that greedy has no near-ties, and attention weights are far from uniform


def small_shape(name: str) -> ModelConfig:
    return dataclasses.replace(SHAPES[name], num_layers=2, **SMALL[name])  # type: ignore[arg-type]


def prompts(shape: ModelConfig) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, shape.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@dataclass
class Case:
    """A small shape written to disk, HF's fp32 load of it, and HF's greedy continuation of each prompt."""

    shape: ModelConfig
    path: Path
    hf: torch.nn.Module
    prompts: list[list[int]]
    tokens: list[list[int]]  # [prompt][NEW_TOKENS]
    logprobs: list[torch.Tensor]  # [prompt][NEW_TOKENS]: HF's log-softmax at each greedy token
    llm: LLM  # cobatch on the same folder, fp32, BUDGET tokens a step


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread here (restored after): on a shared 2-core machine a second thread's barriers
    made these small steps ~40x slower; a row's bits do not depend on the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def shape_case(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Callable[[str], Case]:
    """name -> its Case, built once per session (the tokenizer copied from the tiny model's folder)."""

    @cache
    def build(name: str) -> Case:
        from transformers import AutoModelForCausalLM

        shape = small_shape(name)
        path = write_checkpoint(shape, tmp_path_factory.mktemp(name), dtype="float32", init_std=INIT_STD,
                                tokenizer_dir=tiny_model_dir)
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, **CONFIG_EXTRAS.get(name, {})}))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None  # exactly NEW_TOKENS
        tokens, logprobs = zip(*(_hf_greedy(hf, p) for p in prompts(shape)))
        llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=BUDGET)
        return Case(shape, path, hf, prompts(shape), list(tokens), list(logprobs), llm)

    return build


def _hf_greedy(hf: torch.nn.Module, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):]
    logits = torch.stack(out.logits).squeeze(1).float()  # [NEW_TOKENS, V]
    return tokens.tolist(), logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
NAMES = sorted(SMALL)


def _check(case: Case, outputs: list, indices: list[int]) -> None:
    for i, out in zip(indices, outputs):
        completion = out.outputs[0]
        assert completion.token_ids == case.tokens[i], f"prompt {i} diverged from HF"
        ours = torch.tensor([lp.logprob for lp in completion.logprobs])
        torch.testing.assert_close(ours, case.logprobs[i], atol=2e-4, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_config_keeps_the_real_shape(name: str, shape_case: Callable[[str], Case]) -> None:
    """The folder loads as the shape it was written from (a real one's config.json round trip too), and
    the small variant keeps what the kernels branch on."""
    case, real = shape_case(name), SHAPES[name]
    assert dataclasses.replace(load_model_config(case.path), name=name) == case.shape
    assert ModelConfig.from_hf_config(config_json(real), name=name) == real
    kept = ("head_dim", "num_heads", "num_kv_heads", "attention_bias", "tie_word_embeddings", "rope_theta")
    assert all(getattr(case.shape, field) == getattr(real, field) for field in kept)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_hf_alone_and_batched(name: str, shape_case: Callable[[str], Case]) -> None:
    """One prompt at a time (a whole prefill, then decode), then all at once: ragged steps over paged KV
    mixing decode rows with the chunks of a prompt longer than the step's budget."""
    case = shape_case(name)
    for i, prompt in enumerate(case.prompts[:2]):
        _check(case, case.llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False), [i])
    first_step = len(case.llm.engine.stats)
    batch = [{"prompt_token_ids": p} for p in case.prompts]
    _check(case, case.llm.generate(batch, GREEDY, use_tqdm=False), list(range(len(case.prompts))))
    steps = list(case.llm.engine.stats)[first_step:]
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps), "no mixed step"
    assert sum(1 for s in steps if s.num_prefill_tokens) >= 3, "the long prompt was not chunked"


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_hf_on_the_torch_attention_path(name: str, shape_case: Callable[[str], Case]) -> None:
    """The same without the native attention kernel (batched decode + SDPA prefill)."""
    case = shape_case(name)
    model = case.llm.engine.runner.model  # the same weights (read only), a cache of its own
    runner = ModelRunner.from_model(model, model.config, 64, 16, native_attention=False)
    engine = Engine(runner, SchedulerConfig(num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=BUDGET))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(case.prompts):
        engine.add_request(str(i), prompt, params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    assert [out[str(i)] for i in range(len(case.prompts))] == case.tokens


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "llama-3.2-1b"])
def test_prompt_logprobs_over_a_large_vocabulary(name: str, shape_case: Callable[[str], Case]) -> None:
    """lm_head over every prompt position and the log-softmax over 128k-152k logits, against HF's forward."""
    case = shape_case(name)
    prompt = case.prompts[2]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    out = case.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    with torch.no_grad():
        logits = case.hf(torch.tensor([prompt])).logits[0, :-1].float()  # [n - 1, V]: predicts tokens 1..
    expected = logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    ours = torch.tensor([lp.logprob for lp in out.prompt_logprobs[1:]])
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=0)


@pytest.mark.parametrize("name", ["qwen2.5-1.5b", "tinyllama-1.1b"])
def test_top_k_sampling_stays_in_hf_top_k(name: str, shape_case: Callable[[str], Case]) -> None:
    """Seeded top-k / top-p sampling over the whole vocabulary: every sampled token is among HF's top k
    at its position, and the same seed gives the same tokens."""
    case = shape_case(name)
    params = SamplingParams(temperature=1.0, top_k=5, top_p=0.95, max_tokens=NEW_TOKENS, ignore_eos=True, seed=3)
    llm = case.llm
    inputs = [{"prompt_token_ids": p} for p in case.prompts[:2]]
    first = [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
    assert first == [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
    for prompt, sampled in zip(case.prompts, first):
        with torch.no_grad():
            logits = case.hf(torch.tensor([prompt + sampled])).logits[0, len(prompt) - 1:-1]  # [N, V]
        top5 = logits.topk(5, dim=-1).indices
        assert all(token in top5[j] for j, token in enumerate(sampled)), "sampled outside HF's top 5"


def test_token_ids_past_the_vocabulary_are_refused_at_add(shape_case: Callable[[str], Case]) -> None:
    """TinyLlama's 32000 ids under a 49152-token tokenizer: a prompt id past the model's vocabulary is a
    ValueError when added (it used to fail the embedding lookup of the whole step: every request in it
    finished "error"), the call's other prompts do not stay queued, and the next call runs as usual."""
    case = shape_case("tinyllama-1.1b")
    good = {"prompt_token_ids": case.prompts[0]}
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        case.llm.generate([good, {"prompt_token_ids": [5, case.shape.vocab_size]}], GREEDY, use_tqdm=False)
    assert not case.llm.engine.has_unfinished_requests()
    _check(case, case.llm.generate([good], GREEDY, use_tqdm=False), [0])


@with_dense_kernels
@pytest.mark.parametrize("name", NAMES)
def test_c_layer_loop_matches_the_python_loop(name: str, shape_case: Callable[[str], Case],
                                              dtype: torch.dtype) -> None:
    """bf16 or fp32 on the packed kernels: the C layer loop gives the Python loop's bits, or steps aside
    where a weight cannot be packed (an intermediate size that is no multiple of 8)."""
    case = shape_case(name)
    model, config = load_model(case.path, dtype)
    runner = ModelRunner.from_model(model, config, 64, 4)
    if case.shape.intermediate_size % 8:
        assert runner.native_decoder is None
        return
    assert runner.native_decoder is not None
    out = _mixed_step(runner)
    hidden, kv = _forward(runner, out, native=True)
    ref_hidden, ref_kv = _forward(runner, out, native=False)
    assert torch.equal(hidden, ref_hidden) and torch.equal(kv, ref_kv)
