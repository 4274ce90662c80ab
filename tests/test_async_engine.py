"""AsyncEngine over the fake runner: the engine thread, the inbox, streams, aborts, faults, drain.

Faults come from cobatch.testing's runner wrapper; the watchdog's tests are in test_faults.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from cobatch import async_engine
from cobatch.async_engine import (AsyncEngine, EngineDeadError, EngineState, RequestFailedError,
                                  RequestStream)
from cobatch.config import SchedulerConfig
from cobatch.engine import Engine
from cobatch.metrics import EngineMetrics
from cobatch.outputs import RequestDelta
from cobatch.sampling_params import SamplingParams
from cobatch.testing.faults import FaultInjector
from tests.fakes import FakeRunner

PROMPT = [5, 6, 7, 8, 9]


def make_engine(step_delay_s: float = 0.0, faults: FaultInjector | None = None) -> Engine:
    """An engine over the fake runner, open to `faults`; every step sleeps `step_delay_s` first."""
    faults = faults or FaultInjector()
    if step_delay_s:  # the bottom of the fault stack: newer faults apply over it
        faults.inject("stall", seconds=step_delay_s, num_steps=1_000_000)
    runner = faults.wrap(FakeRunner(num_kv_blocks=32, block_size=4, max_model_len=64))
    return Engine(runner, SchedulerConfig(num_kv_blocks=32, block_size=4, max_model_len=64))


def params(max_tokens: int = 4, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True, temperature=0.0)


async def started(factory: Callable[[], Engine], **kwargs: object) -> AsyncEngine:
    engine = AsyncEngine(factory, **kwargs)  # type: ignore[arg-type]
    engine.start()
    for _ in range(200):
        if engine.state != EngineState.STARTING:
            return engine
        await asyncio.sleep(0.01)
    raise TimeoutError("engine never left STARTING")


async def collect(stream: RequestStream) -> list[RequestDelta]:
    return [delta async for delta in stream]


def run(coro: object) -> object:
    return asyncio.run(asyncio.wait_for(coro, timeout=20))  # type: ignore[arg-type]


def test_one_request_streams_its_tokens_and_metrics_see_it() -> None:
    async def main() -> None:
        metrics = EngineMetrics("fake")
        engine = await started(make_engine, metrics=metrics)
        deltas = await collect(engine.add("r1", PROMPT, params(max_tokens=4)))
        assert sum(len(d.new_token_ids) for d in deltas) == 4
        assert deltas[-1].finish_reason == "length"
        assert engine.snapshot.scheduler.num_kv_blocks_used == 0 and engine.num_live_requests == 0
        assert b'cobatch:generation_tokens_total{model_name="fake"} 4.0' in metrics.render()[0]
        await engine.shutdown()
    run(main())


def test_an_idle_engine_lets_the_runner_look_at_the_machine_each_poll(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread policy samples the CPUs while nothing runs (ModelRunner.on_idle), not only before steps:
    a neighbour that left while the engine was idle must not cost the next requests a thread."""
    monkeypatch.setattr(async_engine, "_IDLE_POLL_S", 0.02)
    idle_calls: list[float] = []

    def factory() -> Engine:
        engine = make_engine()
        engine.runner.on_idle = lambda: idle_calls.append(1.0)  # type: ignore[attr-defined]
        return engine

    async def main() -> None:
        engine = await started(factory)
        await asyncio.sleep(0.3)
        assert len(idle_calls) >= 3  # every empty poll
        await collect(engine.add("r1", PROMPT, params(max_tokens=4)))
        await engine.shutdown()
    run(main())


def test_speculative_runs_stream_several_tokens_and_feed_the_spec_metrics() -> None:
    def looping_engine() -> Engine:
        runner = FakeRunner(num_kv_blocks=32, block_size=4, max_model_len=64)
        runner.script = {"r1": [5, 6, 7, 8, 9] * 8}  # it repeats its prompt: drafts verify
        return Engine(runner, SchedulerConfig(num_kv_blocks=32, block_size=4, max_model_len=64,
                                              num_speculative_tokens=3))

    async def main() -> None:
        metrics = EngineMetrics("fake")
        engine = await started(looping_engine, metrics=metrics)
        deltas = await collect(engine.add("r1", PROMPT, params(max_tokens=20)))
        assert [t for d in deltas for t in d.new_token_ids] == ([5, 6, 7, 8, 9] * 4)
        assert max(len(d.new_token_ids) for d in deltas) == 4  # a verified run: 3 drafts + the model's token
        text = metrics.render()[0].decode()
        assert 'cobatch:generation_tokens_total{model_name="fake"} 20.0' in text
        assert 'cobatch:spec_decode_num_accepted_tokens_total{model_name="fake"}' in text
        # every token after the first counts one inter-token gap, also inside a run
        assert 'cobatch:inter_token_latency_seconds_count{model_name="fake"} 19.0' in text
        await engine.shutdown()
    run(main())


def test_request_joins_the_running_batch_at_the_next_step() -> None:
    async def main() -> None:
        engine = await started(lambda: make_engine(step_delay_s=0.005))
        long = engine.add("long", PROMPT, params(max_tokens=40))
        long_deltas = long.__aiter__()
        await long_deltas.__anext__()  # "long" is generating
        short = await collect(engine.add("short", [1, 2, 3], params(max_tokens=3)))
        assert short[-1].finished
        rest = [d async for d in long_deltas]
        assert rest[-1].finish_reason == "length" and len(rest) > 3  # still going when short ended
        rows = [s.row_request_ids for s in engine._engine.stats]  # type: ignore[union-attr]
        assert any({"long", "short"} <= set(r) for r in rows)
        await engine.shutdown()
    run(main())


def test_requests_added_while_joined_share_their_first_step() -> None:
    async def main() -> None:
        engine = await started(make_engine)
        with engine.joined():
            first = engine.add("a", PROMPT, params(max_tokens=3))
            await asyncio.sleep(0.2)  # an idle engine thread had time to wake and step "a" alone
            second = engine.add("b", [1, 2, 3], params(max_tokens=3))
        await asyncio.gather(collect(first), collect(second))
        rows = [set(s.row_request_ids) for s in engine._engine.stats]  # type: ignore[union-attr]
        assert rows and rows[0] == {"a", "b"}
        await engine.shutdown()
    run(main())


def test_abort_frees_blocks_within_one_step() -> None:
    async def main() -> None:
        engine = await started(lambda: make_engine(step_delay_s=0.005))
        stream = engine.add("r", PROMPT, params(max_tokens=50))
        deltas = stream.__aiter__()
        await deltas.__anext__()
        assert engine.snapshot.scheduler.num_kv_blocks_used > 0
        engine.abort("r")
        rest = [d async for d in deltas]
        assert rest[-1].finish_reason == "abort"
        await asyncio.sleep(0.05)
        after = engine.snapshot.scheduler
        assert after.num_kv_blocks_used == 0 and after.num_running == 0
        await engine.shutdown()
    run(main())


def test_stop_sequence_finishes_one_of_n() -> None:
    async def main() -> None:
        engine = await started(lambda: make_engine(step_delay_s=0.002))
        stream = engine.add("r", PROMPT, params(max_tokens=30, n=2))
        finishes: dict[int, str | None] = {}
        async for delta in stream:
            if delta.index == 0 and not finishes and delta.new_token_ids:
                engine.stop_sequence("r#0", "STOP")
            if delta.finished:
                finishes[delta.index] = delta.finish_reason
        assert finishes == {0: "stop", 1: "length"}
        await engine.shutdown()
    run(main())


def test_runner_failure_fails_only_its_request() -> None:
    async def main() -> None:
        faults = FaultInjector()
        engine = await started(lambda: make_engine(faults=faults))
        faults.inject("step_error")
        with pytest.raises(RequestFailedError):
            await collect(engine.add("bad", PROMPT, params()))
        deltas = await collect(engine.add("good", PROMPT, params()))
        assert deltas[-1].finish_reason == "length" and engine.is_healthy
        await engine.shutdown()
    run(main())


def test_engine_death_fails_streams_and_new_requests() -> None:
    async def main() -> None:
        reasons: list[str] = []
        faults = FaultInjector()
        engine = await started(lambda: make_engine(0.005, faults), on_dead=reasons.append)
        stream = engine.add("r", PROMPT, params(max_tokens=50))
        faults.inject("engine_death")  # the next step raises past Engine.step: the loop dies
        with pytest.raises(EngineDeadError):
            await collect(stream)
        assert engine.state == EngineState.DEAD and not engine.is_healthy and reasons
        with pytest.raises(EngineDeadError):
            engine.add("later", PROMPT, params())
        await engine.shutdown()
    run(main())


def test_load_failure_is_death() -> None:
    def broken() -> Engine:
        raise RuntimeError("no such model")

    async def main() -> None:
        engine = await started(broken)
        assert engine.state == EngineState.DEAD and "no such model" in (engine.dead_reason or "")
        await engine.shutdown()
    run(main())


def test_drain_lets_short_requests_finish_and_aborts_the_rest() -> None:
    async def main() -> None:
        engine = await started(lambda: make_engine(step_delay_s=0.005))
        short = asyncio.ensure_future(collect(engine.add("short", PROMPT, params(max_tokens=3))))
        long = asyncio.ensure_future(collect(engine.add("long", PROMPT, params(max_tokens=50))))
        num_aborted = await engine.drain(timeout_s=0.1)
        assert num_aborted == 1 and not engine.is_accepting
        assert (await short)[-1].finish_reason == "length"
        assert (await long)[-1].finish_reason == "abort"
        await engine.shutdown()
    run(main())


def test_queue_counts_include_requests_the_engine_has_not_seen() -> None:
    async def main() -> None:
        faults = FaultInjector()
        engine = await started(lambda: make_engine(faults=faults))
        faults.inject("stall", seconds=0.3)
        streams = [engine.add(f"r{i}", PROMPT, params()) for i in range(3)]
        assert engine.num_queued_requests == 3  # counted before the engine thread drains the inbox
        assert engine.num_unseen_prompt_tokens == 3 * len(PROMPT)  # and their prefill with them
        for stream in streams:
            await collect(stream)
        assert engine.num_queued_requests == 0 and engine.num_unseen_prompt_tokens == 0
        await engine.shutdown()
    run(main())
