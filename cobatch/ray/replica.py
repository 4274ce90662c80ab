"""EngineReplica: one AsyncEngine per Ray Serve replica, streaming its requests' deltas to the ingress.

Serve calls, besides `generate`: `record_routing_stats` (the controller, every
request_routing_stats_period_s: what the cobatch router scores with), `check_health` (fails while
work is pending and no step completes within the watchdog time), and `__del__` at shutdown. The
ingress also calls `engine_info`, and broadcasts `metrics_text`, `stop_sequence`, `request_status`,
`dashboard_feed` (while a page is open) and `inject_fault`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray import serve

from cobatch.async_engine import (AsyncEngine, EngineDeadError, EngineInfo, EngineState,
                                  RequestFailedError, RequestRejectedError)
from cobatch.cost_model import NO_COEFFICIENTS
from cobatch.engine import Runner
from cobatch.metrics import EngineMetrics
from cobatch.ray.app_config import AppConfig
from cobatch.ray.arrivals import RecentArrivals
from cobatch.ray.chunking import chunked
from cobatch.ray.dashboard_feed import MAX_FEED_STEPS, FeedBatch
from cobatch.ray.scoring import ReplicaStats
from cobatch.ray.wire import (ENGINE_DEAD, REQUEST_FAILED, REQUEST_REJECTED, Chunk, GenerateCall,
                              ReplicaError)
from cobatch.step_history import HistoryCursor
from cobatch.wait_reasons import SequenceWaitStatus

_READY_POLL_S = 0.05


class EngineReplica:
    """A Serve deployment class: one engine, its metrics, its routing stats."""

    async def __init__(self, config: AppConfig, served_model_name: str) -> None:
        self.name: str = serve.get_replica_context().replica_tag
        self.config = config
        self.faults, wrap_runner = _fault_injection(config.enable_fault_injection)
        self.engine = AsyncEngine.from_config(
            config.engine_config(), wrap_runner=wrap_runner,
            metrics=EngineMetrics(served_model_name, replica=self.name),
            watchdog_timeout_s=config.watchdog_timeout_s)
        self.engine.start()
        self._feed_cursor = HistoryCursor()
        self.arrivals = RecentArrivals()
        # Ready only once the model is loaded: Serve routes nothing to a replica still in __init__.
        while self.engine.state == EngineState.STARTING:
            await asyncio.sleep(_READY_POLL_S)
        if self.engine.state == EngineState.DEAD:
            raise RuntimeError(self.engine.dead_reason or "the engine failed to start")

    async def generate(self, call: GenerateCall) -> AsyncIterator[Chunk]:
        """The call's deltas in chunks (the first at once), or a ReplicaError as the last chunk.

        The finally aborts the engine request: when the client disconnects, Serve cancels this call.
        """
        try:
            stream = self.engine.add(call.request_id, list(call.prompt_token_ids), call.params,
                                     call.priority)
            # After the add: a record that lists the arrival counts the request.
            self.arrivals.add(call.request_id, time.time())
            async for chunk in chunked(stream, self.config.stream_interval_ms / 1e3):
                yield chunk
        except EngineDeadError as exc:
            yield ReplicaError(ENGINE_DEAD, str(exc))
        except RequestRejectedError as exc:
            yield ReplicaError(REQUEST_REJECTED, str(exc))
        except RequestFailedError as exc:
            yield ReplicaError(REQUEST_FAILED, str(exc))
        finally:
            self.engine.abort(call.request_id)

    def record_routing_stats(self) -> dict[str, Any]:
        """This replica's telemetry for the router (cobatch.ray.scoring.ReplicaStats as a dict)."""
        return routing_stats(self.name, self.engine, self.config.max_queued_requests,
                             self.arrivals).to_dict()

    def check_health(self) -> None:
        """Raise (Serve replaces the replica) when the engine is dead or makes no progress."""
        if self.engine.state == EngineState.DEAD:
            raise RuntimeError(f"the engine is dead: {self.engine.dead_reason}")
        if self.engine.is_stalled:
            raise RuntimeError(f"no step completed for {self.engine.watchdog_timeout_s:.0f} s "
                               "with work pending")

    def engine_info(self) -> EngineInfo | None:
        return self.engine.info

    def dashboard_feed(self) -> FeedBatch:
        """The steps and finishes recorded since the ingress last asked (for its mirror of the page)."""
        return FeedBatch.take(self.name, self.engine.history, self._feed_cursor, MAX_FEED_STEPS)

    async def request_status(self, request_id: str) -> list[SequenceWaitStatus] | None:
        """Why the request's sequences wait, if this replica runs or ran it (GET /debug/requests/{id})."""
        return await self.engine.request_status(request_id)

    def metrics_text(self) -> bytes:
        return self.engine.metrics.render()[0] if self.engine.metrics is not None else b""

    def stop_sequence(self, seq_id: str, stop_reason: str) -> None:
        """Finish one sequence with "stop" (a no-op on the replicas that do not run it)."""
        self.engine.stop_sequence(seq_id, stop_reason)

    def inject_fault(self, kind: str, seconds: float, num_steps: int, replica: str | None) -> bool:
        """Test-only: a fault for this replica's engine (if `replica` names it, or is None)."""
        if self.faults is None:
            raise ValueError("fault injection is off (enable_fault_injection)")
        if replica is not None and replica != self.name:
            return False
        self.faults.inject(kind, seconds, num_steps)
        return True

    async def __del__(self) -> None:
        # Serve has drained this replica's calls already (graceful_shutdown_timeout_s): abort the rest.
        await self.engine.drain(0.0)
        await self.engine.shutdown()


def routing_stats(replica_id: str, engine: AsyncEngine, max_queued_requests: int | None,
                  arrivals: RecentArrivals) -> ReplicaStats:
    """The engine's last snapshot as the router's ReplicaStats.

    Adds the engine thread has not taken yet count as waiting, their prompts as waiting tokens: a
    router stops counting a request of its own once a record lists its arrival, so a record that
    showed it as a seat without its prefill would make its replica look idle.
    """
    now_s = time.time()
    snap, info = engine.snapshot, engine.info
    s = snap.scheduler
    num_unseen = engine.num_queued_requests - s.num_waiting_requests
    num_blocks = s.num_kv_blocks or (info.num_kv_blocks if info else 0)
    return ReplicaStats(
        replica_id=replica_id, time_s=now_s, block_size=info.block_size if info else 16,
        num_kv_blocks=num_blocks, num_kv_blocks_free=num_blocks - s.num_kv_blocks_used,
        num_running=s.num_running, num_waiting=s.num_waiting + num_unseen, num_swapped=s.num_swapped,
        num_waiting_requests=engine.num_queued_requests, num_running_tokens=s.num_running_tokens,
        num_running_prefill_tokens=s.num_running_prefill_tokens,
        num_waiting_tokens=s.num_waiting_tokens + engine.num_unseen_prompt_tokens,
        num_swapped_tokens=s.num_swapped_tokens,
        max_num_seqs=info.max_num_seqs if info else 1,
        max_num_batched_tokens=info.max_num_batched_tokens if info else 2048,
        max_num_waiting_requests=max_queued_requests,
        step_coefficients=snap.step_coefficients or NO_COEFFICIENTS,
        decode_coefficients=snap.decode_coefficients or NO_COEFFICIENTS,
        mean_output_tokens=s.mean_output_tokens, num_evictions_total=s.num_evictions_total,
        recent_evicted_hashes=s.recent_evicted_hashes, recent_arrivals=arrivals.listed(now_s))


def _fault_injection(enabled: bool) -> tuple[Any, Callable[[Runner], Runner] | None]:
    """Test-only --enable-fault-injection: the injector and the runner wrapper (cobatch.testing)."""
    if not enabled:
        return None, None
    from cobatch.testing.faults import FaultInjector

    injector = FaultInjector()
    return injector, injector.wrap
