"""Determinism through the engine (tiny model, real runner): what is in the batch changes nothing.

A greedy request's tokens are the same alone or among 32 others, with or without preemption; a seeded
request's sample is the same whatever shares its steps. (Streamed vs non-streamed and the same checks
through the HTTP server are in test_server_reliability.py.)
"""

from __future__ import annotations

import pytest
import torch

from cobatch.config import SchedulerConfig
from cobatch.engine import Engine
from cobatch.sampling_params import SamplingParams
from tests.runner_helpers import runner_for, tiny_hf_model
from tests.test_memory_pressure import one_torch_thread  # noqa: F401 - an autouse fixture

MAX_MODEL_LEN = 64
NEW_TOKENS = 20
BATCH = 32


@pytest.fixture(scope="module")
def hf_llama() -> torch.nn.Module:
    return tiny_hf_model("llama", seed=5)


def make(hf_llama: torch.nn.Module, num_kv_blocks: int = 512, mode: str = "recompute") -> Engine:
    runner = runner_for(hf_llama, num_kv_blocks=num_kv_blocks, block_size=4, num_swap_blocks=64)
    return Engine(runner, SchedulerConfig(num_kv_blocks=num_kv_blocks, block_size=4,
                                          max_model_len=MAX_MODEL_LEN, max_num_seqs=BATCH,
                                          preemption_mode=mode, num_swap_blocks=64))


def prompt_of(i: int) -> list[int]:
    gen = torch.Generator().manual_seed(100 + i)
    return torch.randint(3, 256, (4 + i % 13,), generator=gen).tolist()


def params_of(i: int) -> SamplingParams:
    """Every 4th request greedy, every 4th+1 seeded, the rest unseeded random (the batch's noise)."""
    kind = i % 4
    if kind == 0:
        return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    seed = 1000 + i if kind == 1 else None
    return SamplingParams(temperature=1.0, top_p=0.9, seed=seed, max_tokens=NEW_TOKENS,
                          ignore_eos=True)


def run(engine: Engine, ids: list[int]) -> dict[int, list[int]]:
    """Requests `ids` all at once; returns each one's tokens."""
    for i in ids:
        engine.add_request(f"r{i}", prompt_of(i), params_of(i))
    out: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out[int(delta.request_id[1:])].extend(delta.new_token_ids)
    return out


def deterministic(ids: range) -> list[int]:
    """The requests whose output must not depend on the batch: greedy and seeded."""
    return [i for i in ids if i % 4 in (0, 1)]


@pytest.fixture(scope="module")
def alone(hf_llama) -> dict[int, list[int]]:
    engine = make(hf_llama)
    return {i: run(engine, [i])[i] for i in deterministic(range(BATCH))}


@pytest.mark.parametrize("num_kv_blocks,mode", [(512, "recompute"), (24, "recompute"), (24, "swap")],
                         ids=["roomy", "recompute-pressure", "swap-pressure"])
def test_greedy_and_seeded_outputs_do_not_depend_on_the_batch(hf_llama, alone, num_kv_blocks: int,
                                                              mode: str) -> None:
    engine = make(hf_llama, num_kv_blocks, mode)
    together = run(engine, list(range(BATCH)))
    assert max(s.num_rows for s in engine.stats) > 8, "the requests were meant to share steps"
    if num_kv_blocks < 512:
        assert engine.scheduler.num_preemptions_total > 0
    for i in deterministic(range(BATCH)):
        assert together[i] == alone[i], f"r{i} ({params_of(i)}) changed in a batch"


def test_unseeded_requests_do_depend_on_the_batch(hf_llama) -> None:
    """The check above is not vacuous: without a seed, the same request samples differently."""
    first, second = run(make(hf_llama), [2, 3]), run(make(hf_llama), [3, 2])
    assert first != second
