"""The dashboard's routes: the page and its static files, the live event stream, request timelines.

    GET /dashboard                     index.html (no build step: plain JS + canvas, shipped in the package)
    GET /dashboard/static/{name}       dashboard.js, dashboard.css
    GET /dashboard/events              server-sent events: hello, then a tick per replica per interval
    GET /dashboard/requests/{id}       one request's timeline from the kept steps (404 once forgotten)

The engine's only cost is the StepHistory it keeps anyway; each connected page costs one poll of
the history per interval on the event loop, bounded by MAX_STEPS_PER_TICK and MAX_CLIENTS.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from cobatch.async_engine import EngineState
from cobatch.server.dashboard.events import hello_event, request_timeline, sse, tick_event
from cobatch.server.engine_client import EngineClient
from cobatch.server.errors import APIError
from cobatch.server.streaming import SSE_HEADERS
from cobatch.step_history import HistoryCursor, StepHistory

INTERVAL_S = 0.15  # a page's refresh period: steps are batched, never sent one by one
BACKLOG_STEPS = 300  # what a page that just connected draws at once
MAX_STEPS_PER_TICK = 1024  # beyond it a slow page skips the oldest steps
MAX_CLIENTS = 16
RECONNECT_MS = 1000  # EventSource's retry after the stream ends (server restart, drain)
_STATIC_TYPES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
_LIVE_STATES = (EngineState.STARTING, EngineState.READY)


@dataclass(slots=True)
class _Cursor:
    """What one connection has sent of one replica's history."""

    read: HistoryCursor = field(default_factory=HistoryCursor)
    state: str = ""
    is_new: bool = True  # nothing sent yet: the backlog goes first


@dataclass(slots=True)
class _Dashboard:
    engine: EngineClient
    feeds: Mapping[str, StepHistory]  # replica name -> its history
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    num_clients: int = 0


def add_dashboard_routes(app: FastAPI, engine: EngineClient, feeds: Mapping[str, StepHistory]) -> None:
    """Serve the live page over `feeds` (one StepHistory per replica; a single engine has one)."""
    board = _Dashboard(engine, feeds)
    static = resources.files("cobatch.server.dashboard") / "static"
    index_html = (static / "index.html").read_text()
    files = {name: (static / name).read_bytes() for name in _STATIC_TYPES}

    @app.get("/dashboard", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(index_html, headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def static_file(name: str) -> Response:
        if name not in files:
            raise APIError(404, f"no dashboard file {name!r}", code="not_found")
        return Response(files[name], media_type=_STATIC_TYPES[name], headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/events", include_in_schema=False)
    async def events() -> StreamingResponse:
        if board.num_clients >= MAX_CLIENTS:
            raise APIError(503, f"the dashboard serves at most {MAX_CLIENTS} pages at once",
                           code="service_unavailable")
        return StreamingResponse(_event_stream(board), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    @app.get("/dashboard/requests/{request_id}", include_in_schema=False)
    async def request_detail(request_id: str) -> JSONResponse:
        for replica, history in feeds.items():
            timeline = request_timeline(request_id, replica, history)
            if timeline is not None:
                return JSONResponse(timeline)
        raise APIError(404, f"request {request_id!r} is not in the dashboard's recent steps",
                       code="not_found")


async def _event_stream(board: _Dashboard) -> AsyncIterator[str]:
    """hello, then ticks until the client leaves or the engine stops serving (the page reconnects)."""
    board.num_clients += 1
    try:
        infos = {name: board.engine.info for name in board.feeds}
        yield f"retry: {RECONNECT_MS}\n\n" + sse("hello", hello_event(
            board.boot_id, board.engine.state.value, int(INTERVAL_S * 1e3), infos))
        cursors: dict[str, _Cursor] = {}  # per replica; a replicated deployment's set may grow
        while True:
            state = board.engine.state
            for name, history in board.feeds.items():
                chunk = _next_tick(name, history, cursors.setdefault(name, _Cursor()), state.value)
                if chunk:
                    yield chunk
            if state not in _LIVE_STATES:
                return  # a draining server must not wait on open pages to stop
            await asyncio.sleep(INTERVAL_S)
    finally:
        board.num_clients -= 1


def _next_tick(replica: str, history: StepHistory, cursor: _Cursor, state: str) -> str:
    """The tick event for what `cursor` has not sent yet ("" when nothing changed)."""
    steps, finished = cursor.read.take(history, BACKLOG_STEPS if cursor.is_new else MAX_STEPS_PER_TICK)
    if not steps and not finished and state == cursor.state:
        return ""
    cursor.state, cursor.is_new = state, False
    return sse("tick", tick_event(replica, state, steps, finished))
