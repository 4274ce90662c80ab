"""Server-sent events, mid-stream errors, and cancelling a non-stream handler when its client leaves."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable
from typing import TypeVar

from pydantic import BaseModel
from starlette.requests import Request

from cobatch.async_engine import EngineDeadError, RequestFailedError, RequestRejectedError
from cobatch.server.errors import APIError

logger = logging.getLogger(__name__)

T = TypeVar("T")
DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# A stream's headers go out before its first token: the id to ask GET /debug/requests/{id} while waiting.
REQUEST_ID_HEADER = "x-request-id"


def sse_headers(request_id: str) -> dict[str, str]:
    """The headers of a request's event stream."""
    return {**SSE_HEADERS, REQUEST_ID_HEADER: request_id}


class ClientDisconnected(Exception):
    """The client went away before its non-stream answer was ready."""


def sse(payload: BaseModel | dict[str, object]) -> str:
    """One SSE `data:` event holding a JSON object."""
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


def engine_failure(exc: Exception) -> APIError:
    """The 500 a request gets when its step failed or the engine died under it (400 if refused)."""
    if isinstance(exc, RequestRejectedError):  # bad input the front door could not see: the client's
        return APIError(400, f"the request was refused: {exc}", code="invalid_request")
    if isinstance(exc, RequestFailedError):
        return APIError(500, f"generation failed: {exc}", code="engine_step_failed")
    if isinstance(exc, EngineDeadError):
        return APIError(500, f"the engine failed: {exc}", code="engine_dead")
    raise exc


def error_event(exc: Exception) -> str:
    """An SSE error event (what the openai client raises as APIError); [DONE] follows it."""
    return sse(engine_failure(exc).body())


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read already, so the next ASGI message is the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (its finally aborts the request) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()  # the handler itself is cancelled (shutdown): the work goes with it
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the client is gone either way
        pass
    raise ClientDisconnected()
