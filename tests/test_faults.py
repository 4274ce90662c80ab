"""Faults below the server: corrupted logits in one row, and a watchdog that sees "no progress".

The server-level faults (a failing step -> 500 / SSE error, engine death -> 503 and exit 1, a long
step -> /health 503) are in test_server.py and test_server_lifecycle.py; the no-progress watchdog
through a real server is in test_server_reliability.py.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from cobatch.config import SchedulerConfig
from cobatch.engine import Engine
from cobatch.sampling_params import SamplingParams
from cobatch.scheduler_output import SchedulerOutput
from tests.runner_helpers import runner_for, tiny_hf_model
from tests.test_memory_pressure import one_torch_thread  # noqa: F401 - an autouse fixture
from tests.test_async_engine import PROMPT, collect, make_engine, params, run, started

VOCAB = 256


@pytest.fixture(scope="module")
def hf_llama() -> torch.nn.Module:
    return tiny_hf_model("llama", seed=3)


def corrupting_engine(hf_llama: torch.nn.Module, victim: str, value: float) -> Engine:
    """An engine whose logits for `victim`'s row are overwritten with `value` in every step."""
    runner = runner_for(hf_llama, num_kv_blocks=64, block_size=4)
    engine = Engine(runner, SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=64))
    row_of_victim: list[int | None] = [None]

    def find_victim(output: SchedulerOutput) -> None:
        sampled = [row.request_id for row in output.rows if row.needs_sample]
        row_of_victim[0] = sampled.index(victim) if victim in sampled else None

    compute_logits = runner.model.compute_logits

    def corrupt(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)  # [R, V]
        if row_of_victim[0] is not None:
            logits[row_of_victim[0]] = value
            logits[row_of_victim[0], 7] = value if math.isnan(value) else 0.0  # one odd entry
        return logits

    runner.fault_hook = find_victim  # the runner's existing hook sees each step's rows first
    runner.model.compute_logits = corrupt  # type: ignore[method-assign]
    return engine


def generate(engine: Engine, sampling: dict[str, SamplingParams]) -> dict[str, list[int]]:
    prompts = {rid: [(i * 11 + j) % 200 + 3 for j in range(6 + i)] for i, rid in enumerate(sampling)}
    for rid, p in sampling.items():
        engine.add_request(rid, prompts[rid], p)
    out: dict[str, list[int]] = {rid: [] for rid in sampling}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            assert delta.error is None, delta.error
            out[delta.request_id].extend(delta.new_token_ids)
    return out


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_logits_in_one_row_leave_the_other_rows_alone(hf_llama, value: float) -> None:
    sampling = {"greedy": SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                "victim": SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, seed=3),
                "seeded": SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True, seed=5)}
    clean = generate(corrupting_engine(hf_llama, "nobody", value), sampling)
    dirty = generate(corrupting_engine(hf_llama, "victim", value), sampling)
    assert dirty["greedy"] == clean["greedy"] and dirty["seeded"] == clean["seeded"]
    assert len(dirty["victim"]) == 8 and all(0 <= t < VOCAB for t in dirty["victim"])
    assert dirty["victim"] != clean["victim"]  # the corruption did reach the sampler


# ---- watchdog: no progress while work is pending --------------------------------------------------

def test_watchdog_flags_no_progress_while_work_is_pending() -> None:
    """No step is long, yet nothing is scheduled: the watchdog must still trip."""
    async def main() -> None:
        engine = await started(make_engine, watchdog_timeout_s=0.2)
        engine.inject_fault("no_progress", seconds=0.8)
        stream = engine.add("r", PROMPT, params())
        await asyncio.sleep(0.5)
        assert engine.is_stalled and not engine.is_healthy
        deltas = await collect(stream)  # the scheduler recovers: the request completes
        assert deltas[-1].finish_reason == "length" and engine.is_healthy
        await engine.shutdown()
    run(main())


def test_watchdog_stays_quiet_when_idle_and_right_after_a_long_idle() -> None:
    async def main() -> None:
        engine = await started(make_engine, watchdog_timeout_s=0.2)
        await asyncio.sleep(0.5)  # idle longer than the timeout: nothing is late
        assert engine.is_healthy
        stream = engine.add("r", PROMPT, params(max_tokens=3))
        assert not engine.is_stalled
        await collect(stream)
        assert engine.is_healthy
        await engine.shutdown()
    run(main())


# ---- the engine thread's floating-point environment ------------------------------------------------

_DENORMAL_PROBE = """
import sys
from cobatch.models.native import load_attention_kernel
kernel = load_attention_kernel()
sys.exit(2 if kernel is None else 0 if 5e-324 > 0.0 else 1)
"""


def test_loading_the_native_kernel_keeps_denormals() -> None:
    """Loading a model must not change how the loading thread compares Python floats."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _DENORMAL_PROBE], capture_output=True)
    if result.returncode == 2:
        pytest.skip("the native kernel is not available here")
    assert result.returncode == 0, "denormals are flushed to zero after loading the kernel"
