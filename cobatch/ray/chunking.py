"""A request's deltas in chunks: the first flushed at once, later ones gathered for an interval.

Every chunk a replica yields is one Ray streaming item, a fixed cost on both ends; per-token items
would compete with the engine thread for a one-core replica. The first token is never held back
(time to first token), and a chunk waits at most `interval_s` after the previous flush.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator
from typing import TypeVar

T = TypeVar("T")


async def chunked(items: AsyncIterable[T], interval_s: float) -> AsyncIterator[list[T]]:
    """`items` as lists: the first alone at once, then what arrived until `interval_s` after a flush.

    An error of `items` is raised after the items before it have been yielded.
    """
    source = aiter(items)
    loop = asyncio.get_running_loop()
    chunk: list[T] = []
    flush_at = 0.0  # loop time of the next flush: the first item goes out at once
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            pending = pending or asyncio.ensure_future(anext(source))
            timeout = max(flush_at - loop.time(), 0.0) if chunk else None
            done, _ = await asyncio.wait({pending}, timeout=timeout)
            if done:
                finished, pending = pending, None
                try:
                    chunk.append(finished.result())
                except StopAsyncIteration:
                    break
                except BaseException:
                    if chunk:
                        yield chunk
                    raise
            if chunk and loop.time() >= flush_at:
                yield chunk
                chunk, flush_at = [], loop.time() + interval_s
        if chunk:
            yield chunk
    finally:
        if pending is not None:
            pending.cancel()
