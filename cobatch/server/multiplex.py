"""Several requests' choice updates as one stream (a prompt list on /v1/completions), as they come.

Each request's updates are pumped by a task into one queue; the consumer reads (request index,
update) pairs. A failure of any request ends the stream with its error, and leaving early (a client
disconnect, an error) aborts every request, so none runs on without a reader.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

from cobatch.server.engine_client import EngineClient
from cobatch.server.frontdoor import Submission
from cobatch.server.generation import ChoiceUpdate, choice_updates

_Item = tuple[int, ChoiceUpdate | Exception | None]  # None: that request has ended


async def merged_updates(async_engine: EngineClient,
                         subs: Sequence[Submission]) -> AsyncIterator[tuple[int, ChoiceUpdate]]:
    """(index in subs, update) of every submission until all have finished; all aborted on exit."""
    queue: asyncio.Queue[_Item] = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(async_engine, i, sub, queue)) for i, sub in enumerate(subs)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for sub in subs:  # at once, not when the cancelled pumps next run
            async_engine.abort(sub.request_id)


async def _pump(async_engine: EngineClient, index: int, sub: Submission,
                queue: asyncio.Queue[_Item]) -> None:
    try:
        async with aclosing(choice_updates(async_engine, sub.request_id, sub.stream, sub.tracker)) as updates:
            async for update in updates:
                queue.put_nowait((index, update))
    except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
        queue.put_nowait((index, exc))
    finally:
        queue.put_nowait((index, None))
