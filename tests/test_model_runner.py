"""The runner against HF transformers: fp32, greedy, token for token."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import pytest
import torch

from cobatch.config import EngineConfig
from cobatch.runner.model_runner import PROFILE_SCOPES, ModelRunner
from cobatch.scheduler_output import SchedulerOutput
from tests.runner_helpers import BlockAllocator, hf_greedy, runner_for, step, tiny_hf_model

NUM_NEW = 10
PROMPTS = [[5, 17, 99, 3, 250, 42, 7], [11, 12], [200, 1, 9, 9, 9, 80, 33, 61, 4, 7, 130, 2, 8], [77]]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf_model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return tiny_hf_model(request.param, tie_word_embeddings=request.param == "qwen2")


@pytest.fixture(scope="module")
def reference(hf_model: torch.nn.Module) -> list[list[int]]:
    return [hf_greedy(hf_model, p, NUM_NEW) for p in PROMPTS]


def test_batched_prefill_then_decode_matches_hf(hf_model, reference) -> None:
    runner = runner_for(hf_model)
    alloc = BlockAllocator(runner.block_size)
    seqs = [alloc.seq(f"r{i}", p, len(p) + NUM_NEW) for i, p in enumerate(PROMPTS)]
    step(runner, [(s, None) for s in seqs])  # all prompts in one step
    for _ in range(NUM_NEW - 1):
        step(runner, [(s, 1) for s in seqs])  # all decode rows together
    assert [s.output for s in seqs] == reference


def test_chunked_prefill_mixed_with_decode_matches_hf(hf_model, reference) -> None:
    runner = runner_for(hf_model)
    alloc = BlockAllocator(runner.block_size)
    long, short = (alloc.seq(f"r{i}", PROMPTS[i], len(PROMPTS[i]) + NUM_NEW) for i in (2, 0))
    step(runner, [(short, None)])
    # The long prompt arrives in 3 chunks (5 + 5 + 3), each in the same step as the short one's decode.
    for chunk in (5, 5, 3):
        step(runner, [(long, chunk), (short, 1)])
    while len(long.output) < NUM_NEW:
        step(runner, [(short, 1), (long, 1)] if len(short.output) < NUM_NEW else [(long, 1)])
    assert long.output == reference[2]
    assert short.output == reference[0]


def test_swap_out_and_in_to_other_blocks_keeps_output(hf_model, reference) -> None:
    runner = runner_for(hf_model, num_swap_blocks=16)
    alloc = BlockAllocator(runner.block_size)
    seq, other = alloc.seq("r0", PROMPTS[0], 20), alloc.seq("r1", PROMPTS[3], 20)
    step(runner, [(seq, None), (other, None)])
    for _ in range(3):
        step(runner, [(seq, 1), (other, 1)])
    old_blocks = seq.block_table
    host_blocks = list(range(len(old_blocks)))
    step(runner, [(other, 1)], swap_out=tuple(zip(old_blocks, host_blocks)))
    runner.kv_cache[:, :, old_blocks] = 0.0  # the device blocks are reused by someone else
    seq.block_table = [b + 40 for b in old_blocks]
    step(runner, [(seq, 1), (other, 1)], swap_in=tuple(zip(host_blocks, seq.block_table)))
    while len(seq.output) < NUM_NEW:
        step(runner, [(seq, 1)])
    assert seq.output == reference[0]


def test_empty_step(hf_model) -> None:
    runner = runner_for(hf_model)
    assert runner.execute(SchedulerOutput(())).sampled_token_ids == ()


def test_non_final_chunk_samples_nothing(hf_model) -> None:
    runner = runner_for(hf_model)
    seq = BlockAllocator(runner.block_size).seq("r0", PROMPTS[2], 20)
    out = step(runner, [(seq, 4)])
    assert out.sampled_token_ids == () and runner.last_timings["forward_s"] > 0


def test_padding_row_writes_no_kv(hf_model) -> None:
    runner = runner_for(hf_model)
    seq = BlockAllocator(runner.block_size).seq("r0", PROMPTS[0], 20)
    step(runner, [(seq, None)])
    step(runner, [(seq, 1)])
    before = runner.kv_cache[:, :, :runner.num_kv_blocks].clone()
    runner.kv_cache[:, :, seq.block_table] += 0.5  # a recomputed write would now differ from the cache
    shifted = runner.kv_cache[:, :, :runner.num_kv_blocks].clone()
    last = seq.num_computed_tokens - 1
    padding = replace(seq.row(1), num_computed_tokens=last, needs_sample=False, is_padding=True)
    assert runner.execute(SchedulerOutput((padding,))).sampled_token_ids == ()
    assert torch.equal(runner.kv_cache[:, :, :runner.num_kv_blocks], shifted)
    assert not torch.equal(shifted, before)


def test_last_timings_are_disjoint_parts_of_the_step(hf_model) -> None:
    """prepare, forward, lm_head and sample do not overlap (bench offline --profile adds them up)."""
    runner = runner_for(hf_model)
    seq = BlockAllocator(runner.block_size).seq("r0", PROMPTS[0], 20)
    start = time.perf_counter()
    step(runner, [(seq, None)])
    elapsed = time.perf_counter() - start
    parts = runner.last_timings
    assert set(parts) == {"prepare_s", "forward_s", "lm_head_s", "sample_s"}
    assert all(seconds > 0 for seconds in parts.values()) and sum(parts.values()) <= elapsed


def test_profile_step_splits_the_step_by_part(hf_model) -> None:
    """The Python layer loop's labelled scopes (the C loop's profile: tests/test_native_decoder.py)."""
    runner = runner_for(hf_model)
    runner.native_decoder = None
    seqs = [BlockAllocator(runner.block_size).seq("r0", PROMPTS[0], 20)]
    step(runner, [(seqs[0], None)])
    parts = runner.profile_step(SchedulerOutput((seqs[0].row(1),)))
    assert set(PROFILE_SCOPES) < set(parts) and {"prepare", "other", "sample"} < set(parts)
    assert all(parts[name] > 0 for name in ("attention", "mlp", "qkv_proj+rope", "lm_head"))
    assert not runner._profiling  # back to the unlabelled fast path


# ----------------------------------------------------------------------------- the real default model

REAL_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
REAL_NEW = 12


@pytest.fixture(scope="module")
def real_pair() -> tuple[ModelRunner, torch.nn.Module, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cobatch.model_paths import resolve_model_path

    path = resolve_model_path(None)
    runner = ModelRunner.load(EngineConfig(dtype="float32", num_kv_blocks=64, swap_space=0))
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return runner, hf, tok


@pytest.mark.slow
def test_default_model_matches_hf_greedy(real_pair) -> None:
    runner, hf, tok = real_pair
    prompts = [tok.encode(p) for p in REAL_PROMPTS]
    alloc = BlockAllocator(runner.block_size)
    seqs = [alloc.seq(f"r{i}", p, len(p) + REAL_NEW) for i, p in enumerate(prompts)]
    step(runner, [(s, None) for s in seqs])
    for _ in range(REAL_NEW - 1):
        step(runner, [(s, 1) for s in seqs])
    for seq, prompt in zip(seqs, prompts):
        assert seq.output == hf_greedy(hf, prompt, REAL_NEW)


@pytest.mark.slow
def test_default_model_runner_attributes(real_pair) -> None:
    runner = real_pair[0]
    assert runner.dtype == torch.float32 and runner.num_kv_blocks == 64 and runner.num_swap_blocks == 0
    assert runner.max_model_len == 8192 and runner.eos_token_ids == (2,)
    assert runner.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert math.isclose(runner.model_config.rope_theta, 100000.0)
