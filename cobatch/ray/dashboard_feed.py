"""The live page over replicas: each replica's StepHistory mirrored in the ingress, while a page reads it.

The dashboard routes (cobatch/server/dashboard) draw one lane set per StepHistory in a mapping. A
single server passes its engine's own; the ingress passes a ReplicaFeeds, whose histories are copies
filled by asking every replica for the steps and finishes it recorded since the last ask
(EngineReplica.dashboard_feed, one HistoryCursor per replica). It asks only while a page has read the mapping within WATCHED_S, so
replicas pay nothing when nobody watches; when someone does, one broadcast per INTERVAL_S.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from cobatch.outputs import RequestDelta
from cobatch.step_history import HistoryCursor, StepHistory, StepRecord

logger = logging.getLogger(__name__)

INTERVAL_S = 0.15  # as often as a page redraws
WATCHED_S = 2.0  # a page that has not read the mirrors for this long has gone
_FEED_TIMEOUT_S = 2.0
MAX_FEED_STEPS = 1024  # per replica per pull: a page draws a few hundred


@dataclass(slots=True)
class FeedBatch:
    """What one replica recorded since its last dashboard_feed call."""

    replica: str
    steps: list[StepRecord] = field(default_factory=list)
    finished: list[RequestDelta] = field(default_factory=list)

    @classmethod
    def take(cls, replica: str, history: StepHistory, cursor: HistoryCursor, limit: int) -> FeedBatch:
        """What `cursor` has not been sent of `history` (moving it past)."""
        return cls(replica, *cursor.take(history, limit))


class ReplicaFeeds(Mapping[str, StepHistory]):
    """Replica name -> a mirror of its StepHistory, kept fed while a page reads it."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle  # DeploymentHandle of the engine deployment
        self._mirrors: dict[str, StepHistory] = {}
        self._last_read = float("-inf")
        self._task: asyncio.Task[None] | None = None

    def __getitem__(self, name: str) -> StepHistory:
        return self._mirrors[name]

    def __iter__(self) -> Iterator[str]:
        self._touch()
        return iter(list(self._mirrors))

    def __len__(self) -> int:
        return len(self._mirrors)

    def _touch(self) -> None:
        """A page is reading: start (or keep) feeding the mirrors."""
        self._last_read = time.monotonic()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._feed())

    async def _feed(self) -> None:
        while time.monotonic() - self._last_read < WATCHED_S:
            await self.pull()
            await asyncio.sleep(INTERVAL_S)

    async def pull(self) -> None:
        """One broadcast: every replica's new steps and finishes into its mirror."""
        try:
            batches = await self._handle.broadcast("dashboard_feed").results_async(
                timeout_s=_FEED_TIMEOUT_S, return_exceptions=True)
        except Exception:  # noqa: BLE001 - a replica set in flux: the next pull asks again
            logger.debug("dashboard feed failed", exc_info=True)
            return
        for batch in batches:
            if isinstance(batch, FeedBatch):
                self.record(batch)

    def record(self, batch: FeedBatch) -> None:
        mirror = self._mirrors.setdefault(batch.replica, StepHistory())
        for stats in batch.steps:
            mirror.record_step(stats)
        for delta in batch.finished:
            mirror.record_finished(delta)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
