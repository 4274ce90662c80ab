"""Prompt logprobs (SamplingParams.prompt_logprobs) computed in the prefill: equal to HF's fp32
log_softmax over the same prompt, whatever the chunking, preemption, prefix cache or n."""

from __future__ import annotations

import pytest
import torch

from cobatch.config import SchedulerConfig
from cobatch.engine import Engine
from cobatch.outputs import RequestDelta
from cobatch.sampling_params import SamplingParams
from cobatch.scheduler_output import TokenLogprobs
from tests.runner_helpers import runner_for, tiny_hf_model
from tests.test_engine_correctness import prompts

TOP = 3


@pytest.fixture(scope="module")
def hf_llama() -> torch.nn.Module:
    return tiny_hf_model("llama", seed=5)


def hf_prompt_logprobs(hf_model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """HF's reference: fp32 log_softmax of the prompt's logits, [P, V] (row p scores token p + 1)."""
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> list[RequestDelta]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    deltas: list[RequestDelta] = []
    while engine.has_unfinished_requests():
        deltas.extend(engine.step())
        engine.scheduler.check_invariants()
    assert engine.scheduler.block_manager.num_used_blocks == 0, "blocks leaked"
    return deltas


def prompt_logprobs_of(deltas: list[RequestDelta], request_id: str) -> tuple[TokenLogprobs | None, ...]:
    found = [d.prompt_logprobs for d in deltas if d.parent_id == request_id and d.prompt_logprobs is not None]
    assert len(found) == 1, f"{request_id}: prompt logprobs delivered {len(found)} times"
    return found[0]


def assert_matches_hf(entries: tuple[TokenLogprobs | None, ...], prompt: list[int],
                      reference: torch.Tensor, num_top: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for p, entry in enumerate(entries[1:]):
        row = reference[p]  # position p scores prompt token p + 1
        assert entry is not None and entry.token_id == prompt[p + 1]
        assert entry.logprob == pytest.approx(float(row[prompt[p + 1]]), abs=1e-4)
        assert entry.rank == int((row > row[prompt[p + 1]]).sum()) + 1
        values, ids = row.topk(num_top)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


CASES = {
    "roomy": dict(num_kv_blocks=128),
    "chunked": dict(num_kv_blocks=128, max_num_batched_tokens=7),
    "recompute-pressure": dict(num_kv_blocks=20, preemption_mode="recompute", max_num_batched_tokens=8),
    "swap-pressure": dict(num_kv_blocks=20, preemption_mode="swap", num_swap_blocks=64,
                          max_num_batched_tokens=8),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_prompt_logprobs_match_hf(case: str, hf_llama) -> None:
    options = CASES[case]
    runner = runner_for(hf_llama, num_kv_blocks=options["num_kv_blocks"], block_size=4,
                        num_swap_blocks=options.get("num_swap_blocks", 0))
    engine = Engine(runner, SchedulerConfig(block_size=4, max_model_len=64, **options))
    asking = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=TOP)
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    token_prompts = prompts(6, 256)
    # every other request asks, so rows with and without prompt logprobs share steps; the later ones
    # ask, since the newest are preempted first
    requests = {f"r{i}": (p, asking if i % 2 else plain) for i, p in enumerate(token_prompts)}
    deltas = run(engine, requests)
    for i, prompt in enumerate(token_prompts):
        if i % 2:
            assert_matches_hf(prompt_logprobs_of(deltas, f"r{i}"), prompt, hf_prompt_logprobs(hf_llama, prompt), TOP)
        else:
            assert all(d.prompt_logprobs is None for d in deltas if d.parent_id == f"r{i}")
    if "pressure" in case:  # the pool was meant to preempt a request that asks
        assert any(d.metrics.num_preemptions for d in deltas if d.finished and requests[d.parent_id][1] is asking)


def test_prompt_logprobs_zero_one_token_prompt_n2_and_prefix_cache(hf_llama) -> None:
    """prompt_logprobs=0: only the prompt token's own entry; a one-token prompt gives [None]; with n=2
    the prompt logprobs come once (sample 0 computes them); a prompt whose prefix is cached is still
    scored in full (no cache read while its prompt logprobs are incomplete)."""
    engine = Engine(runner_for(hf_llama, num_kv_blocks=128, block_size=4),
                    SchedulerConfig(block_size=4, max_model_len=64, num_kv_blocks=128))
    prompt = prompts(6, 256)[3]  # 30 tokens
    run(engine, {"warm": (prompt, SamplingParams(max_tokens=2))})  # its full blocks are now cached
    hits = engine.scheduler.block_manager.num_cache_hits
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=0, n=2)
    deltas = run(engine, {"a": (prompt, params), "one": ([17], params)})
    assert_matches_hf(prompt_logprobs_of(deltas, "a"), prompt, hf_prompt_logprobs(hf_llama, prompt), 0)
    assert prompt_logprobs_of(deltas, "one") == (None,)
    assert engine.scheduler.block_manager.num_cache_hits > hits  # the n=2 siblings read the cache


def test_llm_generate_returns_prompt_logprobs(hf_llama, tiny_model_dir) -> None:
    """RequestOutput.prompt_logprobs from LLM.generate (chunked prefill), around an in-memory engine."""
    import itertools

    from cobatch.llm import LLM
    from cobatch.tokenizer import Tokenizer

    llm = LLM.__new__(LLM)  # the facade without loading model files: its engine and tokenizer set here
    llm.engine = Engine(runner_for(hf_llama, num_kv_blocks=64, block_size=4),
                        SchedulerConfig(block_size=4, max_model_len=64, num_kv_blocks=64,
                                        max_num_batched_tokens=5))
    llm.tokenizer, llm._ids = Tokenizer.load(tiny_model_dir), itertools.count()
    prompt = prompts(6, 256)[1]
    asking, plain = (SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1),
                     SamplingParams(temperature=0.0, max_tokens=2))
    outputs = llm.generate([{"prompt_token_ids": prompt}] * 2, [asking, plain], use_tqdm=False)
    assert outputs[0].prompt_logprobs is not None and outputs[1].prompt_logprobs is None
    assert_matches_hf(tuple(outputs[0].prompt_logprobs), prompt, hf_prompt_logprobs(hf_llama, prompt), 1)


def test_kept_prompt_positions_get_their_own_last_layer_tiles(hf_llama) -> None:
    """The C layer loop attends in its last layer only for the kept tokens, one tile each (row, index
    in the kept list, 1 token, context = position + 1): the prompt positions follow the samples."""
    from dataclasses import replace

    from cobatch.runner.model_runner import prepare_batch
    from tests.runner_helpers import BlockAllocator

    runner = runner_for(hf_llama)
    assert runner.attention_kernel is not None, "the native attention kernel builds on this CPU"
    alloc = BlockAllocator(4)
    decode = alloc.seq("d", list(range(5, 14)), 32)
    decode.num_computed_tokens = 8
    chunk = alloc.seq("c", list(range(20, 41)), 32)
    chunk.num_computed_tokens = 4
    fresh = alloc.seq("f", list(range(50, 57)), 32)
    rows = [replace(chunk.row(9), prompt_logprobs_from=6), decode.row(), replace(fresh.row(), prompt_logprobs_from=0)]
    batch = prepare_batch(rows, 4, torch.device("cpu"), runner.attention_kernel, runner.scratch_slot)
    kept_positions = [8, 6, *range(6, 13), *range(0, 6)]  # the samples (d, f), then the positions c and f score
    assert batch.num_prompt_positions == 7 + 6
    assert batch.positions[batch.sample_indices].tolist() == kept_positions
    tiles = batch.sample_tiles
    ordered = {1: 0, 0: 1, 2: 2}  # the one-token row first (stable), then the chunks
    rows_of_kept = [1, 2] + [0] * 7 + [2] * 6
    assert tiles[:, 0].tolist() == [ordered[r] for r in rows_of_kept]
    assert tiles[:, 1].tolist() == list(range(len(kept_positions))) and tiles[:, 2].tolist() == [1] * len(kept_positions)
    assert tiles[:, 3].tolist() == [p + 1 for p in kept_positions]
    assert batch.input_ids[batch.sample_indices].tolist() == [rows[r].token_ids[p]
                                                              for r, p in zip(rows_of_kept, kept_positions)]
