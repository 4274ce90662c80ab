"""GET /debug/requests/{request_id}: why a request's sequences are waiting, as the scheduler recorded it.

Read-only and cheap (one question to the engine thread, answered between two steps), so it is always on.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from cobatch.server.engine_client import EngineClient
from cobatch.server.errors import APIError
from cobatch.server.frontdoor import escape_for_log


def add_request_status_route(app: FastAPI, engine: EngineClient) -> None:
    """Add GET /debug/requests/{request_id} (the id of a response, or "id#i" for one of its n)."""

    @app.get("/debug/requests/{request_id}")
    async def request_status(request_id: str) -> JSONResponse:
        """Per sequence: state, the last step's wait reason, queue position, steps waited by reason,
        preemptions (mode and predicted costs)."""
        try:
            statuses = await engine.request_status(request_id)
        except asyncio.TimeoutError:
            raise APIError(503, "the engine did not answer in time", code="service_unavailable") from None
        if statuses is None:
            raise APIError(404, f"no live or recently finished request {escape_for_log(request_id)!r}",
                           param="request_id", code="request_not_found")
        return JSONResponse({"id": request_id, "sequences": [asdict(s) for s in statuses]})
