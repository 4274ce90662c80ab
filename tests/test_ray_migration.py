"""Token-exact migration and the replica's chunking, as pure functions (no Ray, no model)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from cobatch.outputs import RequestDelta
from cobatch.ray.chunking import chunked
from cobatch.ray.migration import DEADLINE, Leg, RequestProgress, seq_id
from cobatch.sampling_params import SamplingParams

PROMPT = (5, 6, 7, 8)


def progress(n: int = 1, arrival_s: float = 100.0, **params: object) -> RequestProgress:
    return RequestProgress("cmpl-1", PROMPT, SamplingParams(n=n, **params), 0, arrival_s)


def delta(request_id: str, index: int, tokens: tuple[int, ...], finish: str | None = None) -> RequestDelta:
    return RequestDelta(request_id=request_id, parent_id=request_id.split("#")[0], index=index,
                        new_token_ids=tokens, new_logprobs=(), num_prompt_tokens=len(PROMPT),
                        num_output_tokens=len(tokens), finish_reason=finish)


def test_the_first_leg_is_the_clients_request_and_its_deltas_pass_through() -> None:
    p = progress(max_tokens=8)
    leg = p.first_leg(100.0)
    assert leg.call.request_id == "cmpl-1" and leg.call.prompt_token_ids == PROMPT
    assert leg.indices == (0,) and leg.is_first
    d = delta("cmpl-1", 0, (11, 12))
    assert p.to_client(leg, d) is d and p.delivered == [[11, 12]]


def test_a_continuation_resubmits_the_delivered_tokens_with_what_is_left() -> None:
    p = progress(max_tokens=8, min_tokens=3, deadline_ms=1000.0)
    first = p.first_leg(100.0)
    p.to_client(first, delta("cmpl-1", 0, (11, 12)))
    p.num_migrations = 1
    leg = p.continuation(0, 100.25)
    assert isinstance(leg, Leg) and leg.indices == (0,) and not leg.is_first
    call = leg.call
    assert call.prompt_token_ids == PROMPT + (11, 12)
    assert call.params.max_tokens == 6 and call.params.min_tokens == 1
    assert call.params.deadline_ms == pytest.approx(750.0)
    assert call.request_id != first.call.request_id
    # Its deltas reach the client as the original sequence's, counted from the original prompt.
    out = p.to_client(leg, delta(call.request_id, 0, (13,), finish="length"))
    assert out is not None and out.request_id == "cmpl-1" and out.num_prompt_tokens == len(PROMPT)
    assert out.num_output_tokens == 3 and p.delivered == [[11, 12, 13]] and p.is_finished


def test_with_n_samples_each_unfinished_sequence_moves_on_its_own() -> None:
    p = progress(n=2, max_tokens=4, seed=7)
    first = p.first_leg(100.0)
    p.to_client(first, delta("cmpl-1#0", 0, (1, 2, 3, 4), finish="length"))
    p.to_client(first, delta("cmpl-1#1", 1, (9,)))
    assert p.unfinished(first) == [1]
    leg = p.continuation(1, 100.0)
    assert isinstance(leg, Leg) and leg.indices == (1,)
    assert leg.call.params.n == 1 and leg.call.params.seed == 8  # the sample's own seed
    out = p.to_client(leg, delta(leg.call.request_id, 0, (10,)))
    assert out is not None and (out.index, out.request_id) == (1, seq_id("cmpl-1", 1, 2))


def test_a_continuation_asks_for_prompt_logprobs_only_if_none_were_delivered() -> None:
    """They come with a sequence's first token: after that a continuation's prompt (prompt + delivered
    tokens) must not score them again; before it, the continuation's prompt is the prompt itself."""
    p = progress(max_tokens=8, prompt_logprobs=2)
    first = p.first_leg(100.0)
    fresh = p.continuation(0, 100.0)
    assert isinstance(fresh, Leg) and fresh.call.params.prompt_logprobs == 2
    p.to_client(first, delta("cmpl-1", 0, (11,)))
    moved = p.continuation(0, 100.0)
    assert isinstance(moved, Leg) and moved.call.params.prompt_logprobs is None


def test_nothing_left_to_run_finishes_locally() -> None:
    p = progress(max_tokens=2, deadline_ms=100.0)
    first = p.first_leg(100.0)
    p.to_client(first, delta("cmpl-1", 0, (1,)))
    late = p.continuation(0, 100.2)  # 200 ms after arrival: the deadline has passed
    assert isinstance(late, RequestDelta) and late.finish_reason == DEADLINE and p.is_finished
    q = progress(max_tokens=2)
    q.to_client(q.first_leg(100.0), delta("cmpl-1", 0, (1, 2)))
    done = q.continuation(0, 100.0)
    assert isinstance(done, RequestDelta) and done.finish_reason == "length"


def test_a_sequence_stopped_by_the_server_drops_the_engines_later_tokens() -> None:
    p = progress(max_tokens=8)
    leg = p.first_leg(100.0)
    stop = p.finish_locally(0, "stop", "END")
    assert stop.finished and stop.stop_reason == "END"
    assert p.to_client(leg, delta("cmpl-1", 0, (4,))) is None and p.delivered == [[]]


async def _items(values: list[float], fail: bool = False) -> AsyncIterator[int]:
    for i, gap_s in enumerate(values):
        await asyncio.sleep(gap_s)
        yield i
    if fail:
        raise ValueError("engine gone")


def test_chunks_flush_the_first_item_at_once_then_gather() -> None:
    async def run() -> list[list[int]]:
        return [c async for c in chunked(_items([0.0] + [0.005] * 9), interval_s=0.2)]

    chunks = asyncio.run(run())
    assert chunks[0] == [0] and sum(chunks, []) == list(range(10)) and len(chunks) <= 3


def test_an_error_comes_after_the_items_before_it() -> None:
    async def run() -> list[list[int]]:
        got: list[list[int]] = []
        with pytest.raises(ValueError):
            async for chunk in chunked(_items([0.0, 0.0, 0.0], fail=True), interval_s=1.0):
                got.append(chunk)
        return got

    assert sum(asyncio.run(run()), []) == [0, 1, 2]
