"""Why a sequence had no row in a step, and how it was preempted: the names and the records that carry them.

Contracts (frozen data, stdlib only). The scheduler fills them (wait_ledger.py); the engine publishes a
StepWaits with every StepStats; GET /debug/requests/{id} answers with SequenceWaitStatus; Prometheus
counts cobatch:request_wait_steps_total{reason} from StepWaits.counts.

A step examines only the head of each queue (FCFS, or priority order): the sequences it looks at and
holds back get their own reason; every other sequence of that queue waits behind them, for the reason
the queue stopped at (`is_behind`). That is what is true of an FCFS queue, and it costs O(examined).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The reasons, in the order reports list them.
KV_BLOCKS = "kv_blocks"  # not enough free KV blocks for its next tokens (or to swap back in)
WATERMARK = "watermark"  # the blocks are free, but admitting would eat the watermark's headroom
MAX_NUM_SEQS = "max_num_seqs"  # every seat of the batch is taken
TOKEN_BUDGET = "token_budget"  # the step's max_num_batched_tokens is spent (or, unchunked, too small)
TPOT_SLO = "tpot_slo"  # the TPOT SLO leaves no room (or its slow start: one admission per step)
STATIC_BATCH = "static_batch"  # static batching: nobody joins until the whole batch has finished
SIBLING_PROMPT = "sibling_prompt"  # n > 1: waits for a sibling's prompt, whose blocks it will share
SWAPPED = "swapped"  # swapped-out sequences go back in before anyone is admitted
PREEMPTING = "preempting"  # this step had to preempt: it admits nobody and swaps nobody in
PREEMPTED = "preempted"  # lost its row this step: preempted (recompute or swap)
GRAMMAR_COMPILING = "grammar_compiling"  # structured outputs: its grammar is compiling (off the engine thread)

WAIT_REASONS = (KV_BLOCKS, WATERMARK, MAX_NUM_SEQS, TOKEN_BUDGET, TPOT_SLO, STATIC_BATCH,
                SIBLING_PROMPT, SWAPPED, PREEMPTING, PREEMPTED, GRAMMAR_COMPILING)
REASON_INDEX = {reason: i for i, reason in enumerate(WAIT_REASONS)}

# PreemptionChoice.why
CONFIGURED = "configured"  # preemption_mode recompute or swap
SWAP_POOL_FULL = "swap_pool_full"  # swap wanted, but the host pool cannot hold its blocks
UNMEASURED = "unmeasured"  # auto before any copy was timed: swap, so that one is
CHEAPER = "cheaper"  # auto: the mode with the smaller predicted cost


@dataclass(frozen=True, slots=True)
class PreemptionChoice:
    """One preemption: the mode taken, why, and (under preemption_mode auto) both predicted costs."""

    request_id: str
    step: int
    mode: str  # "recompute" or "swap"
    why: str  # CONFIGURED, SWAP_POOL_FULL, UNMEASURED or CHEAPER
    num_computed_tokens: int  # the KV it held: dropped (recompute) or copied out (swap)
    recompute_s: float | None = None  # predicted seconds to compute that KV again (auto only)
    swap_s: float | None = None  # predicted seconds to copy its blocks out and back in (None: unmeasured)


@dataclass(frozen=True, slots=True)
class StepWaits:
    """Who had no row in one step, and why (published in StepStats.waits)."""

    # (reason, sequences held back for it), the reasons that occurred, in WAIT_REASONS order.
    counts: tuple[tuple[str, int], ...] = ()
    held: tuple[tuple[str, str], ...] = ()  # (seq id, reason) of the sequences the step examined
    waiting_reason: str | None = None  # every other waiting sequence's (it waits behind the head)
    swapped_reason: str | None = None  # every other swapped sequence's
    preemptions: tuple[PreemptionChoice, ...] = ()

    @property
    def num_held(self) -> int:
        """Sequences without a row this step (live ones: running, waiting or swapped)."""
        return sum(n for _, n in self.counts)

    def reason_of(self, seq_id: str, is_swapped: bool = False) -> str | None:
        """Why a live sequence had no row this step: its own reason if examined, else its queue's.

        `is_swapped`: it waits in the swapped queue (a preemption with mode "swap" put it there).
        """
        for held_id, reason in self.held:
            if held_id == seq_id:
                return reason
        return self.swapped_reason if is_swapped else self.waiting_reason


@dataclass(frozen=True, slots=True)
class SequenceWaitStatus:
    """One sequence's answer to "why is it waiting?" (GET /debug/requests/{id})."""

    seq_id: str
    state: str  # "waiting", "swapped", "running" or "finished"
    step: int  # the last step the answer is about (-1: no step has seen it yet)
    reason: str | None  # why it had no row in that step; None: it had one (or no step yet)
    is_behind: bool = False  # the reason is the queue's: it was behind the sequences the step examined
    queue_position: int | None = None  # sequences ahead of it in its queue (waiting or swapped)
    queue_length: int | None = None
    wait_steps: dict[str, int] = field(default_factory=dict)  # its steps without a row, by reason
    preemptions: tuple[PreemptionChoice, ...] = ()
    finish_reason: str | None = None
