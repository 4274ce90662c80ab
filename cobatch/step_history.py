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

# StepStats.row_kinds' letters, by name.
ROW_KIND_NAMES = {"p": "prefill", "d": "decode", "x": "padding"}
UNSCHEDULED = "unscheduled"  # a live sequence without a row: preempted, swapped or held back

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


@dataclass(frozen=True, slots=True)
class Segment:
    """One sequence's consecutive steps of one kind, or the gap (steps without its row) between two."""

    kind: str  # "prefill", "decode", "padding" or UNSCHEDULED
    first_step: int
    last_step: int
    num_tokens: int
    start_time: float  # time.monotonic()
    end_time: float
    is_recompute: bool = False  # a prefill after decoding: its KV recomputed after a preemption
    # Why an UNSCHEDULED gap had no row: None until the scheduler records wait reasons (issue 22, item 2).
    wait_reason: str | None = None


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

    def segments(self, seq_id: str) -> list[Segment]:
        """The sequence's life in the kept steps: its runs of rows and the gaps between them."""
        return sequence_segments(self.steps, seq_id)


def sequence_segments(steps: Iterable[StepRecord], seq_id: str) -> list[Segment]:
    """Runs of one sequence's consecutive same-kind rows, with an UNSCHEDULED segment for each gap."""
    segments: list[Segment] = []
    has_decoded = False
    for stats in steps:
        ids = stats.row_request_ids
        if seq_id not in ids:
            continue
        row = ids.index(seq_id)
        kind = ROW_KIND_NAMES.get(stats.row_kinds[row:row + 1], "decode")  # no kinds: an old record
        num_tokens = stats.row_num_new_tokens[row] if row < len(stats.row_num_new_tokens) else 1
        end_time = stats.start_time + stats.duration_s
        last = segments[-1] if segments else None
        if last is not None and last.last_step + 1 == stats.step and last.kind == kind:
            segments[-1] = Segment(kind, last.first_step, stats.step, last.num_tokens + num_tokens,
                                   last.start_time, end_time, last.is_recompute)
            continue
        if last is not None and last.last_step + 1 < stats.step:
            segments.append(Segment(UNSCHEDULED, last.last_step + 1, stats.step - 1, 0,
                                    last.end_time, stats.start_time))
        segments.append(Segment(kind, stats.step, stats.step, num_tokens, stats.start_time, end_time,
                                is_recompute=kind == "prefill" and has_decoded))
        has_decoded = has_decoded or kind == "decode"
    return segments
