"""RoutedEngine over a fake deployment handle (no cluster): migration, its limit, refusals, stop, abort.

A fake replica "generates" a deterministic function of the whole context, as greedy decoding does,
so a run cut by a dead replica and continued elsewhere must equal the uninterrupted one token for
token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

pytest.importorskip("ray.serve")

from ray.exceptions import ActorDiedError  # noqa: E402

from cobatch.async_engine import EngineDeadError, EngineInfo, RequestStream  # noqa: E402
from cobatch.outputs import RequestDelta  # noqa: E402
from cobatch.ray.client import RoutedEngine  # noqa: E402
from cobatch.ray.scoring import ROUTED, UNAVAILABLE, RoutingDecision  # noqa: E402
from cobatch.ray.ticket import RouteTicket  # noqa: E402
from cobatch.ray.wire import GenerateCall  # noqa: E402
from cobatch.sampling_params import SamplingParams  # noqa: E402

PROMPT = [3, 1, 4, 1, 5]
INFO = EngineInfo(max_model_len=256, num_kv_blocks=64, block_size=4, max_num_seqs=8,
                  max_concurrency=1.0, max_num_batched_tokens=64, vocab_size=1000, dtype="float32",
                  eos_token_ids=())


def next_token(context: list[int]) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(context)) * 7919) % 997


def reference(max_tokens: int) -> list[int]:
    context = list(PROMPT)
    for _ in range(max_tokens):
        context.append(next_token(context))
    return context[len(PROMPT):]


@dataclass(slots=True)
class FakeReplica:
    name: str
    die_after: int | None = None  # tokens it sends before its process "dies"
    is_alive: bool = True
    calls: list[GenerateCall] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)  # calls cancelled or finished early


class FakeResponse:
    """What handle.dispatch returns: an async iterator of chunks with cancel()."""

    def __init__(self, replica: FakeReplica, call: GenerateCall) -> None:
        self._gen = self._run(replica, call)
        self.replica, self.call = replica, call

    def __aiter__(self) -> FakeResponse:
        return self

    async def __anext__(self) -> list[RequestDelta]:
        return await self._gen.__anext__()

    def cancel(self) -> None:
        self.replica.closed.append(self.call.request_id)

    async def _run(self, replica: FakeReplica, call: GenerateCall) -> AsyncIterator[list[RequestDelta]]:
        n, max_tokens = call.params.n, call.params.max_tokens or 1
        contexts = [list(call.prompt_token_ids) for _ in range(n)]
        for step in range(max_tokens):
            await asyncio.sleep(0.001)
            if replica.die_after is not None and step >= replica.die_after:
                replica.is_alive = False
                raise ActorDiedError()
            chunk = []
            for index, context in enumerate(contexts):
                context.append(next_token(context))
                seq = call.request_id if n == 1 else f"{call.request_id}#{index}"
                chunk.append(RequestDelta(
                    seq, call.request_id, index, (context[-1],), (), len(call.prompt_token_ids),
                    step + 1, finish_reason="length" if step + 1 == max_tokens else None))
            yield chunk


class FakeHandle:
    """The deployment handle's surface RoutedEngine uses: options, choose_replica, dispatch, remote."""

    def __init__(self, *replicas: FakeReplica) -> None:
        self.replicas = {r.name: r for r in replicas}
        self.finished: list[str] = []  # legs the ingress told the router had finished

    def options(self, **_: object) -> FakeHandle:
        return self

    async def remote(self) -> EngineInfo:
        return INFO

    @asynccontextmanager
    async def choose_replica(self, ticket: RouteTicket) -> AsyncIterator[object]:
        alive = [n for n, r in self.replicas.items() if r.is_alive and n not in ticket.query.exclude]
        status, chosen = (ROUTED, alive[0]) if alive else (UNAVAILABLE, None)
        ticket.decision = RoutingDecision(ticket.query.request_id, 0.0, status, chosen, "fake", 0, ())
        ticket.on_finished = lambda: self.finished.append(ticket.query.request_id)
        yield type("Selection", (), {"replica_id": chosen or next(iter(self.replicas))})()

    def dispatch(self, selection: object, call: GenerateCall) -> FakeResponse:
        replica = self.replicas[selection.replica_id]  # type: ignore[attr-defined]
        replica.calls.append(call)
        return FakeResponse(replica, call)


async def started(handle: FakeHandle, max_migrations: int = 3) -> RoutedEngine:
    engine = RoutedEngine(handle, "fake", block_size=4, max_migrations=max_migrations)  # type: ignore[arg-type]
    engine.start()
    while not engine.is_ready:
        await asyncio.sleep(0.001)
    return engine


async def tokens_of(stream: RequestStream, n: int = 1) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(n)]
    async for delta in stream:
        out[delta.index] += delta.new_token_ids
    return out


def test_a_request_cut_by_a_dead_replica_continues_token_exact() -> None:
    async def run() -> None:
        first, second = FakeReplica("a", die_after=7), FakeReplica("b")
        handle = FakeHandle(first, second)
        engine = await started(handle)
        stream = await engine.submit("r1", PROMPT, SamplingParams(max_tokens=20))
        assert await tokens_of(stream) == [reference(20)]
        moved = second.calls[0]
        assert handle.finished == [moved.request_id]  # the router hears of the leg that finished
        assert moved.prompt_token_ids == tuple(PROMPT + reference(7))  # the delivered tokens
        assert moved.params.max_tokens == 13

    asyncio.run(run())


def test_n_sequences_move_one_by_one_to_their_own_legs() -> None:
    async def run() -> None:
        first, second = FakeReplica("a", die_after=3), FakeReplica("b")
        handle = FakeHandle(first, second)
        engine = await started(handle)
        stream = await engine.submit("r2", PROMPT, SamplingParams(n=2, max_tokens=6))
        assert await tokens_of(stream, 2) == [reference(6)] * 2
        assert sorted(c.request_id for c in second.calls) == ["r2#0~1", "r2#1~1"]
        assert sorted(handle.finished) == ["r2#0~1", "r2#1~1"]

    asyncio.run(run())


def test_past_the_migration_limit_the_stream_fails_after_what_it_delivered() -> None:
    async def run() -> None:
        engine = await started(FakeHandle(FakeReplica("a", die_after=2), FakeReplica("b", die_after=2)),
                               max_migrations=1)
        stream = await engine.submit("r3", PROMPT, SamplingParams(max_tokens=20))
        got: list[int] = []
        with pytest.raises(EngineDeadError, match="moved 1 times"):
            async for delta in stream:
                got += delta.new_token_ids
        assert got == reference(4)

    asyncio.run(run())


def test_no_live_replica_refuses_at_submit() -> None:
    async def run() -> None:
        engine = await started(FakeHandle(FakeReplica("a", is_alive=False)))
        with pytest.raises(EngineDeadError, match="fake"):
            await engine.submit("r4", PROMPT, SamplingParams(max_tokens=4))
        assert engine.num_live_requests == 0

    asyncio.run(run())


def test_a_stop_string_and_an_abort_end_the_leg_on_its_replica() -> None:
    async def run() -> None:
        replica = FakeReplica("a")
        engine = await started(FakeHandle(replica))
        stream = await engine.submit("r5", PROMPT, SamplingParams(max_tokens=200))
        deltas = stream.__aiter__()
        await deltas.__anext__()
        engine.stop_sequence("r5", "STOP")  # what the server does on a stop string
        rest = [d async for d in deltas]
        assert rest[-1].finish_reason == "stop" and rest[-1].stop_reason == "STOP"
        other = await engine.submit("r6", PROMPT, SamplingParams(max_tokens=200))
        await other.__aiter__().__anext__()
        engine.abort("r6")
        await asyncio.sleep(0.01)
        assert replica.closed == ["r5", "r6"] and engine.num_live_requests == 1  # r5: not aborted yet

    asyncio.run(run())
