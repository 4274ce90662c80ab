"""The ASGI front door: access log (escaped), API-key check for /v1, and the request-body limit.

Pure ASGI (no BaseHTTPMiddleware) so streaming responses and disconnect detection pass through
untouched, and a huge body is refused before it is read.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from cobatch.server.errors import APIError
from cobatch.server.frontdoor import escape_for_log
from cobatch.server.settings import ServerSettings

logger = logging.getLogger("cobatch.server.access")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class _BodyTooLarge(Exception):
    pass


class FrontDoorMiddleware:
    """Access log, bearer-token auth on /v1/*, and a bounded, pre-read request body."""

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status: list[int] = [0]

        async def send_logged(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._handle(scope, receive, send_logged)
        finally:
            logger.info("%s %s %d %.1fms", scope.get("method", "-"),
                        escape_for_log(scope.get("path", ""), 200), status[0],
                        (time.monotonic() - start) * 1000.0)

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._is_authorized(scope):
            await _send_error(send, APIError(401, "invalid or missing API key (use the "
                                             "Authorization: Bearer header)", code="invalid_api_key"))
            return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read_body(scope, receive)
        except _BodyTooLarge:
            limit_mib = self.settings.max_body_bytes / (1024 * 1024)
            await _send_error(send, APIError(413, f"the request body is over the {limit_mib:g} MiB "
                                             "limit", code="request_too_large"))
            return
        await self.app(scope, _replay(body, receive), send)

    def _is_authorized(self, scope: Scope) -> bool:
        key = self.settings.api_key
        if key is None or not str(scope.get("path", "")).startswith("/v1"):
            return True
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                   key.encode())

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        limit = self.settings.max_body_bytes
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _BodyTooLarge()  # refused before reading a byte of it
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)  # disconnected mid-body; the app will see it too
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _BodyTooLarge()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields the buffered body once, then the real channel (for disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_error(send: Send, error: APIError) -> None:
    response = error.response()
    await send({"type": "http.response.start", "status": response.status_code,
                "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})
