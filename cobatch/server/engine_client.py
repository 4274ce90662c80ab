"""What the HTTP server needs of an engine: AsyncEngine's interface, as a Protocol.

A single `cobatch serve` passes its AsyncEngine; the Ray ingress (cobatch/ray) passes a client that
routes each request to one of several engine replicas. The server is written against this shape
only, so both get the same endpoints, errors, /metrics and /health.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from typing import Protocol

# DeadlineUnreachableError lives with the engine (AsyncEngine.submit raises it too); named here for the server.
from cobatch.async_engine import DeadlineUnreachableError, EngineInfo, EngineState
from cobatch.outputs import RequestDelta
from cobatch.sampling_params import SamplingParams
from cobatch.wait_reasons import SequenceWaitStatus

__all__ = ["DeadlineUnreachableError", "EngineClient", "EngineOverloadedError", "OutputStream"]


class EngineOverloadedError(RuntimeError):
    """No engine can take the request now (every queue is at its bound): the client retries later."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class OutputStream(Protocol):
    """A request's deltas (all its n sequences) until each has finished."""

    def __aiter__(self) -> AsyncIterator[RequestDelta]: ...


class EngineClient(Protocol):
    """The engine as the server sees it (AsyncEngine, or a router over replicas)."""

    state: EngineState
    info: EngineInfo | None

    @property
    def is_started(self) -> bool: ...

    @property
    def is_ready(self) -> bool: ...

    @property
    def is_stalled(self) -> bool: ...

    @property
    def num_queued_requests(self) -> int: ...

    def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int: ...

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     priority: int = 0) -> OutputStream: ...

    def joined(self) -> AbstractContextManager[None]:
        """Requests submitted inside join the same engine step (a router: no-op, each is routed)."""
        ...

    def abort(self, request_id: str) -> None: ...

    def stop_sequence(self, seq_id: str, stop_reason: str) -> None: ...

    async def render_metrics(self) -> tuple[bytes, str] | None: ...

    async def request_status(self, request_id: str) -> list[SequenceWaitStatus] | None:
        """Why each sequence of a request is waiting (GET /debug/requests/{id}); None if unknown."""
        ...
