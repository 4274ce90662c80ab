"""Recent steps and finished sequences as the event loop saw them: what the live views read.

The AsyncEngine appends each published StepStats and each finishing delta (references: one deque
append apiece, nothing copied or serialized), so keeping the history costs nothing measurable; the
dashboard and the tracer do their work only when asked. Engine-free: the server reads it without
importing the engine (StepRecord names the StepStats fields the views read).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from cobatch.outputs import RequestDelta
from cobatch.wait_reasons import PreemptionChoice, StepWaits

# StepStats.row_kinds' letters, by name.
ROW_KIND_NAMES = {"p": "prefill", "d": "decode", "x": "padding"}
UNSCHEDULED = "unscheduled"  # a live sequence without a row: preempted, swapped or held back
WAITING = "waiting"  # from its arrival to its first row

MAX_STEPS = 4096  # as many as Engine keeps; a few hundred are drawn
MAX_FINISHED = 1024


class StepRecord(Protocol):
    """The fields of cobatch.engine.StepStats that the live views read."""

    @property
    def step(self) -> int: ...
    @property
    def start_time(self) -> float: ...
    @property
    def duration_s(self) -> float: ...
    @property
    def predicted_s(self) -> float: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_swapped(self) -> int: ...
    @property
    def num_prefill_tokens(self) -> int: ...
    @property
    def num_decode_tokens(self) -> int: ...
    @property
    def num_generated_tokens(self) -> int: ...
    @property
    def num_preempted(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...
    @property
    def prefix_cache_hit_rate(self) -> float: ...
    @property
    def row_request_ids(self) -> tuple[str, ...]: ...
    @property
    def row_kinds(self) -> str: ...
    @property
    def row_num_new_tokens(self) -> tuple[int, ...]: ...
    @property
    def waits(self) -> StepWaits: ...


@dataclass(frozen=True, slots=True)
class Segment:
    """One sequence's consecutive steps of one kind, or the gap (steps without its row) between two."""

    kind: str  # "prefill", "decode", "padding", UNSCHEDULED or WAITING
    first_step: int
    last_step: int  # below first_step: no kept step in it (a WAITING one admitted at the next step)
    num_tokens: int
    start_time: float  # time.monotonic()
    end_time: float
    is_recompute: bool = False  # a prefill after decoding: its KV recomputed after a preemption
    # A gap's steps without a row by reason (StepStats.waits), and the preemption that began it.
    wait_steps: tuple[tuple[str, int], ...] = ()
    preemption: PreemptionChoice | None = None

    @property
    def wait_reason(self) -> str | None:
        """The reason of most of the gap's steps (None where the engine recorded none)."""
        return max(self.wait_steps, key=lambda item: item[1])[0] if self.wait_steps else None


@dataclass(slots=True)
class HistoryCursor:
    """How far one reader (a page, the ingress's mirror) has read a StepHistory."""

    step: int = -1
    last_finished: RequestDelta | None = None

    def take(self, history: StepHistory, limit: int) -> tuple[list[StepRecord], list[RequestDelta]]:
        """The steps and finishing deltas after the cursor (the newest `limit` of each); moves past them."""
        steps = history.steps_after(self.step, limit)
        finished = history.finished_after(self.last_finished)[-limit:]
        if steps:
            self.step = steps[-1].step
        if finished:
            self.last_finished = finished[-1]
        return steps, finished


class StepHistory:
    """Bounded deques of the last steps and the last finishing deltas, oldest first (loop-side only)."""

    def __init__(self, max_steps: int = MAX_STEPS, max_finished: int = MAX_FINISHED) -> None:
        self.steps: deque[StepRecord] = deque(maxlen=max_steps)
        self.finished: deque[RequestDelta] = deque(maxlen=max_finished)

    def record_step(self, stats: StepRecord) -> None:
        self.steps.append(stats)

    def record_finished(self, delta: RequestDelta) -> None:
        self.finished.append(delta)

    def steps_after(self, step: int, limit: int) -> list[StepRecord]:
        """The steps numbered above `step`, at most the newest `limit`, oldest first."""
        found: list[StepRecord] = []
        for stats in reversed(self.steps):
            if stats.step <= step or len(found) == limit:
                break
            found.append(stats)
        found.reverse()
        return found

    def finished_after(self, last: RequestDelta | None) -> list[RequestDelta]:
        """The finishing deltas recorded after `last` (all kept ones if `last` is gone or None)."""
        found: list[RequestDelta] = []
        for delta in reversed(self.finished):
            if delta is last:
                break
            found.append(delta)
        found.reverse()
        return found

    def finished_of(self, request_id: str) -> list[RequestDelta]:
        """The finishing deltas of a request's sequences (or of one sequence id), by index."""
        found = [d for d in self.finished if request_id in (d.parent_id, d.request_id)]
        return sorted(found, key=lambda d: d.index)

    def sequence_ids(self, request_id: str) -> list[str]:
        """The sequence ids of a request seen in the kept steps or finishes ("id", or "id#i" for n > 1)."""
        prefix = request_id + "#"
        ids = {d.request_id for d in self.finished_of(request_id)}
        for stats in self.steps:
            ids.update(r for r in stats.row_request_ids if r == request_id or r.startswith(prefix))
        return sorted(ids)

    def segments(self, seq_id: str, waited: tuple[float, float] | None = None) -> list[Segment]:
        """The sequence's life in the kept steps: its runs of rows and the gaps between them (and its
        wait, given `waited` = (arrival, first scheduled) times)."""
        return sequence_segments(self.steps, seq_id, waited)


def sequence_segments(steps: Iterable[StepRecord], seq_id: str,
                      waited: tuple[float, float] | None = None) -> list[Segment]:
    """Runs of one sequence's consecutive same-kind rows, a segment for each gap between them, and,
    given `waited` = (arrival, first scheduled) times, a WAITING one before the first row if that row
    is still kept."""
    builder = _SegmentBuilder(seq_id, waited)
    for stats in steps:
        builder.add(stats)
    return builder.segments


class _SegmentBuilder:
    """sequence_segments' state: the segments so far and the rowless steps since the last row."""

    def __init__(self, seq_id: str, waited: tuple[float, float] | None) -> None:
        self.seq_id = seq_id
        self.waited = waited
        self.segments: list[Segment] = []
        self.rowless: list[StepRecord] = []
        self.has_decoded = False
        self.is_wait_kept: bool | None = None  # known at the first step

    def add(self, stats: StepRecord) -> None:
        if self.is_wait_kept is None:  # its first row (scheduled during its step) is still kept
            self.is_wait_kept = self.waited is not None and self.waited[1] >= stats.start_time
        ids = stats.row_request_ids
        if self.seq_id not in ids:
            if self.segments or (self.is_wait_kept and self.waited and stats.start_time >= self.waited[0]):
                self.rowless.append(stats)
            return
        if self.rowless or (not self.segments and self.is_wait_kept):
            self._close_gap(stats)
        self._add_row(stats, ids.index(self.seq_id))

    def _close_gap(self, stats: StepRecord) -> None:
        last = self.segments[-1] if self.segments else None
        first_step = self.rowless[0].step if self.rowless else stats.step
        wait_steps, preemption = wait_steps_of(self.rowless, self.seq_id)
        start = last.end_time if last is not None else self.waited[0] if self.waited else 0.0
        self.segments.append(Segment(UNSCHEDULED if last else WAITING, first_step, stats.step - 1, 0,
                                     start, stats.start_time, wait_steps=wait_steps,
                                     preemption=preemption))
        self.rowless = []

    def _add_row(self, stats: StepRecord, row: int) -> None:
        kind = ROW_KIND_NAMES.get(stats.row_kinds[row:row + 1], "decode")  # no kinds: an old record
        num_tokens = stats.row_num_new_tokens[row] if row < len(stats.row_num_new_tokens) else 1
        end_time = stats.start_time + stats.duration_s
        last = self.segments[-1] if self.segments else None
        if last is not None and last.last_step + 1 == stats.step and last.kind == kind:
            self.segments[-1] = Segment(kind, last.first_step, stats.step, last.num_tokens + num_tokens,
                                        last.start_time, end_time, last.is_recompute)
            return
        self.segments.append(Segment(kind, stats.step, stats.step, num_tokens, stats.start_time,
                                     end_time, is_recompute=kind == "prefill" and self.has_decoded))
        self.has_decoded = self.has_decoded or kind == "decode"


def wait_steps_of(steps: Iterable[StepRecord],
                  seq_id: str) -> tuple[tuple[tuple[str, int], ...], PreemptionChoice | None]:
    """A sequence's rowless steps counted by reason (StepStats.waits), and the preemption among them.

    Its reason in a step is its own where the scheduler examined it, else its queue's (waiting, or
    swapped after a swap preemption).
    """
    counts: dict[str, int] = {}
    preemption: PreemptionChoice | None = None
    for stats in steps:
        waits = stats.waits
        for choice in waits.preemptions:
            if choice.request_id == seq_id:
                preemption = choice
        reason = next((r for held_id, r in waits.held if held_id == seq_id), None)
        if reason is None:
            is_swapped = preemption is not None and preemption.mode == "swap"
            reason = waits.swapped_reason if is_swapped else waits.waiting_reason
        if reason is not None:
            counts[reason] = counts.get(reason, 0) + 1
    return tuple(counts.items()), preemption
