"""A uvicorn.Server whose first SIGTERM/SIGINT drains the engine before stopping."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Iterator
from types import FrameType

import uvicorn

from cobatch.async_engine import AsyncEngine

logger = logging.getLogger("cobatch.server")

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DrainingServer(uvicorn.Server):
    """Signal 1: stop admission, drain (bounded), then stop. Signal 2: abort what is live, stop now.

    Every way out runs the lifespan's shutdown (the engine thread is joined), so a stop is quiet:
    uvicorn's own force exit skips it, and its lifespan task then dies cancelled, an ERROR traceback.
    """

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

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Our handler for the rest of the process; uvicorn's would restore the defaults at the end
        and re-raise the signal (the process would die of SIGTERM instead of exiting 0)."""
        # Kept after serving too: a late signal while the process exits must not interrupt it
        # with a KeyboardInterrupt (SIGKILL still ends a process that hangs).
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                signal.signal(sig, self.handle_exit)
        yield

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = self.loop
        if loop is None or loop.is_closed():
            self.should_exit = True  # before start-up nothing to drain; after the loop, exiting
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: exiting already
            loop.call_soon_threadsafe(self._stop_now if self.is_draining else self._start_drain)
        self.is_draining = True

    def _start_drain(self) -> None:
        logger.info("shutting down: admission stopped; waiting up to %.0f s for %d requests",
                    self.shutdown_timeout_s, self.async_engine.num_live_requests)
        self._drain_task = asyncio.ensure_future(self._drain(self.shutdown_timeout_s))

    def _stop_now(self) -> None:
        """A second signal: cut the drain short (live requests end "abort"); a no-op once stopping."""
        if self._drain_task is None or self._drain_task.done():
            return
        logger.info("second signal: aborting %d requests now", self.async_engine.num_live_requests)
        self._drain_task.cancel()
        self._drain_task = asyncio.ensure_future(self._drain(0.0))

    async def _drain(self, timeout_s: float) -> None:
        num_aborted = await self.async_engine.drain(timeout_s)
        if num_aborted:
            logger.warning("shutdown timeout: aborted %d requests", num_aborted)
        self.should_exit = True

    def exit_now(self) -> None:
        """Stop serving (after the engine died)."""
        self.should_exit = True
