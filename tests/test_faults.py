"""Faults below the server: the fault-injecting runner, corrupted logits in one row, the watchdog.

The server-level faults (a failing step -> 500 / SSE error, engine death -> 503 and exit 1, a long
step -> /health 503) are in test_server.py and test_server_lifecycle.py; the no-progress watchdog
through a real server is in test_server_reliability.py.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
import torch

from cobatch.config import SchedulerConfig
from cobatch.engine import Engine
from cobatch.sampling_params import SamplingParams
from cobatch.scheduler import Scheduler
from cobatch.scheduler_output import RunnerOutput, SchedulerOutput
from cobatch.testing.faults import EngineDeathInjected, FaultInjectingRunner, FaultInjector
from tests.fakes import FakeRunner
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

    compute_logits, execute = runner.model.compute_logits, runner.execute

    def corrupt(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)  # [R, V]
        if row_of_victim[0] is not None:
            logits[row_of_victim[0]] = value
            logits[row_of_victim[0], 7] = value if math.isnan(value) else 0.0  # one odd entry
        return logits

    def execute_seeing_rows(output: SchedulerOutput) -> RunnerOutput:
        find_victim(output)
        return execute(output)

    runner.execute = execute_seeing_rows  # type: ignore[method-assign]
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


# ---- the fault-injecting runner ------------------------------------------------------------------

def step_error_steps(runner: FaultInjectingRunner, num_steps: int) -> list[bool]:
    """Which of `num_steps` empty steps raised the injected step error."""
    failed = []
    for _ in range(num_steps):
        try:
            runner.execute(SchedulerOutput(rows=()))
            failed.append(False)
        except RuntimeError as exc:
            assert "injected" in str(exc)
            failed.append(True)
    return failed


def test_step_faults_stack_newest_first_and_clear_drops_them() -> None:
    runner = FaultInjectingRunner(FakeRunner(num_kv_blocks=8, block_size=4))
    runner.inject("step_error", num_steps=2)
    assert step_error_steps(runner, 3) == [True, True, False]
    runner.inject("stall", seconds=0.05, num_steps=2)
    runner.inject("step_error")
    start = time.monotonic()
    assert step_error_steps(runner, 3) == [True, False, False]  # then the older stall's two steps
    assert time.monotonic() - start >= 0.1
    runner.inject("step_error", num_steps=5)
    runner.inject("clear")
    assert step_error_steps(runner, 1) == [False]


def test_the_wrapper_is_the_runner_it_wraps_to_the_engine() -> None:
    fake = FakeRunner(num_kv_blocks=8, block_size=4, num_swap_blocks=2)
    runner = FaultInjectingRunner(fake)
    assert (runner.num_kv_blocks, runner.num_swap_blocks, runner.block_size) == (8, 2, 4)
    assert runner.kv is fake.kv  # anything else is forwarded (model_config, dtype, ...)
    with pytest.raises(ValueError, match="kind must be one of"):
        runner.inject("meltdown")


def test_engine_death_escapes_engine_step() -> None:
    runner = FaultInjectingRunner(FakeRunner(num_kv_blocks=8, block_size=4))
    engine = Engine(runner, SchedulerConfig(num_kv_blocks=8, block_size=4, max_model_len=16))
    runner.inject("engine_death")
    assert not issubclass(EngineDeathInjected, Exception)
    with pytest.raises(EngineDeathInjected):
        engine.step()


def test_no_progress_holds_the_step_until_its_time_or_a_clear() -> None:
    runner = FaultInjectingRunner(FakeRunner(num_kv_blocks=8, block_size=4))
    runner.inject("no_progress", seconds=0.2)
    start = time.monotonic()
    runner.execute(SchedulerOutput(rows=()))
    assert time.monotonic() - start >= 0.2
    runner.inject("no_progress", seconds=60.0)
    threading.Timer(0.05, runner.inject, args=("clear",)).start()  # from another thread
    start = time.monotonic()
    runner.execute(SchedulerOutput(rows=()))
    assert time.monotonic() - start < 5.0


# ---- watchdog: a stuck step, or no progress while work is pending --------------------------------

class StarvedScheduler(Scheduler):
    """Schedules nothing until `until` (a livelocked scheduler), then as usual."""

    def __init__(self, config: SchedulerConfig, until: float) -> None:
        super().__init__(config)
        self.until = until

    def schedule(self) -> SchedulerOutput:
        if time.monotonic() < self.until:
            time.sleep(0.001)  # a livelock spins; this one spares the CPU
            return SchedulerOutput(rows=())
        return super().schedule()


def starved_engine(seconds: float) -> Engine:
    engine = make_engine()
    engine.scheduler = StarvedScheduler(engine.config, time.monotonic() + seconds)  # before any request
    return engine


def faulty_engine(kind: str, seconds: float) -> Engine:
    faults = FaultInjector()
    faults.inject(kind, seconds=seconds)
    return make_engine(faults=faults)


@pytest.mark.parametrize("factory", [
    lambda: faulty_engine("stall", 0.8),  # one step runs too long
    lambda: faulty_engine("no_progress", 0.8),  # the step in flight does nothing for a while
    lambda: starved_engine(0.8),  # no step is long, yet nothing is scheduled
], ids=["stall", "no_progress", "starved_scheduler"])
def test_watchdog_trips_while_work_is_pending_and_nothing_progresses(factory) -> None:
    async def main() -> None:
        engine = await started(factory, watchdog_timeout_s=0.2)
        stream = engine.add("r", PROMPT, params())
        await asyncio.sleep(0.5)
        assert engine.is_stalled and not engine.is_healthy
        deltas = await collect(stream)  # the engine recovers: the request completes
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
from cobatch.kernels.attention import load_attention_kernel
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
