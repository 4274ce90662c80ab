"""A uvicorn.Server whose first SIGTERM/SIGINT drains the engine before stopping."""

from __future__ import annotations

import asyncio
import logging
import socket
from types import FrameType

import uvicorn

from cobatch.async_engine import AsyncEngine

logger = logging.getLogger("cobatch.server")


class DrainingServer(uvicorn.Server):
    """Signal 1: stop admission, drain (bounded), then stop. Signal 2: stop at once."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine,
                 shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.async_engine = async_engine
        self.shutdown_timeout_s = shutdown_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.is_draining = False
        self._drain_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise the signal after shutdown and
        # the process would die of SIGTERM instead of exiting 0.
        if self.is_draining or self.loop is None:
            self.should_exit = self.force_exit = True
            return
        self.is_draining = True
        self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        logger.info("shutting down: admission stopped; waiting up to %.0f s for %d requests",
                    self.shutdown_timeout_s, self.async_engine.num_live_requests)
        num_aborted = await self.async_engine.drain(self.shutdown_timeout_s)
        if num_aborted:
            logger.warning("shutdown timeout: aborted %d requests", num_aborted)
        self.should_exit = True

    def exit_now(self) -> None:
        """Stop serving (after the engine died)."""
        self.should_exit = True
