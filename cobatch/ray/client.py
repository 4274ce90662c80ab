"""RoutedEngine: the server's EngineClient over the engine deployment -- route, dispatch, stream, migrate.

    handler --submit--> RoutedEngine --choose_replica(ticket)--> CobatchRouter (writes the decision)
                                     --dispatch(GenerateCall)--> EngineReplica.generate
    RequestStream <--deltas, renumbered by RequestProgress-- chunks

One task per leg (migration.Leg) owns its choose_replica context, its dispatch and its stream. A leg
whose replica is lost continues, sequence by sequence, on another replica; abort cancels the tasks,
and each cancels its Ray call, so the replica's finally aborts the engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import RayActorError, WorkerCrashedError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from cobatch.async_engine import (EngineDeadError, EngineInfo, EngineState, RequestFailedError,
                                  RequestRejectedError, RequestStream)
from cobatch.engine import validate_request
from cobatch.outputs import RequestDelta
from cobatch.ray.migration import DEADLINE, Leg, RequestProgress
from cobatch.ray.router_metrics import RouterMetrics, merge_expositions
from cobatch.ray.scoring import DEADLINE as DEADLINE_STATUS
from cobatch.ray.scoring import FULL, ROUTED, RouteQuery, RoutingDecision
from cobatch.ray.ticket import RouteTicket
from cobatch.ray.wire import ENGINE_DEAD, REQUEST_REJECTED, ReplicaError
from cobatch.sampling_params import SamplingParams
from cobatch.server.engine_client import DeadlineUnreachableError, EngineOverloadedError
from cobatch.wait_reasons import SequenceWaitStatus

logger = logging.getLogger(__name__)

_INFO_RETRY_S = 0.5
_METRICS_TIMEOUT_S = 5.0
_MAX_DECISIONS = 256  # kept for GET /debug/routing


@dataclass(slots=True)
class RouteNote:
    """Per HTTP request (a context variable the ingress middleware sets): the replica it went to."""

    replica: str | None = None


ROUTE_NOTE: ContextVar[RouteNote | None] = ContextVar("cobatch_route_note", default=None)


class _ReplicaLost(Exception):
    """The replica's engine died under a leg (it said so): like a dead replica, the leg moves."""


# A leg's replica is gone (process killed, actor dead, engine dead): its sequences continue elsewhere.
_LOST = (RayActorError, WorkerCrashedError, ReplicaUnavailableError, _ReplicaLost)
_REFUSED = (EngineOverloadedError, DeadlineUnreachableError, EngineDeadError)


@dataclass(slots=True)
class _Live:
    """One client request in flight: its progress, its stream, its legs' tasks, the replicas it lost."""

    progress: RequestProgress
    stream: RequestStream
    legs: dict[asyncio.Task[None], Leg] = field(default_factory=dict)
    lost: set[str] = field(default_factory=set)


class RoutedEngine:
    """An EngineClient (cobatch/server/engine_client.py) whose engine is a deployment of replicas."""

    def __init__(self, handle: DeploymentHandle, served_model_name: str, block_size: int,
                 max_migrations: int, router_name: str = "cobatch") -> None:
        self._handle = handle
        self._generate = handle.options(stream=True, method_name="generate")
        self.block_size = block_size
        self.max_migrations = max_migrations
        self.router_name = router_name
        self.state = EngineState.STARTING
        self.info: EngineInfo | None = None
        self.router_metrics = RouterMetrics(served_model_name)
        self.decisions: deque[dict[str, Any]] = deque(maxlen=_MAX_DECISIONS)
        self._live: dict[str, _Live] = {}
        self._num_routing = 0
        self._start_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Future[Any]] = set()

    # ---- lifecycle ---------------------------------------------------------------------------------

    @property
    def is_started(self) -> bool:
        return self._start_task is not None

    @property
    def is_ready(self) -> bool:
        return self.state == EngineState.READY

    @property
    def is_stalled(self) -> bool:
        return False  # each replica's own health check (check_health) watches its engine

    @property
    def num_queued_requests(self) -> int:
        return self._num_routing

    @property
    def num_live_requests(self) -> int:
        return len(self._live)

    def start(self) -> None:
        """Ready once one replica has told its engine's facts (they are the same on every replica)."""
        self._start_task = asyncio.ensure_future(self._fetch_info())

    async def _fetch_info(self) -> None:
        while self.info is None:
            try:
                self.info = await self._handle.options(method_name="engine_info").remote()
            except Exception:  # noqa: BLE001 - a replica still starting or just lost: ask again
                logger.debug("engine_info failed; retrying", exc_info=True)
            if self.info is None:
                await asyncio.sleep(_INFO_RETRY_S)
        if self.state == EngineState.STARTING:
            self.state = EngineState.READY

    async def drain(self, timeout_s: float) -> int:
        """Stop admission, let live requests finish within `timeout_s`, abort the rest."""
        if self.state == EngineState.READY:
            self.state = EngineState.DRAINING
        deadline = time.monotonic() + timeout_s
        while self._live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        leftover = list(self._live)
        for request_id in leftover:
            self.abort(request_id)
        return len(leftover)

    async def shutdown(self) -> None:
        self.state = EngineState.STOPPED
        for request_id in list(self._live):
            self.abort(request_id)
        if self._start_task is not None:
            self._start_task.cancel()

    # ---- requests ------------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        if self.info is None:
            raise EngineDeadError("the engine is not ready")
        return validate_request(prompt_token_ids, params, self.info.max_model_len, self.info.vocab_size)

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     priority: int = 0) -> RequestStream:
        """Route the request (429 / deadline / 503 refusals raise here) and return its stream."""
        now = time.monotonic()
        progress = RequestProgress(request_id, tuple(prompt_token_ids), params, priority, now)
        live = _Live(progress, RequestStream(request_id, params.n))
        self._live[request_id] = live
        placed: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._start_leg(live, progress.first_leg(now), placed)
        self._num_routing += 1
        try:
            replica = await placed
        except BaseException:
            self.abort(request_id)
            raise
        finally:
            self._num_routing -= 1
        note = ROUTE_NOTE.get()
        if note is not None:
            note.replica = replica
        self.router_metrics.live_requests.set(len(self._live))
        return live.stream

    def joined(self) -> contextlib.nullcontext[None]:
        """Each request is routed on its own (to its replica's next step): nothing to join here."""
        return contextlib.nullcontext()

    def abort(self, request_id: str) -> None:
        """Cancel the request's legs (each cancels its replica call); a no-op once it is gone."""
        live = self._live.pop(request_id, None)
        if live is not None:
            for task in live.legs:
                task.cancel()
        self.router_metrics.live_requests.set(len(self._live))

    def stop_sequence(self, seq_id: str, stop_reason: str) -> None:
        """The server found a stop string: finish the sequence here, and stop it on its replica."""
        request_id, _, index_text = seq_id.partition("#")
        live = self._live.get(request_id)
        index = int(index_text) if index_text else 0
        if live is None or live.progress.finished[index]:
            return
        live.stream.queue.put_nowait(live.progress.finish_locally(index, "stop", stop_reason))
        for task, leg in list(live.legs.items()):
            if index not in leg.indices:
                continue
            if not live.progress.unfinished(leg):
                task.cancel()  # nothing left on that leg: cancelling aborts it on its replica
            else:  # siblings (n > 1) go on: the replica running them stops this one
                engine_seq = f"{leg.call.request_id}#{leg.indices.index(index)}"
                self._in_background(self._handle.broadcast("stop_sequence", engine_seq, stop_reason)
                                    .results_async(return_exceptions=True))

    async def request_status(self, request_id: str) -> list[SequenceWaitStatus] | None:
        """Why the request's sequences wait, from whichever replicas run or ran them (a migrated leg's
        sequences carry their own ids there, "id#i~k", and answer to those)."""
        results = await self._handle.broadcast("request_status", request_id).results_async(
            timeout_s=_METRICS_TIMEOUT_S, return_exceptions=True)
        found = {s.seq_id: s for r in results if isinstance(r, list) for s in r}
        return [found[seq_id] for seq_id in sorted(found)] or None

    async def render_metrics(self) -> tuple[bytes, str] | None:
        """The router's metrics and every replica's engine metrics, in one exposition."""
        texts = [self.router_metrics.render()]
        try:
            results = await self._handle.broadcast("metrics_text").results_async(
                timeout_s=_METRICS_TIMEOUT_S, return_exceptions=True)
        except Exception:  # noqa: BLE001 - a replica set in flux: serve the router's own
            logger.warning("could not collect the replicas' metrics", exc_info=True)
            results = []
        texts += [r for r in results if isinstance(r, bytes)]
        return merge_expositions(texts)

    # ---- legs ------------------------------------------------------------------------------------------

    def _start_leg(self, live: _Live, leg: Leg, placed: asyncio.Future[str] | None) -> None:
        task = asyncio.ensure_future(self._run_leg(live, leg, placed))
        live.legs[task] = leg
        task.add_done_callback(lambda t: live.legs.pop(t, None))

    async def _run_leg(self, live: _Live, leg: Leg, placed: asyncio.Future[str] | None) -> None:
        """Choose a replica, dispatch, stream; on a lost replica, continue the leg elsewhere."""
        ticket = RouteTicket(self._query(live, leg))
        replica: str | None = None
        started = time.monotonic()
        try:
            async with self._generate.choose_replica(ticket) as selection:
                replica = self._admit(ticket, selection.replica_id, started, leg)
                if placed is not None:
                    placed.set_result(replica)
                response = self._generate.dispatch(selection, leg.call)
                await self._stream(live, leg, response, ticket)
        except _LOST as exc:
            self._on_lost(live, leg, replica, exc)
        except DeploymentUnavailableError as exc:
            self._on_refused(live, leg, placed, EngineDeadError(f"no engine replica is running: {exc}"))
        except _REFUSED as exc:
            self._on_refused(live, leg, placed, exc)
        except Exception as exc:  # noqa: BLE001 - a bug here must fail the request, not hang it
            logger.exception("request %s: leg %s failed", live.progress.request_id, leg.call.request_id)
            self._fail(live, placed, RequestFailedError(f"{type(exc).__name__}: {exc}"))
        finally:
            if placed is not None and not placed.done():  # cancelled while routing (shutdown)
                placed.set_exception(EngineDeadError("the request was aborted while being routed"))

    def _query(self, live: _Live, leg: Leg) -> RouteQuery:
        left_ms = live.progress.remaining_deadline_ms(time.monotonic())
        return RouteQuery(
            request_id=leg.call.request_id, prompt_token_ids=leg.call.prompt_token_ids,
            max_tokens=leg.call.params.max_tokens,
            deadline_s=None if left_ms is None else time.time() + left_ms / 1e3,
            exclude=frozenset(live.lost))

    def _admit(self, ticket: RouteTicket, replica: str, started: float, leg: Leg) -> str:
        """Record the decision; raise the refusal it may be (the selection is then released unused)."""
        decision = ticket.decision
        status = decision.status if decision is not None else ROUTED
        self.router_metrics.record_decision(decision, status, replica if status == ROUTED else None,
                                            time.monotonic() - started, self.block_size)
        self.decisions.append(self._record(decision, replica, leg))
        if decision is None or status == ROUTED:
            return replica
        if status == FULL:
            raise EngineOverloadedError(f"the server is overloaded: {decision.reason}; retry later")
        if status == DEADLINE_STATUS:
            raise DeadlineUnreachableError(f"refused before any prefill: {decision.reason}")
        raise EngineDeadError(decision.reason)

    def _record(self, decision: RoutingDecision | None, replica: str, leg: Leg) -> dict[str, Any]:
        if decision is None:  # Ray's own router decided
            return {"request_id": leg.call.request_id, "time_s": time.time(), "status": ROUTED,
                    "chosen": replica, "reason": f"{self.router_name} router"}
        return decision.to_dict()

    async def _stream(self, live: _Live, leg: Leg, response: DeploymentResponseGenerator,
                      ticket: RouteTicket) -> None:
        is_done = False
        num_open = len(leg.indices)
        try:
            async for chunk in response:
                if isinstance(chunk, ReplicaError):
                    self._on_replica_error(live, chunk)
                    break
                for delta in chunk:
                    num_open -= delta.finished
                    if not num_open and ticket.on_finished is not None:
                        ticket.on_finished()  # before the client hears: it may send its next at once
                    self._deliver(live, live.progress.to_client(leg, delta))
            is_done = True
        finally:
            if not is_done:
                response.cancel()  # aborted, or failed: the replica's finally aborts the request

    def _deliver(self, live: _Live, delta: RequestDelta | None) -> None:
        if delta is not None:
            live.stream.queue.put_nowait(delta)

    def _on_replica_error(self, live: _Live, error: ReplicaError) -> None:
        if error.kind == ENGINE_DEAD:
            raise _ReplicaLost(error.message)
        cls = RequestRejectedError if error.kind == REQUEST_REJECTED else RequestFailedError
        self._fail(live, None, cls(error.message))

    def _on_lost(self, live: _Live, leg: Leg, replica: str | None, exc: BaseException) -> None:
        """Continue each unfinished sequence of the leg on another replica, within the limit."""
        progress = live.progress
        if self._live.get(progress.request_id) is not live:
            return  # aborted meanwhile: nobody reads its stream any more
        if replica is not None:
            live.lost.add(replica)
        if progress.num_migrations >= self.max_migrations:
            self.router_metrics.migration_failures.inc()
            self._fail(live, None, EngineDeadError(
                f"replica {replica} was lost ({type(exc).__name__}) and the request has moved "
                f"{progress.num_migrations} times already"))
            return
        progress.num_migrations += 1
        now = time.monotonic()
        for index in progress.unfinished(leg):
            following = progress.continuation(index, now)
            if isinstance(following, Leg):
                self.router_metrics.migrations.inc()
                self._start_leg(live, following, None)
            else:
                self._deliver(live, following)
        logger.warning("request %s: replica %s lost (%s); moved %d sequences", progress.request_id,
                       replica, type(exc).__name__, len(progress.unfinished(leg)))

    def _on_refused(self, live: _Live, leg: Leg, placed: asyncio.Future[str] | None,
                    exc: Exception) -> None:
        if placed is not None and not placed.done():
            placed.set_exception(exc)  # the client's answer: 429, or the deadline refusal, or 503
        elif isinstance(exc, DeadlineUnreachableError):
            for index in live.progress.unfinished(leg):  # a moving leg that cannot make it in time
                self._deliver(live, live.progress.finish_locally(index, DEADLINE))
        else:
            self.router_metrics.migration_failures.inc()
            self._fail(live, None, EngineDeadError(f"no replica could take the request over: {exc}"))

    def _fail(self, live: _Live, placed: asyncio.Future[str] | None, exc: Exception) -> None:
        """Fail the whole request (its other legs are cancelled)."""
        if placed is not None and not placed.done():
            placed.set_exception(exc)
        else:
            live.stream.queue.put_nowait(exc)
        current = asyncio.current_task()
        for task in list(live.legs):
            if task is not current:
                task.cancel()

    def _in_background(self, awaitable: Any) -> None:
        future = asyncio.ensure_future(awaitable)
        self._background.add(future)
        future.add_done_callback(self._background.discard)
