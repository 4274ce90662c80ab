"""The scheduler's wait accounting: each sequence's steps without a row, by reason, in O(examined) a step.

A step gives an explicit reason only to the sequences it examined and held back (wait_reasons.py); the
unexamined rest of a queue waits for the reason the queue stopped at. Each queue (waiting, swapped) keeps
a tail counter: the steps its unexamined sequences have spent behind each reason. A sequence keeps the
counter's value from when it last settled (`mark`); its share is the difference, added to its own
counts when it is examined, leaves the queue, finishes, or is asked about:

    step            0         1         2                 3
    waiting tail    kv_blocks kv_blocks token_budget      kv_blocks
    sequence r      (tail)    (tail)    held: sibling     (tail)
    r's counts      settled at step 2: kv_blocks 2, then sibling_prompt 1; asked after 3: + kv_blocks 1
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from cobatch.wait_reasons import (PREEMPTED, REASON_INDEX, WAIT_REASONS, PreemptionChoice,
                                  SequenceWaitStatus, StepWaits)

logger = logging.getLogger(__name__)

WAITING, SWAPPED, RUNNING, FINISHED = "waiting", "swapped", "running", "finished"
MAX_PREEMPTIONS_KEPT = 16  # per sequence: the latest ones (a thrashing one would grow without bound)


@dataclass(slots=True)
class WaitRecord:
    """One sequence's steps without a row: settled counts, where it waits, its last explicit reason."""

    counts: list[int] = field(default_factory=lambda: [0] * len(WAIT_REASONS))  # by REASON_INDEX
    queue: str = WAITING  # WAITING, SWAPPED, RUNNING or FINISHED
    mark: tuple[int, ...] | None = None  # its queue's tail counts when it last settled (None: none due)
    first_tail_step: int = 0  # the first step whose tail reason may be its own (after the mark)
    reason: str | None = None  # the reason it was held back in `step`
    step: int = -1
    preemptions: list[PreemptionChoice] = field(default_factory=list)


@dataclass(slots=True)
class _Tail:
    """A queue's tail counter: steps its unexamined sequences spent behind each reason."""

    counts: list[int] = field(default_factory=lambda: [0] * len(WAIT_REASONS))
    reason: str | None = None  # the last step's
    step: int = -1


class WaitLedger:
    """Per-step wait reasons for the scheduler: explicit holds plus one shared reason per queue."""

    def __init__(self) -> None:
        self.num_steps = 0  # steps ended so far: the number of the step being scheduled
        self._tails = {WAITING: _Tail(), SWAPPED: _Tail()}
        self._held: list[tuple[str, WaitRecord, str]] = []  # this step's (seq id, record, reason)
        self._preemptions: list[PreemptionChoice] = []  # this step's
        self.last = StepWaits()  # the last ended step's summary

    # ---- moves (called by the scheduler) ----------------------------------------------------------

    def enter(self, record: WaitRecord, queue: str) -> None:
        """A new sequence joins a queue between steps: its tail share starts with the next step."""
        record.queue = queue
        tail = self._tails.get(queue)
        record.mark = tuple(tail.counts) if tail is not None else None
        record.first_tail_step = self.num_steps

    def leave(self, record: WaitRecord, queue: str) -> None:
        """It leaves its queue (admitted, swapped in, finished): its tail share is settled."""
        self._settle(record)
        record.queue = queue

    def hold(self, seq_id: str, record: WaitRecord, reason: str) -> None:
        """The step examined it and gave it no row, for `reason`."""
        self._held.append((seq_id, record, reason))

    def preempted(self, seq_id: str, record: WaitRecord, choice: PreemptionChoice, queue: str) -> None:
        """It lost its row to a preemption and now waits in `queue` (waiting: recompute, swapped: swap)."""
        del record.preemptions[:-MAX_PREEMPTIONS_KEPT + 1]
        record.preemptions.append(choice)
        self._preemptions.append(choice)
        record.queue = queue  # running had no tail share: nothing to settle
        self.hold(seq_id, record, PREEMPTED)

    # ---- the step ---------------------------------------------------------------------------------

    def end_step(self, waiting_reason: str | None, swapped_reason: str | None, num_waiting: int,
                 num_swapped: int) -> StepWaits:
        """Count this step: the held ones' reasons, and each queue's reason for the rest of it."""
        step, counts = self.num_steps, [0] * len(WAIT_REASONS)
        num_held_in = {WAITING: 0, SWAPPED: 0}
        for seq_id, record, reason in self._held:
            self._settle(record)  # before the tails count this step: a held one is not in a tail
            i = REASON_INDEX[reason]
            record.counts[i] += 1
            counts[i] += 1
            if logger.isEnabledFor(logging.DEBUG) and (record.reason != reason or record.step != step - 1):
                logger.debug("step %d: %s (%s) has no row: %s", step, seq_id, record.queue, reason)
            record.reason, record.step = reason, step
            if record.queue in num_held_in:
                num_held_in[record.queue] += 1
        for queue, reason, size in ((WAITING, waiting_reason, num_waiting - num_held_in[WAITING]),
                                    (SWAPPED, swapped_reason, num_swapped - num_held_in[SWAPPED])):
            self._count_tail(queue, reason, size, counts)
        for _, record, _ in self._held:
            self._mark(record, step + 1)
        self.last = StepWaits(
            counts=tuple((r, n) for r, n in zip(WAIT_REASONS, counts) if n),
            held=tuple((seq_id, reason) for seq_id, _, reason in self._held),
            waiting_reason=waiting_reason if num_waiting > num_held_in[WAITING] else None,
            swapped_reason=swapped_reason if num_swapped > num_held_in[SWAPPED] else None,
            preemptions=tuple(self._preemptions))
        self._held.clear()
        self._preemptions.clear()
        self.num_steps += 1
        return self.last

    def _count_tail(self, queue: str, reason: str | None, size: int, counts: list[int]) -> None:
        tail = self._tails[queue]
        if size <= 0 or reason is None:
            reason = None  # nobody behind: the tail's counts stay (no one's share changes)
        elif logger.isEnabledFor(logging.DEBUG) and reason != tail.reason:
            logger.debug("step %d: %d %s sequences wait behind the head: %s", self.num_steps, size,
                         queue, reason)
        tail.reason, tail.step = reason, self.num_steps
        if reason is not None:
            tail.counts[REASON_INDEX[reason]] += 1
            counts[REASON_INDEX[reason]] += size

    def _mark(self, record: WaitRecord, first_tail_step: int) -> None:
        tail = self._tails.get(record.queue)
        record.mark = tuple(tail.counts) if tail is not None else None
        record.first_tail_step = first_tail_step

    def _settle(self, record: WaitRecord) -> None:
        if record.mark is None:
            return
        for i, (now, then) in enumerate(zip(self._tails[record.queue].counts, record.mark)):
            record.counts[i] += now - then
        record.mark = None

    # ---- reading -----------------------------------------------------------------------------------

    def wait_steps(self, record: WaitRecord) -> dict[str, int]:
        """Its steps without a row so far, by reason (the tail share it has not settled included)."""
        counts = list(record.counts)
        if record.mark is not None:
            for i, (now, then) in enumerate(zip(self._tails[record.queue].counts, record.mark)):
                counts[i] += now - then
        return {reason: n for reason, n in zip(WAIT_REASONS, counts) if n}

    def status(self, seq_id: str, record: WaitRecord, queue_position: int | None = None,
               queue_length: int | None = None, finish_reason: str | None = None) -> SequenceWaitStatus:
        """Its answer as of the last ended step: the reason, whether it is the queue's, its counts."""
        last = self.num_steps - 1
        reason, is_behind = (record.reason if record.step == last else None), False
        tail = self._tails.get(record.queue)
        if reason is None and tail is not None and record.mark is not None \
                and record.first_tail_step <= last == tail.step:
            reason, is_behind = tail.reason, tail.reason is not None
        return SequenceWaitStatus(
            seq_id=seq_id, state=record.queue, step=last, reason=reason, is_behind=is_behind,
            queue_position=queue_position, queue_length=queue_length,
            wait_steps=self.wait_steps(record), preemptions=tuple(record.preemptions),
            finish_reason=finish_reason)
