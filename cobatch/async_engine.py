"""AsyncEngine: one engine thread owns the Engine; the event loop talks to it through an inbox.

    event loop (HTTP handlers)                 engine thread (owns Engine, scheduler, runner)
    add / abort / stop / drain  --inbox-->     drain inbox -> engine.step() -> publish
    RequestStream (asyncio.Queue) <--call_soon_threadsafe-- deltas, StepStats, snapshot

Everything the loop reads (streams, snapshot, counters) is written on the loop; everything the engine
owns is touched only by the engine thread. No locks: the inbox and call_soon_threadsafe are the only
crossings.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cobatch.config import EngineConfig
from cobatch.cost_model import predict_prefill_s
from cobatch.engine import Engine, Runner, StepStats
from cobatch.metrics import EngineMetrics
from cobatch.outputs import RequestDelta
from cobatch.sampling_params import SamplingParams
from cobatch.scheduler import SchedulerStats
from cobatch.step_history import StepHistory
from cobatch.wait_reasons import SequenceWaitStatus

if TYPE_CHECKING:
    from cobatch.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 1.0  # an idle engine thread wakes this often: to notice a stop, and for the thread policy
_QUERY_TIMEOUT_S = 30.0  # a question to the engine thread waits at most its current step


class EngineState(enum.Enum):
    """Lifecycle: STARTING -> READY -> DRAINING -> STOPPED, or DEAD from any of them."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    DEAD = "dead"


class EngineDeadError(RuntimeError):
    """The engine thread died (or failed to load): no request can be served any more."""


class RequestFailedError(RuntimeError):
    """One request failed (its step raised in the runner); the engine goes on."""


class RequestRejectedError(RequestFailedError):
    """The engine refused a request at admission (invalid there, though it passed the front door)."""


class DeadlineUnreachableError(RuntimeError):
    """No engine is predicted to start the request within its deadline: refused before any prefill."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """Static facts about the loaded engine, published once when it is ready."""

    max_model_len: int
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_concurrency: float
    max_num_batched_tokens: int
    vocab_size: int | None
    dtype: str
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Read by the engine thread after each loop turn: for /metrics, 429s and (later) a replica router."""

    scheduler: SchedulerStats = SchedulerStats()
    num_steps: int = 0
    num_adds_processed: int = 0
    num_add_tokens_processed: int = 0  # prompt tokens of those adds
    # The engine's fitted step-time models (cost_model features), all zero until each is ready.
    step_coefficients: tuple[float, ...] = ()
    decode_coefficients: tuple[float, ...] = ()


# ---- inbox commands -------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _StopSequence:
    seq_id: str
    stop_reason: str


@dataclass(frozen=True, slots=True)
class _Shutdown:
    pass


@dataclass(frozen=True, slots=True)
class _Query:
    """A read-only question for the engine thread; its answer resolves `future` on the loop."""

    ask: Callable[[Engine], object]
    future: asyncio.Future[object]


_Command = _Add | _Abort | _StopSequence | _Shutdown | _Query
_InboxItem = _Command | list[_Add]  # a list: adds that join one step (AsyncEngine.joined)


@dataclass(slots=True)
class _Published:
    """What one engine-loop turn hands to the event loop."""

    deltas: list[RequestDelta]
    rejected: list[tuple[str, str]]  # (request id, why): adds the engine refused
    stats: StepStats | None
    snapshot: EngineSnapshot
    time: float


# ---- per-request stream ---------------------------------------------------------------------------

@dataclass(slots=True)
class RequestStream:
    """The deltas of one request (all its n sequences), read on the event loop."""

    request_id: str
    num_seqs: int
    queue: asyncio.Queue[RequestDelta | BaseException] = field(default_factory=asyncio.Queue)
    num_unfinished: int = 0
    last_token_time: dict[str, float] = field(default_factory=dict)  # seq id -> for ITL

    def __post_init__(self) -> None:
        self.num_unfinished = self.num_seqs

    @property
    def is_finished(self) -> bool:
        return self.num_unfinished == 0

    async def __aiter__(self) -> AsyncIterator[RequestDelta]:
        """Deltas until every sequence finished; raises EngineDeadError / RequestFailedError."""
        num_open = self.num_seqs
        while num_open:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            num_open -= item.finished
            yield item


# ---- the engine --------------------------------------------------------------------------------------

class AsyncEngine:
    """Runs an Engine on its own thread and serves per-request async streams to the event loop."""

    def __init__(self, engine_factory: Callable[[], Engine], metrics: EngineMetrics | None = None,
                 watchdog_timeout_s: float = 60.0,
                 on_dead: Callable[[str], None] | None = None,
                 on_ready: Callable[[EngineInfo], None] | None = None,
                 on_finished: Callable[[RequestDelta, StepHistory], None] | None = None) -> None:
        self._factory = engine_factory
        self.metrics = metrics
        self.watchdog_timeout_s = watchdog_timeout_s
        self._on_dead = on_dead
        self._on_ready = on_ready
        self._on_finished = on_finished  # e.g. tracing: called on the loop for each finished sequence
        self._inbox: queue.SimpleQueue[_InboxItem] = queue.SimpleQueue()
        self._joined: list[_Add] | None = None  # adds held back until joined() ends
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Written by the engine thread, read by the loop: single attribute stores, no lock needed.
        self._engine: Engine | None = None
        self._busy_since: float | None = None  # start of the step in progress (watchdog)
        # Last time the engine was idle or ran a step with rows: the watchdog's "is it progressing".
        self._last_progress: float = time.monotonic()
        self._thread_state = EngineState.STARTING
        # Loop-side state.
        self.state = EngineState.STARTING
        self.info: EngineInfo | None = None
        self.dead_reason: str | None = None
        self.snapshot = EngineSnapshot()
        self._streams: dict[str, RequestStream] = {}
        self._work_since = 0.0  # when live requests last appeared after none: progress is due after
        self._num_adds_sent = 0
        self._num_add_tokens_sent = 0
        self.history = StepHistory()  # the last steps and finishes, for the dashboard and tracing

    @classmethod
    def from_config(cls, config: EngineConfig, wrap_runner: Callable[[Runner], Runner] | None = None,
                    tokenizer: Tokenizer | None = None, **kwargs: object) -> AsyncEngine:
        """An AsyncEngine whose thread loads the model described by `config` when started (grammars
        built on `tokenizer`, when the caller has loaded it)."""
        return cls(lambda: _load_for_serving(config, wrap_runner, tokenizer), **kwargs)  # type: ignore[arg-type]

    # ---- lifecycle (event loop) ----------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (call from the running event loop); it loads the engine first."""
        assert self._thread is None, "already started"
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._thread_main, name="cobatch-engine", daemon=True)
        self._thread.start()

    @property
    def is_started(self) -> bool:
        return self._thread is not None

    @property
    def is_ready(self) -> bool:
        return self.state == EngineState.READY

    @property
    def is_accepting(self) -> bool:
        """New requests are admitted only while READY (not starting, draining, stopped or dead)."""
        return self.state == EngineState.READY

    @property
    def is_stalled(self) -> bool:
        """The watchdog: one step runs too long, or work is pending and no step has done any."""
        now, limit = time.monotonic(), self.watchdog_timeout_s
        busy_since = self._busy_since
        if busy_since is not None and now - busy_since > limit:
            return True
        # A wedged engine thread, or a scheduler that schedules nothing, never starts a long
        # step: only the absence of progress while requests are live shows it.
        has_work = bool(self._streams) or self._num_adds_sent > self.snapshot.num_adds_processed
        return has_work and now - max(self._last_progress, self._work_since) > limit

    @property
    def is_healthy(self) -> bool:
        """Alive and making progress (what /health reports)."""
        return self.state in (EngineState.READY, EngineState.DRAINING) and not self.is_stalled

    @property
    def num_live_requests(self) -> int:
        return len(self._streams)

    @property
    def num_queued_requests(self) -> int:
        """Requests waiting for a seat: engine's waiting queue plus adds it has not seen yet."""
        unseen = self._num_adds_sent - self.snapshot.num_adds_processed
        return self.snapshot.scheduler.num_waiting_requests + max(0, unseen)

    @property
    def num_unseen_prompt_tokens(self) -> int:
        """Prompt tokens of the adds the engine thread has not taken yet: prefill queued ahead of
        the next request, though no snapshot shows it."""
        return max(0, self._num_add_tokens_sent - self.snapshot.num_add_tokens_processed)

    async def drain(self, timeout_s: float) -> int:
        """Stop admission, let live requests finish within `timeout_s`, abort the rest."""
        if self.state == EngineState.READY:
            self.state = EngineState.DRAINING
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline and self.state == EngineState.DRAINING:
            await asyncio.sleep(0.05)
        leftover = list(self._streams)
        for request_id in leftover:
            self.abort(request_id)
        # Aborts finish within one engine turn; give streams a moment to deliver "abort".
        grace_end = time.monotonic() + 5.0
        while self._streams and time.monotonic() < grace_end and self.state != EngineState.DEAD:
            await asyncio.sleep(0.02)
        return len(leftover)

    async def shutdown(self, join_timeout_s: float = 5.0) -> None:
        """Stop the engine thread (after drain); live streams, if any, fail."""
        if self.state != EngineState.DEAD:
            self.state = EngineState.STOPPED
        self._inbox.put(_Shutdown())
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, join_timeout_s)
        self._fail_all(EngineDeadError("the server is shutting down"))

    # ---- requests (event loop) -------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request fits the model (ValueError if not); reads only immutable engine config."""
        engine = self._engine
        if engine is None:
            raise EngineDeadError("the engine is not ready")
        return engine.validate(prompt_token_ids, params)

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            priority: int = 0) -> RequestStream:
        """Submit a request; it joins the batch at the engine's next step."""
        if self.state == EngineState.DEAD:
            raise EngineDeadError(self.dead_reason or "the engine is dead")
        assert request_id not in self._streams, f"duplicate request id {request_id}"
        stream = RequestStream(request_id, params.n)
        if not self._streams:
            self._work_since = time.monotonic()  # the engine may have been idle for long
        self._streams[request_id] = stream
        self._num_adds_sent += 1
        self._num_add_tokens_sent += len(prompt_token_ids)
        add = _Add(request_id, list(prompt_token_ids), params, priority, time.monotonic())
        if self._joined is not None:
            self._joined.append(add)
        else:
            self._inbox.put(add)
        return stream

    @contextlib.contextmanager
    def joined(self) -> Iterator[None]:
        """The requests added inside reach the engine thread as one inbox item, so they join the same
        step: put one by one, the thread could wake at the first and step before the others arrive."""
        self._joined = []
        try:
            yield
        finally:
            adds, self._joined = self._joined, None
            if adds:
                self._inbox.put(adds)

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     priority: int = 0) -> RequestStream:
        """`add` in the server's EngineClient shape (a routed client picks a replica first).

        DeadlineUnreachableError if the request's first token is predicted past its deadline.
        """
        if params.deadline_ms is not None:
            self._check_deadline(len(prompt_token_ids), params.deadline_ms)
        return self.add(request_id, prompt_token_ids, params, priority)

    def predict_ttft_s(self, num_prompt_tokens: int) -> float:
        """Seconds to a new request's first token, as of the last snapshot (0 until the model is fitted).

        The prefill queued ahead of it (waiting, and running chunks) and its whole prompt, in budget
        chunks beside the running decode rows, priced by the fitted step-time model. Optimistic on
        load (no wait for a seat), pessimistic on a prompt whose prefix is cached (the loop cannot
        see the cache).
        """
        stats, info = self.snapshot.scheduler, self.info
        if info is None:
            return 0.0
        return predict_prefill_s(
            self.snapshot.step_coefficients,
            stats.num_waiting_tokens + stats.num_running_prefill_tokens + self.num_unseen_prompt_tokens
            + num_prompt_tokens,
            stats.num_running, stats.num_running_tokens, info.max_num_batched_tokens)

    def _check_deadline(self, num_prompt_tokens: int, deadline_ms: float) -> None:
        ttft_ms = self.predict_ttft_s(num_prompt_tokens) * 1e3
        if ttft_ms <= deadline_ms:
            return
        if self.metrics is not None:
            self.metrics.record_deadline_refused()
        stats = self.snapshot.scheduler
        raise DeadlineUnreachableError(
            f"the request cannot meet its deadline of {deadline_ms:g} ms: its first token is "
            f"predicted after {ttft_ms:.0f} ms ({num_prompt_tokens} prompt tokens to prefill behind "
            f"{stats.num_waiting_tokens + stats.num_running_prefill_tokens} queued)")

    async def render_metrics(self) -> tuple[bytes, str] | None:
        """The Prometheus exposition of this engine's metrics (None without metrics)."""
        return self.metrics.render() if self.metrics is not None else None

    def abort(self, request_id: str) -> None:
        """Abort a request if it is still live (client gone, drain timeout); no-op otherwise."""
        stream = self._streams.get(request_id)
        if stream is not None and not stream.is_finished:
            self._inbox.put(_Abort(request_id))

    def stop_sequence(self, seq_id: str, stop_reason: str) -> None:
        """Finish one sequence with "stop" (the server found a stop string in its text)."""
        self._inbox.put(_StopSequence(seq_id, stop_reason))

    async def request_status(self, request_id: str) -> list[SequenceWaitStatus] | None:
        """Why each sequence of a request (or one "id#i") is waiting; None if it is neither live nor kept.

        Live sequences are asked of the engine thread (answered between two steps); finished ones come
        from the finishing deltas the history keeps.
        """
        statuses = {d.request_id: _finished_status(d) for d in self.history.finished_of(request_id)}
        if request_id.split("#", 1)[0] in self._streams and self.state != EngineState.DEAD:
            future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
            self._inbox.put(_Query(lambda engine: engine.request_status(request_id), future))
            live = await asyncio.wait_for(future, _QUERY_TIMEOUT_S)
            statuses.update({s.seq_id: s for s in live or ()})  # type: ignore[attr-defined]
        return [statuses[seq_id] for seq_id in sorted(statuses)] or None

    # ---- event-loop side of publishing -----------------------------------------------------------

    def _dispatch(self, published: _Published) -> None:
        self.snapshot = published.snapshot
        if published.stats is not None:
            self.history.record_step(published.stats)
        if self.metrics is not None:
            self._record_metrics(published)
        for request_id, reason in published.rejected:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.queue.put_nowait(RequestRejectedError(reason))
        for delta in published.deltas:
            self._route(delta, published.time)

    def _route(self, delta: RequestDelta, now: float) -> None:
        stream = self._streams.get(delta.parent_id)
        if stream is None:
            return  # its stream is gone (already failed); nothing to deliver
        if self.metrics is not None and delta.new_token_ids:
            last = stream.last_token_time.get(delta.request_id)
            if last is not None:  # a verified speculative run: its tokens share the gap
                num_tokens = len(delta.new_token_ids)
                for _ in range(num_tokens):
                    self.metrics.record_inter_token_latency((now - last) / num_tokens)
            stream.last_token_time[delta.request_id] = now
        if delta.finished:
            stream.num_unfinished -= 1
            self.history.record_finished(delta)
            if self._on_finished is not None:
                self._on_finished(delta, self.history)
            if self.metrics is not None:
                self.metrics.record_finished(delta)
        if delta.error is not None:
            # One failed sequence fails the request; its siblings (n > 1) must not run on.
            stream.num_unfinished = 0
            self._streams.pop(delta.parent_id, None)
            self._inbox.put(_Abort(delta.parent_id))
            stream.queue.put_nowait(RequestFailedError(delta.error))
            return
        if stream.is_finished:
            self._streams.pop(delta.parent_id, None)
        stream.queue.put_nowait(delta)

    def _record_metrics(self, published: _Published) -> None:
        assert self.metrics is not None
        snap = published.snapshot.scheduler
        self.metrics.set_engine_state(snap.num_running, snap.num_waiting, snap.num_swapped,
                                      snap.kv_usage, snap.prefix_cache_hit_rate)
        if published.stats is not None:
            self.metrics.record_step(published.stats)

    def _on_thread_ready(self, info: EngineInfo) -> None:
        self.info = info
        if self.state == EngineState.STARTING:
            self.state = EngineState.READY
        if self._on_ready is not None:
            self._on_ready(info)

    def _on_thread_dead(self, reason: str) -> None:
        self.state = EngineState.DEAD
        self.dead_reason = reason
        self._fail_all(EngineDeadError(reason))
        if self._on_dead is not None:
            self._on_dead(reason)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.queue.put_nowait(error)

    def _call_loop(self, callback: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: the process is exiting anyway
            pass

    # ---- engine thread ---------------------------------------------------------------------------

    def _thread_main(self) -> None:
        try:
            engine = self._factory()
        except BaseException as exc:  # noqa: BLE001 - any load failure makes the server unusable
            logger.exception("the engine failed to start")
            self._call_loop(self._on_thread_dead, f"the engine failed to start: {exc}")
            return
        self._engine = engine
        self._call_loop(self._on_thread_ready, _info_of(engine))
        try:
            self._loop_forever(engine)
        except BaseException as exc:  # noqa: BLE001 - a bug in the engine kills the loop for good
            self._busy_since = None
            logger.exception("the engine loop died")
            self._call_loop(self._on_thread_dead, f"the engine loop died: {type(exc).__name__}: {exc}")

    def _loop_forever(self, engine: Engine) -> None:
        num_adds = num_add_tokens = 0
        while True:
            commands = self._next_commands(block=not engine.has_unfinished_requests())
            if not engine.has_unfinished_requests():
                self._last_progress = time.monotonic()  # idle until now: nothing was late
                if not commands:  # a whole poll with nothing to do
                    engine.on_idle()
            deltas: list[RequestDelta] = []
            rejected: list[tuple[str, str]] = []
            for command in commands:
                if isinstance(command, _Shutdown):
                    return
                if isinstance(command, _Add):
                    num_adds += 1
                    num_add_tokens += len(command.prompt_token_ids)
                self._apply(engine, command, deltas, rejected)
            stats = self._step(engine, deltas) if engine.has_unfinished_requests() else None
            if commands or stats is not None:
                self._call_loop(self._dispatch, _Published(
                    deltas, rejected, stats, _snapshot_of(engine, num_adds, num_add_tokens), time.monotonic()))

    def _next_commands(self, block: bool) -> list[_Command]:
        commands: list[_InboxItem] = []
        if block:
            try:
                commands.append(self._inbox.get(timeout=_IDLE_POLL_S))
            except queue.Empty:
                return []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return [c for item in commands for c in (item if isinstance(item, list) else [item])]

    def _apply(self, engine: Engine, command: _Command, deltas: list[RequestDelta],
               rejected: list[tuple[str, str]]) -> None:
        if isinstance(command, _Add):
            try:
                engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                   command.priority, command.arrival_time)
            except ValueError as exc:  # validated on the loop already; a race or a duplicate id
                rejected.append((command.request_id, str(exc)))
        elif isinstance(command, _Abort):
            deltas.extend(engine.abort_request(command.request_id))
        elif isinstance(command, _StopSequence):
            delta = engine.stop_sequence(command.seq_id, command.stop_reason)
            if delta is not None:
                deltas.append(delta)
        elif isinstance(command, _Query):
            try:
                answer: object = command.ask(engine)
            except Exception as exc:  # noqa: BLE001 - a bad question must not kill the engine loop
                answer = exc
            self._call_loop(_resolve, command.future, answer)

    def _step(self, engine: Engine, deltas: list[RequestDelta]) -> StepStats | None:
        num_steps = engine.num_steps
        self._busy_since = time.monotonic()
        deltas.extend(engine.step())
        self._busy_since = None
        stats = engine.stats[-1] if engine.num_steps > num_steps and engine.stats else None
        if stats is not None and stats.num_rows > 0:
            self._last_progress = time.monotonic()
        return stats


def _resolve(future: asyncio.Future[object], answer: object) -> None:
    if future.done():  # the asker timed out
        return
    if isinstance(answer, Exception):
        future.set_exception(answer)
    else:
        future.set_result(answer)


def _finished_status(delta: RequestDelta) -> SequenceWaitStatus:
    """A finished sequence's wait record, from the metrics of its finishing delta."""
    metrics = delta.metrics
    return SequenceWaitStatus(
        seq_id=delta.request_id, state="finished", step=-1, reason=None,
        wait_steps=dict(metrics.wait_steps) if metrics is not None else {},
        preemptions=metrics.preemptions if metrics is not None else (),
        finish_reason=delta.finish_reason)


def _snapshot_of(engine: Engine, num_adds: int, num_add_tokens: int) -> EngineSnapshot:
    return EngineSnapshot(engine.scheduler.stats(), engine.num_steps, num_adds, num_add_tokens,
                          engine.step_time_model.fitted_coefficients,
                          engine.decode_time_model.fitted_coefficients)


def _info_of(engine: Engine) -> EngineInfo:
    runner = engine.runner
    model_config = getattr(runner, "model_config", None)
    return EngineInfo(
        max_model_len=engine.max_model_len, num_kv_blocks=engine.config.num_kv_blocks,
        block_size=engine.config.block_size, max_num_seqs=engine.config.max_num_seqs,
        max_concurrency=engine.config.max_concurrency,
        max_num_batched_tokens=engine.config.max_num_batched_tokens,
        vocab_size=getattr(model_config, "vocab_size", None),
        dtype=str(getattr(runner, "dtype", "unknown")).removeprefix("torch."),
        eos_token_ids=tuple(runner.eos_token_ids))


def _load_for_serving(config: EngineConfig, wrap_runner: Callable[[Runner], Runner] | None,
                      tokenizer: Tokenizer | None) -> Engine:
    """Load the engine, make its KV pool resident (the server's memory is flat from the start) and
    build the grammar backend's tokenizer info before the first step (see its warm_up)."""
    engine = Engine.from_config(config, wrap_runner=wrap_runner, tokenizer=tokenizer)
    engine.prefault_kv_cache()
    if engine.structured_outputs is not None:
        engine.structured_outputs.warm_up()
    return engine
