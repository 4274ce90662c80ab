"""End to end through scheduler + runner: greedy fp32 equals HF transformers token for token.

Covers what the scheduler adds on top of the runner: mixed prefill/decode steps, chunked prefill on
and off, prefix-cache hits, and preemption forced by a tiny KV pool in both modes.
"""

from __future__ import annotations

import pytest
import torch

from cobatch.config import SchedulerConfig
from cobatch.engine import Engine
from cobatch.sampling_params import SamplingParams
from tests.runner_helpers import hf_greedy, runner_for, tiny_hf_model

NEW_TOKENS = 24


def prompts(num: int, vocab: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [5, 17, 9, 30, 3, 22][:num]
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def run_greedy(engine: Engine, token_prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(token_prompts):
        engine.add_request(f"r{i}", p, params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        engine.scheduler.check_invariants()
    assert engine.scheduler.block_manager.num_used_blocks == 0
    return out


@pytest.fixture(scope="module")
def hf_llama() -> torch.nn.Module:
    return tiny_hf_model("llama", seed=3)


@pytest.fixture(scope="module")
def reference(hf_llama) -> list[list[int]]:
    return [hf_greedy(hf_llama, p, NEW_TOKENS) for p in prompts(6, 256)]


CASES = {
    "roomy": dict(num_kv_blocks=128),
    "chunked-small-budget": dict(num_kv_blocks=128, max_num_batched_tokens=8),
    "no-chunking": dict(num_kv_blocks=128, enable_chunked_prefill=False, max_num_batched_tokens=64),
    "recompute-pressure": dict(num_kv_blocks=20, preemption_mode="recompute"),
    "swap-pressure": dict(num_kv_blocks=20, preemption_mode="swap", num_swap_blocks=64),
    "static": dict(num_kv_blocks=128, batching="static", max_num_seqs=4),
    "speculative": dict(num_kv_blocks=128, num_speculative_tokens=3, ngram_prompt_lookup_min=1),
    "speculative-pressure": dict(num_kv_blocks=20, num_speculative_tokens=2, ngram_prompt_lookup_min=1),
    "speculative-swap-pressure": dict(num_kv_blocks=20, preemption_mode="swap", num_swap_blocks=64,
                                      num_speculative_tokens=2, ngram_prompt_lookup_min=1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_greedy_matches_hf(case: str, hf_llama, reference) -> None:
    options = CASES[case]
    runner = runner_for(hf_llama, num_kv_blocks=options["num_kv_blocks"], block_size=4,
                        num_swap_blocks=options.get("num_swap_blocks", 0))
    config = SchedulerConfig(block_size=4, max_model_len=64, **options)
    engine = Engine(runner, config)
    out = run_greedy(engine, prompts(6, 256), NEW_TOKENS)
    for i, expected in enumerate(reference):
        assert out[f"r{i}"] == expected, f"r{i} diverged in case {case}"
    if "pressure" in case:
        assert engine.scheduler.num_preemptions_total > 0, "the pool was meant to force preemption"
    if "speculative" in case:  # drafts were fed, and some verified: both paths of update ran
        assert engine.scheduler.num_draft_tokens_total > engine.scheduler.num_accepted_tokens_total > 0


def test_prefix_cache_hit_keeps_greedy_output(hf_llama, reference) -> None:
    runner = runner_for(hf_llama, num_kv_blocks=64, block_size=4)
    engine = Engine(runner, SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=64))
    first = prompts(6, 256)[3]
    assert run_greedy(engine, [first], NEW_TOKENS)["r0"] == reference[3]
    engine2_out = run_greedy(engine, [first], NEW_TOKENS)  # same id reused after it finished
    assert engine2_out["r0"] == reference[3]
    assert engine.scheduler.block_manager.num_cache_hits > 0


@pytest.mark.parametrize("length", [28, 30])
def test_a_prompt_found_whole_in_the_cache_keeps_greedy_output(length: int, hf_llama) -> None:
    """28 tokens fill 7 blocks, 30 end 2 into an 8th: the second run takes its own copy of the cached block
    of the last token (the 7th, or the first run's 8th, which its output tokens filled after the prompt) and
    computes only that token over it, so the copy must hold what the first run wrote."""
    runner = runner_for(hf_llama, num_kv_blocks=64, block_size=4)
    engine = Engine(runner, SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=64))
    token_prompt = prompts(6, 256)[3][:length]
    want = hf_greedy(hf_llama, token_prompt, NEW_TOKENS)
    assert run_greedy(engine, [token_prompt], NEW_TOKENS)["r0"] == want
    first_step = len(engine.stats)
    assert run_greedy(engine, [token_prompt], NEW_TOKENS)["r0"] == want
    assert engine.stats[first_step].num_prefill_tokens == 1


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_shared_prefix_under_preemption_matches_hf(mode: str, hf_llama) -> None:
    """A 3-block prompt prefix shared by 5 requests in a pool that holds 2 of them at full length: a
    swap leaves the shared blocks on the device and takes them back, a recompute finds them cached."""
    from tests.test_swap_prefix import assert_prefix_held_once  # the fake-runner tests' check

    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 256, (12,), generator=gen).tolist()
    token_prompts = [prefix + torch.randint(3, 256, (3,), generator=gen).tolist() for _ in range(5)]
    engine = Engine(runner_for(hf_llama, num_kv_blocks=20, block_size=4, num_swap_blocks=64),
                    SchedulerConfig(num_kv_blocks=20, block_size=4, max_model_len=64, num_swap_blocks=64,
                                    preemption_mode=mode, watermark=0.0))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out: dict[str, list[int]] = {}
    resident: list[int] = [0]  # prefix blocks swaps left on the device

    def step() -> None:
        for delta in engine.step():
            out.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        engine.scheduler.check_invariants()
        assert_prefix_held_once(engine, len(prefix))
        resident.extend(engine.scheduler.block_manager.swap_resident.values())

    engine.add_request("r0", token_prompts[0], params)
    step()  # r0's prefill registers the prefix (requests admitted in one step do not share)
    for i, p in enumerate(token_prompts[1:], start=1):
        engine.add_request(f"r{i}", p, params)
    while engine.has_unfinished_requests():
        step()
    assert engine.scheduler.block_manager.num_used_blocks == 0
    for i, p in enumerate(token_prompts):
        assert out[f"r{i}"] == hf_greedy(hf_llama, p, NEW_TOKENS), f"r{i} diverged under {mode}"
    assert engine.scheduler.num_preemptions_total > 0
    assert max(resident) == (3 if mode == "swap" else 0)


def test_speculative_rows_with_logprobs_and_logit_bias_match_plain_decoding(hf_llama) -> None:
    """Logit bias and logprobs are per position, so such rows draft too: the same tokens and, at every
    position of a verified run, the same logprobs as plain decoding."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3,
                            logit_bias={7: 2.0, 11: -1.0})
    results = {}
    for k in (0, 3):
        engine = Engine(runner_for(hf_llama, num_kv_blocks=128, block_size=4),
                        SchedulerConfig(num_kv_blocks=128, block_size=4, max_model_len=64,
                                        num_speculative_tokens=k, ngram_prompt_lookup_min=1))
        for i, p in enumerate(prompts(4, 256)):
            engine.add_request(f"r{i}", p, params)
        deltas = []
        while engine.has_unfinished_requests():
            deltas.extend(engine.step())
        results[k] = {i: ([t for d in deltas if d.request_id == f"r{i}" for t in d.new_token_ids],
                          [lp for d in deltas if d.request_id == f"r{i}" for lp in d.new_logprobs]) for i in range(4)}
        if k:
            assert engine.scheduler.num_accepted_tokens_total > 0
    for i in range(4):
        (plain_tokens, plain_lps), (spec_tokens, spec_lps) = results[0][i], results[3][i]
        assert spec_tokens == plain_tokens and len(spec_lps) == len(plain_lps) == NEW_TOKENS
        for a, b in zip(spec_lps, plain_lps):
            assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


@pytest.mark.slow
def test_default_model_under_preemption_matches_hf(hf_default_model) -> None:
    """The real SmolLM2 in fp32, a pool too small for the batch, both preemption modes."""
    from cobatch.llm import LLM

    hf, tok = hf_default_model
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
             "The three laws of thermodynamics are", "My favourite recipe for pancakes:"]
    ids = [tok.encode(t) for t in texts]
    expected = [hf_greedy(hf, p, 40) for p in ids]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for mode in ("recompute", "swap"):
        llm = LLM(dtype="float32", num_kv_blocks=12, max_model_len=128, block_size=16,
                  preemption_mode=mode, swap_space=0.05)
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, f"diverged under {mode}"
        assert llm.engine.scheduler.num_preemptions_total > 0


def test_default_model_bf16_tokens_are_in_hf_bf16_top5(hf_default_model) -> None:
    """bf16 is not bit-identical to HF's bf16 (different kernels round differently), so the check is the
    usual tolerance: every greedy token cobatch picks is among HF bf16's top 5 at that position, on the
    same prefix (teacher-forced on cobatch's own output), batched with chunked prefill and decode."""
    import copy

    from cobatch.llm import LLM

    hf, tok = hf_default_model
    hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
             "Photosynthesis converts light into"]
    ids = [tok.encode(t) for t in texts]
    llm = LLM(dtype="bfloat16", num_kv_blocks=64, max_model_len=256, block_size=16, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    for prompt, out in zip(ids, outs):
        generated = list(out.outputs[0].token_ids)
        with torch.inference_mode():
            logits = hf_bf16(torch.tensor([prompt + generated])).logits[0]  # [L, V]
        top5 = logits[len(prompt) - 1:-1].topk(5, dim=-1).indices  # HF's top 5 before each generated token
        misses = [i for i, t in enumerate(generated) if t not in top5[i].tolist()]
        assert not misses, f"tokens {misses} of {generated} are outside HF bf16's top 5"


@pytest.mark.slow
def test_default_model_speculative_decoding_keeps_outputs(hf_default_model) -> None:
    """The real SmolLM2 with n-gram drafts: fp32 still equals HF token for token; bf16 equals its own
    plain decoding on the same runner (a row's bits do not depend on the tokens beside it)."""
    from dataclasses import replace

    from cobatch.llm import LLM

    hf, tok = hf_default_model
    ids = [tok.encode(t) for t in ["def fibonacci(n):", "1, 2, 3, 4, 5,"]]
    expected = [hf_greedy(hf, p, 32) for p in ids]
    for dtype in ("float32", "bfloat16"):
        llm = LLM(dtype=dtype, num_kv_blocks=64, max_model_len=128, block_size=16, num_speculative_tokens=3)
        speculative = run_greedy(llm.engine, ids, 32)
        assert llm.engine.scheduler.num_accepted_tokens_total > 0
        if dtype == "float32":
            assert [speculative[f"r{i}"] for i in range(len(ids))] == expected
        else:
            plain = Engine(llm.engine.runner, replace(llm.engine.config, num_speculative_tokens=0))
            assert run_greedy(plain, ids, 32) == speculative
