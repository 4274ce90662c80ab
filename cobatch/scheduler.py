"""Iteration-level scheduler: re-forms the batch every step under a token budget and the KV pool.

There are no phases: each request has `num_tokens` and `num_computed_tokens`, and each step hands out
tokens so that computed catches up with total. Prefill, chunked prefill, decode and resume after a
recompute preemption are the same code path.
"""

from __future__ import annotations

import heapq
import time
from bisect import insort
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from cobatch.block_manager import BlockManager
from cobatch.config import SchedulerConfig
from cobatch.cost_model import PreemptionCostPredictor, StepTimePredictor
from cobatch.outputs import RequestDelta
from cobatch.request import Request, RequestStatus
from cobatch.scheduler_output import RunnerOutput, ScheduledRow, SchedulerOutput, TokenLogprobs
from cobatch.slo import SloStepBudget
from cobatch.spec_decode import NgramProposer, accepted_tokens, min_acceptance
from cobatch.wait_ledger import FINISHED, RUNNING, SWAPPED, WAITING, WaitLedger
from cobatch.wait_reasons import (CHEAPER, CONFIGURED, GRAMMAR_COMPILING, KV_BLOCKS, MAX_NUM_SEQS, PREEMPTING,
                                  SIBLING_PROMPT, STATIC_BATCH, SWAP_POOL_FULL, SWAPPED as SWAPPED_FIRST,
                                  TOKEN_BUDGET, TPOT_SLO, UNMEASURED, WATERMARK, PreemptionChoice,
                                  SequenceWaitStatus)


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """The scheduler's load at one moment: what step telemetry, /metrics and a replica router read."""

    num_running: int = 0
    num_waiting: int = 0  # sequences
    num_waiting_requests: int = 0  # distinct requests among them (the queue bound counts these)
    num_swapped: int = 0
    num_running_tokens: int = 0  # prompt + output tokens of the running sequences (their context)
    num_running_prefill_tokens: int = 0  # tokens running sequences still prefill (beyond a decode token)
    num_waiting_tokens: int = 0  # tokens the waiting sequences have yet to prefill
    num_swapped_tokens: int = 0  # tokens of the swapped sequences (computed; need device blocks back)
    num_kv_blocks: int = 0
    num_kv_blocks_used: int = 0
    num_preemptions_total: int = 0
    prefix_cache_hit_rate: float = 0.0  # share of looked-up prompt tokens found in the cache
    num_draft_tokens_total: int = 0  # speculative drafts fed to the model
    num_accepted_tokens_total: int = 0  # of which the model agreed with
    num_evictions_total: int = 0  # prefix-cache blocks reused for other content
    recent_evicted_hashes: tuple[int, ...] = ()  # the latest evicted block hashes, oldest first
    mean_output_tokens: float = 0.0  # of recently finished sequences (stop or length); 0: none yet

    @property
    def num_kv_blocks_free(self) -> int:
        return self.num_kv_blocks - self.num_kv_blocks_used

    @property
    def kv_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks if self.num_kv_blocks else 0.0


@dataclass(slots=True)
class _StepPlan:
    """Mutable scratch of one schedule() call."""

    budget: int
    rows: list[ScheduledRow]
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    copies: list[tuple[int, int]] = field(default_factory=list)  # (cached block, the row's own copy of it)
    num_preempted: int = 0
    num_context_tokens: int = 0
    scheduled: set[str] = field(default_factory=set)  # request ids with a row this step
    slo: SloStepBudget | None = None  # set when a TPOT SLO bounds the batch


class Scheduler:
    """Owns the waiting / running / swapped queues and the block manager."""

    def __init__(self, config: SchedulerConfig,
                 step_time_predictor: StepTimePredictor | None = None,
                 preemption_cost_predictor: PreemptionCostPredictor | None = None) -> None:
        self.config = config
        self.block_manager = BlockManager(
            config.num_kv_blocks, config.block_size, config.num_swap_blocks,
            config.enable_prefix_caching, config.watermark)
        self.step_time_predictor = step_time_predictor
        self.preemption_cost_predictor = preemption_cost_predictor  # preemption_mode auto
        self.waits = WaitLedger()  # why each live sequence had no row, step by step
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by _order_key
        self.running: list[Request] = []  # sorted by _order_key: the tail is preempted first
        self.swapped: list[Request] = []  # sorted by _order_key
        self.num_preemptions_total = 0
        self.num_slo_capped_steps = 0
        self.proposer = (NgramProposer(config.num_speculative_tokens, config.ngram_prompt_lookup_min,
                                       config.ngram_prompt_lookup_max)
                         if config.num_speculative_tokens and config.batching == "continuous" else None)
        self.num_draft_tokens_total = 0  # drafts fed to the model
        self.num_accepted_tokens_total = 0  # of which the model agreed with
        # (deadline_time, request id) of requests with a deadline: a step looks at the top only.
        # Entries of requests finished before their deadline stay until popped (or compacted).
        self._deadlines: list[tuple[float, str]] = []
        self.mean_output_tokens = 0.0

    # ---- queues --------------------------------------------------------------------------------

    def _order_key(self, request: Request) -> tuple[int, float, str]:
        priority = request.priority if self.config.scheduling_policy == "priority" else 0
        return (priority, request.arrival_time, request.request_id)

    def add_request(self, request: Request) -> None:
        """Queue a new request (validated by the caller against max_model_len)."""
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        insort(self.waiting, request, key=self._order_key)
        self.waits.enter(request.wait, WAITING)
        if request.deadline_time is not None:
            self._push_deadline(request)

    def _push_deadline(self, request: Request) -> None:
        assert request.deadline_time is not None
        if len(self._deadlines) > 2 * len(self.requests) + 64:  # mostly finished ones: rebuild
            self._deadlines = [(r.deadline_time, r.request_id) for r in self.requests.values()
                               if r.deadline_time is not None and r is not request]
            heapq.heapify(self._deadlines)
        heapq.heappush(self._deadlines, (request.deadline_time, request.request_id))

    def expire_deadlines(self, now: float) -> list[RequestDelta]:
        """Finish every request whose deadline has passed, wherever it is (before schedule()).

        A waiting one never gets (more) prefill, a running or swapped one ends where it is; their
        blocks are free at once. O(1) when no deadline is due.
        """
        deltas = []
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline_time, request_id = heapq.heappop(self._deadlines)
            request = self.requests.get(request_id)
            # Gone, finished (a static batch's padding row), or the id reused by a later request.
            if request is not None and not request.is_finished and request.deadline_time == deadline_time:
                deltas.append(self._finish(request, RequestStatus.FINISHED_DEADLINE, now))
        return deltas

    def abort_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                      stop_reason: int | str | None = None, error: str | None = None) -> RequestDelta | None:
        """Finish a request wherever it is (abort, a stop string found by the caller, a failed grammar).

        Its blocks are free at once: the next step can give them to someone else.
        """
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.is_finished:  # a static-batching padding row: just drop it
            self._release(request)
            return None
        request.stop_reason = stop_reason
        return self._finish(request, status, time.monotonic(), error=error)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def wait_status(self, seq_id: str) -> SequenceWaitStatus | None:
        """Why a live sequence had no row in the last step, its queue position, its counts (O(queue))."""
        request = self.requests.get(seq_id)
        if request is None or request.is_finished:
            return None
        queue = {WAITING: self.waiting, SWAPPED: self.swapped}.get(request.wait.queue)
        if queue is None:
            return self.waits.status(seq_id, request.wait)
        position = next(i for i, r in enumerate(queue) if r is request)
        return self.waits.status(seq_id, request.wait, position, len(queue))

    def stats(self) -> SchedulerStats:
        """Queue lengths, KV pool and cumulative counters now (O(waiting + running + swapped))."""
        bm = self.block_manager
        # A waiting sequence holds no KV (recompute resets it): all its tokens are still to compute.
        # A running one has one token to compute when decoding; more while its prefill is chunked.
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            num_waiting_requests=len({r.parent_id for r in self.waiting}), num_swapped=len(self.swapped),
            num_running_tokens=sum(len(r.token_ids) for r in self.running),
            num_running_prefill_tokens=sum(_num_prefill_left(r) for r in self.running),
            num_waiting_tokens=sum(len(r.token_ids) for r in self.waiting),
            num_swapped_tokens=sum(len(r.token_ids) for r in self.swapped),
            num_kv_blocks=bm.num_blocks, num_kv_blocks_used=bm.num_used_blocks,
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_hit_rate=bm.prefix_cache_hit_rate,
            num_draft_tokens_total=self.num_draft_tokens_total,
            num_accepted_tokens_total=self.num_accepted_tokens_total,
            num_evictions_total=bm.num_evictions_total, recent_evicted_hashes=bm.recent_evicted_hashes,
            mean_output_tokens=self.mean_output_tokens)

    # ---- schedule ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step's rows: running first, then swapped back in, then new admissions."""
        plan = _StepPlan(self.config.max_num_batched_tokens, [], [], [])
        if self.config.batching == "static":
            self._end_static_batch_if_done()
        plan.slo = self._slo_budget()
        self._schedule_running(plan)
        # A step that had to preempt is short of memory: admitting now would only thrash.
        waiting_reason = swapped_reason = PREEMPTING
        if plan.num_preempted == 0:
            swapped_reason = self._schedule_swapped(plan)
            waiting_reason = SWAPPED_FIRST if self.swapped else None
            if waiting_reason is None and not self._is_admission_open():
                waiting_reason = STATIC_BATCH
            if waiting_reason is None:
                waiting_reason = self._schedule_waiting(plan)
        self.waits.end_step(waiting_reason, swapped_reason, len(self.waiting), len(self.swapped))
        return SchedulerOutput(rows=tuple(plan.rows), blocks_to_swap_out=tuple(plan.swap_out),
                               blocks_to_swap_in=tuple(plan.swap_in), blocks_to_copy=tuple(plan.copies),
                               num_preempted=plan.num_preempted)

    def _is_admission_open(self) -> bool:
        # Static batching admits a new batch only once the previous one has left entirely.
        return self.config.batching == "continuous" or not self.running

    def _schedule_running(self, plan: _StepPlan) -> None:
        i = 0
        while i < len(self.running) and plan.budget > 0:
            request = self.running[i]
            if request.is_padding:
                self._add_padding_row(plan, request)
                i += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, plan.budget)
            if num_new > 1 and plan.slo is not None:  # a prefill chunk: only the SLO's slack
                num_new = plan.slo.running_chunk(num_new)
            if num_new <= 0:  # no SLO slack for its prefill chunk
                self.waits.hold(request.request_id, request.wait, TPOT_SLO)
                i += 1
                continue
            drafts = self._draft(plan, request) if num_new == 1 and self.proposer is not None else ()
            if drafts and self.block_manager.allocate_slots(request, 1 + len(drafts)):
                self._add_row(plan, request, 1, drafts)
                i += 1
            elif self._allocate_or_preempt(plan, request, num_new):  # drafts never preempt anyone
                self._add_row(plan, request, num_new)
                i += 1
            # else: `request` itself was preempted and left `running`; index i now holds the next.
        for request in self.running[i:]:  # the budget ran out before them
            if not request.is_padding:
                self.waits.hold(request.request_id, request.wait, TOKEN_BUDGET)

    def _draft(self, plan: _StepPlan, request: Request) -> tuple[int, ...]:
        """Speculative tokens for a decode row: greedy rows whose logits do not depend on the tokens before
        them (no penalties; past min_tokens; logit bias and logprobs are per position and fine), within the
        step's budget, the request's max_tokens (the bonus token still fits) and max_model_len."""
        params = request.sampling_params
        if (self.proposer is None or plan.slo is not None or not params.is_greedy or params.has_penalties
                or request.num_output_tokens < params.min_tokens
                or request.grammar is not None):  # a draft's mask would need the grammar run ahead
            return ()
        room = min(plan.budget - 1, request.max_tokens - request.num_output_tokens - 1,
                   self.config.max_model_len - request.num_tokens)
        if room <= 0:
            return ()
        if request.ngram_index is None:
            request.ngram_index = self.proposer.new_index()
        if request.ngram_index.acceptance < min_acceptance(len(self.running)):
            return ()  # its drafts have been wrong too often to pay at this batch size
        return self.proposer.propose(request.ngram_index, request.token_ids, room)

    def _allocate_or_preempt(self, plan: _StepPlan, request: Request, num_new: int) -> bool:
        """Blocks for `num_new` more tokens, preempting from the tail of `running` until they fit."""
        while not self.block_manager.allocate_slots(request, num_new):
            victim = self._pick_victim(plan)
            self._preempt(plan, victim)
            if victim is request:
                return False
        return True

    def _pick_victim(self, plan: _StepPlan) -> Request:
        """Lowest priority, then latest arrival, among requests without a row yet this step.

        Padding rows of a static batch hold blocks for nothing useful: they go first.
        """
        candidates = [r for r in self.running if r.request_id not in plan.scheduled]
        padding = [r for r in candidates if r.is_padding]
        return (padding or candidates)[-1]

    def _preempt(self, plan: _StepPlan, victim: Request) -> None:
        self.running.remove(victim)
        if victim.is_padding:
            self._release(victim)
            return
        plan.num_preempted += 1
        self.num_preemptions_total += 1
        victim.metrics.num_preemptions += 1
        choice = self._choose_preemption(victim)
        if choice.mode == "swap":
            plan.swap_out.extend(self.block_manager.swap_out(victim))
            victim.status = RequestStatus.SWAPPED
            victim.metrics.num_swaps += 1
            insort(self.swapped, victim, key=self._order_key)
            self.waits.preempted(victim.request_id, victim.wait, choice, SWAPPED)
            return
        # Recompute: drop the KV; the request resumes from its tokens (prompt + output so far).
        self.block_manager.free(victim)
        victim.metrics.num_recomputed_tokens += victim.num_computed_tokens
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        insort(self.waiting, victim, key=self._order_key)
        self.waits.preempted(victim.request_id, victim.wait, choice, WAITING)

    def _choose_preemption(self, victim: Request) -> PreemptionChoice:
        """Swap or recompute: as configured, or under auto whichever is predicted to cost less.

        Swap needs room in the host pool; auto swaps while it has no measured copy time (or no fitted
        step-time model), so that the copies get timed.
        """
        mode, can_swap = self.config.preemption_mode, self.block_manager.can_swap_out(victim)
        choice = partial(PreemptionChoice, victim.request_id, self.waits.num_steps,
                         num_computed_tokens=victim.num_computed_tokens)
        if mode != "auto":
            is_swap = mode == "swap" and can_swap
            return choice(mode="swap" if is_swap else "recompute",
                          why=SWAP_POOL_FULL if mode == "swap" and not is_swap else CONFIGURED)
        recompute_s, swap_s = self._predict_preemption(victim)
        if not can_swap:
            mode, why = "recompute", SWAP_POOL_FULL
        elif swap_s is None or recompute_s is None:
            mode, why = "swap", UNMEASURED
        else:
            mode, why = ("swap" if swap_s < recompute_s else "recompute"), CHEAPER
        return choice(mode=mode, why=why, recompute_s=recompute_s, swap_s=swap_s)

    def _predict_preemption(self, victim: Request) -> tuple[float | None, float | None]:
        """(recompute, swap) seconds predicted for this victim; None where there is no prediction."""
        if self.preemption_cost_predictor is None:
            return None, None
        bm = self.block_manager
        # Leading blocks another live request shares stay resident: re-admission finds them cached,
        # and a swap leaves them on the device uncopied.
        num_shared = bm.num_shared_prefix_blocks(victim)
        num_cached = min(num_shared * bm.block_size, victim.num_computed_tokens)
        num_copied = len(bm.block_tables.get(victim.request_id, ())) - num_shared
        return self.preemption_cost_predictor(victim.num_computed_tokens, num_cached, num_copied)

    def _schedule_swapped(self, plan: _StepPlan) -> str | None:
        """Swap back in from the head of `swapped`; the reason the rest stay out (None: none left)."""
        bm = self.block_manager
        while self.swapped:
            if not self._has_seat():
                return MAX_NUM_SEQS
            if plan.budget <= 0:
                return TOKEN_BUDGET
            request = self.swapped[0]
            if not bm.is_swap_prefix_resident(request):
                self._recompute_swapped(request)
                continue
            use_watermark = bool(self.running)
            if not bm.can_swap_in(request, use_watermark):
                reason = WATERMARK if use_watermark and bm.can_swap_in(request, False) else KV_BLOCKS
                self.waits.hold(request.request_id, request.wait, reason)
                return reason
            self.swapped.pop(0)
            plan.swap_in.extend(bm.swap_in(request))
            self.waits.leave(request.wait, RUNNING)
            request.status = RequestStatus.RUNNING
            insort(self.running, request, key=self._order_key)
            num_new = min(request.num_tokens - request.num_computed_tokens, plan.budget)
            if bm.allocate_slots(request, num_new):
                self._add_row(plan, request, num_new)
            else:  # back in, but no block for its next token
                self.waits.hold(request.request_id, request.wait, KV_BLOCKS)
        return None

    def _recompute_swapped(self, request: Request) -> None:
        """A swapped request whose shared prefix, left on the device, was evicted: it resumes by recompute."""
        self.swapped.remove(request)
        self.block_manager.free_swap(request)
        request.metrics.num_recomputed_tokens += request.num_computed_tokens
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        insort(self.waiting, request, key=self._order_key)
        self.waits.leave(request.wait, WAITING)
        self.waits.enter(request.wait, WAITING)

    def _schedule_waiting(self, plan: _StepPlan) -> str | None:
        """Admit from the head of `waiting`; the reason the rest wait (None: nobody left)."""
        skipped: list[Request] = []
        reason = None
        while self.waiting:
            if not self._has_seat():
                reason = MAX_NUM_SEQS
                break
            if plan.budget <= 0:
                reason = TOKEN_BUDGET
                break
            request = self.waiting.pop(0)
            if request.waits_for is not None and not request.waits_for.is_prompt_computed \
                    and not request.waits_for.is_finished:
                skipped.append(request)  # its sibling's prompt blocks will be shared next step
                self.waits.hold(request.request_id, request.wait, SIBLING_PROMPT)
                continue
            if request.grammar is not None and not request.grammar.is_ready:
                skipped.append(request)  # compiling off the engine thread: the others go ahead
                self.waits.hold(request.request_id, request.wait, GRAMMAR_COMPILING)
                continue
            reason = self._admit(plan, request)
            if reason is not None:
                self.waiting.insert(0, request)
                self.waits.hold(request.request_id, request.wait, reason)
                break
        for request in skipped:
            insort(self.waiting, request, key=self._order_key)
        return reason

    def _has_seat(self) -> bool:
        return len(self.running) < self.config.max_num_seqs

    def _admit(self, plan: _StepPlan, request: Request) -> str | None:
        """Seat `request` with its first chunk; the reason it cannot be (None: admitted)."""
        bm = self.block_manager
        cached, copy_from = self._cache_hit(request)
        num_cached = request.num_tokens - 1 if copy_from is not None else len(cached) * bm.block_size
        num_new = request.num_tokens - num_cached
        if not self.config.enable_chunked_prefill and num_new > plan.budget:
            return TOKEN_BUDGET
        num_new = min(num_new, plan.budget)
        if plan.slo is not None:
            num_new = plan.slo.admission_chunk(request, num_cached, num_new,
                                               self.config.enable_chunked_prefill)
            if num_new == 0:
                self.num_slo_capped_steps += 1
                return TPOT_SLO
        request.num_computed_tokens = num_cached
        # The watermark is headroom for running requests to grow into: with none running, holding
        # it back would starve a request that needs the whole pool (it would wait forever).
        use_watermark = bool(self.running)
        if not bm.allocate_slots(request, num_new, cached, use_watermark=use_watermark):
            num_blocks = bm.num_blocks_to_allocate(request, num_new, cached)
            request.num_computed_tokens = 0
            is_watermark = use_watermark and bm.can_allocate(num_blocks, use_watermark=False)
            return WATERMARK if is_watermark else KV_BLOCKS
        if copy_from is not None:
            plan.copies.append((copy_from, bm.block_tables[request.request_id][-1]))
        self.waits.leave(request.wait, RUNNING)
        bm.record_cache_lookup(request.num_tokens - 1, num_cached)
        request.metrics.num_cached_tokens = max(request.metrics.num_cached_tokens, num_cached)
        request.status = RequestStatus.RUNNING
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = time.monotonic()
        insort(self.running, request, key=self._order_key)
        self._add_row(plan, request, num_new)
        return None

    def _cache_hit(self, request: Request) -> tuple[list[int], int | None]:
        """The prefix cache's blocks for a request being seated, and the cached block to copy where its
        tokens are all there (block_manager.find_cached_last_block; None: the block of its last token is
        recomputed).

        The copy needs no block held for it: it runs after the swaps and before the forward, so the source
        still holds its KV then even if this step reuses it (as this request's own copy, a copy onto itself,
        or another row's, written by the forward)."""
        if request.needs_prompt_logprobs:  # they need every prompt position's logits: no hit until scored
            return [], None
        cached = self.block_manager.find_cached_prefix(request)
        return cached, self.block_manager.find_cached_last_block(request, cached)

    def _slo_budget(self) -> SloStepBudget | None:
        if self.config.tpot_slo_ms is None or self.step_time_predictor is None:
            return None
        return SloStepBudget(self.step_time_predictor, self.config.tpot_slo_ms, self.running)

    def _add_row(self, plan: _StepPlan, request: Request, num_new: int, drafts: tuple[int, ...] = ()) -> None:
        end = request.num_computed_tokens + num_new
        plan.rows.append(ScheduledRow(
            request_id=request.request_id, token_ids=request.token_ids,
            num_prompt_tokens=request.num_prompt_tokens,
            num_computed_tokens=request.num_computed_tokens, num_new_tokens=num_new + len(drafts),
            block_table=self.block_manager.block_tables[request.request_id],
            sampling_params=request.sampling_params, needs_sample=end == request.num_tokens,
            spec_token_ids=drafts,
            prompt_logprobs_from=len(request.prompt_logprobs) if request.needs_prompt_logprobs else None))
        plan.budget -= num_new + len(drafts)
        plan.num_context_tokens += end + len(drafts)
        plan.scheduled.add(request.request_id)

    def _add_padding_row(self, plan: _StepPlan, request: Request) -> None:
        # Recompute the last cached position: the compute a static system spends on a finished row.
        position = min(request.num_computed_tokens, request.num_tokens - 1) - 1
        plan.rows.append(ScheduledRow(
            request_id=request.request_id, token_ids=request.token_ids,
            num_prompt_tokens=request.num_prompt_tokens, num_computed_tokens=position,
            num_new_tokens=1, block_table=self.block_manager.block_tables[request.request_id],
            sampling_params=request.sampling_params, needs_sample=False, is_padding=True))
        plan.budget -= 1
        plan.num_context_tokens += position + 1
        plan.scheduled.add(request.request_id)

    def _end_static_batch_if_done(self) -> None:
        if self.running and all(r.is_padding for r in self.running):
            for request in list(self.running):
                self._release(request)

    # ---- update ----------------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, runner_output: RunnerOutput) -> list[RequestDelta]:
        """Advance computed tokens, append sampled tokens, finish requests: the only place for that."""
        now = time.monotonic()
        deltas: list[RequestDelta] = []
        samples, logprobs = runner_output.sampled_token_ids, runner_output.logprobs
        taken = 0
        for row in output.rows:
            first, taken = taken, taken + row.num_samples
            request = self.requests.get(row.request_id)
            if request is None or row.is_padding or request.status != RequestStatus.RUNNING:
                continue  # aborted since scheduling, or a padding row
            self._add_prompt_logprobs(request, row, runner_output)
            if not row.needs_sample:
                request.num_computed_tokens += row.num_new_tokens
                self.block_manager.cache_full_blocks(request)
            elif not row.spec_token_ids:
                request.num_computed_tokens += row.num_new_tokens
                deltas.append(self._append_sample(request, samples[first], logprobs[first], now))
            else:
                deltas.append(self._verify(request, row, samples[first:taken], logprobs[first:taken], now))
        assert taken == len(samples) == len(logprobs), "one sample per sampled position"
        return deltas

    @staticmethod
    def _add_prompt_logprobs(request: Request, row: ScheduledRow, runner_output: RunnerOutput) -> None:
        entries = runner_output.prompt_logprobs.get(row.request_id)
        if entries:
            assert row.prompt_logprob_positions.start == len(request.prompt_logprobs), "a gap in prompt logprobs"
            request.prompt_logprobs.extend(entries)

    def _append_sample(self, request: Request, token_id: int, logprobs: TokenLogprobs | None,
                       now: float) -> RequestDelta:
        request.append_token(token_id, logprobs, now)
        self.block_manager.cache_full_blocks(request)
        status = request.check_stop(self.config.max_model_len)
        if status is None and request.is_past_deadline(now):  # the token is delivered, then it ends
            status = RequestStatus.FINISHED_DEADLINE
        if status is not None:
            return self._finish(request, status, now, new_token_ids=(token_id,))
        return self._delta(request, (token_id,), (logprobs,) if logprobs else ())

    def _verify(self, request: Request, row: ScheduledRow, sampled: Sequence[int],
                logprobs: Sequence[TokenLogprobs | None], now: float) -> RequestDelta:
        """A speculative row: keep the verified run, token by token up to the first that stops it."""
        drafts = row.spec_token_ids
        tokens = accepted_tokens(drafts, list(sampled))
        self.num_draft_tokens_total += len(drafts)
        self.num_accepted_tokens_total += len(tokens) - 1
        if request.ngram_index is not None:
            request.ngram_index.record(len(drafts), len(tokens) - 1)
        # The fed positions that hold verified tokens: the last known one and the accepted drafts.
        request.num_computed_tokens += row.num_new_tokens - len(drafts) + len(tokens) - 1
        for num_appended, (token_id, token_logprobs) in enumerate(zip(tokens, logprobs), start=1):
            request.append_token(token_id, token_logprobs, now)
            status = request.check_stop(self.config.max_model_len)
            if status is not None:  # the tokens past the stop are dropped, computed or not
                request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
                self.block_manager.cache_full_blocks(request)
                return self._finish(request, status, now, new_token_ids=tuple(tokens[:num_appended]))
        self.block_manager.cache_full_blocks(request)
        if request.is_past_deadline(now):  # the verified run came in one step: all of it counts
            return self._finish(request, RequestStatus.FINISHED_DEADLINE, now, new_token_ids=tuple(tokens))
        return self._delta(request, tuple(tokens), tuple(lp for lp in logprobs[:len(tokens)] if lp is not None))

    @staticmethod
    def _delta(request: Request, new_token_ids: tuple[int, ...],
               new_logprobs: tuple[TokenLogprobs, ...]) -> RequestDelta:
        return RequestDelta(
            request_id=request.request_id, parent_id=request.parent_id, index=request.index,
            new_token_ids=new_token_ids, new_logprobs=new_logprobs,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            prompt_logprobs=request.take_prompt_logprobs())

    def fail_step(self, output: SchedulerOutput, error: str) -> list[RequestDelta]:
        """The runner raised: finish this step's requests with an error; the rest go on."""
        now = time.monotonic()
        deltas = []
        for row in output.rows:
            request = self.requests.get(row.request_id)
            if request is not None and not request.is_finished:
                deltas.append(self._finish(request, RequestStatus.FINISHED_ERROR, now, error=error))
        return deltas

    # ---- finish --------------------------------------------------------------------------------

    def _finish(self, request: Request, status: RequestStatus, now: float,
                new_token_ids: tuple[int, ...] = (), error: str | None = None) -> RequestDelta:
        was_running = request.status == RequestStatus.RUNNING
        request.status = status
        request.metrics.finished_time = now
        self.waits.leave(request.wait, FINISHED)
        request.metrics.wait_steps = self.waits.wait_steps(request.wait)
        request.metrics.preemptions = tuple(request.wait.preemptions)
        is_natural_end = status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        if is_natural_end:
            self._observe_output_length(request.num_output_tokens)
        keep_row = self.config.batching == "static" and was_running and is_natural_end
        if keep_row:
            request.is_padding = True  # keeps its row and blocks until the batch's longest ends
        else:
            self._release(request)
        last_logprobs = (request.output_logprobs[-len(new_token_ids):]
                         if new_token_ids and request.output_logprobs else [])
        return RequestDelta(
            request_id=request.request_id, parent_id=request.parent_id, index=request.index,
            new_token_ids=new_token_ids, new_logprobs=tuple(last_logprobs),
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens, finish_reason=status.finish_reason,
            stop_reason=request.stop_reason, metrics=replace(request.metrics), error=error,
            prompt_logprobs=request.take_prompt_logprobs())

    def _observe_output_length(self, num_output_tokens: int) -> None:
        # A moving mean over about the last 32 sequences: what a router expects a seat to last.
        mean = self.mean_output_tokens
        self.mean_output_tokens = (float(num_output_tokens) if mean == 0.0
                                   else mean + (num_output_tokens - mean) / 32)

    def _release(self, request: Request) -> None:
        """Remove a request from every queue and give back its blocks."""
        for queue in (self.waiting, self.running, self.swapped):
            if request in queue:
                queue.remove(request)
                break
        self.block_manager.free(request)
        self.block_manager.free_swap(request)
        self.requests.pop(request.request_id, None)

    # ---- invariants ----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Cheap structural checks, run by tests after every step."""
        bm = self.block_manager
        bm.check_invariants()
        queued = self.waiting + self.running + self.swapped
        assert len(queued) == len({id(r) for r in queued}), "a request is in two queues"
        assert {r.request_id for r in queued} == set(self.requests), "a request is lost or stray"
        assert len(self.running) <= self.config.max_num_seqs
        for request in self.running:
            table = bm.block_tables.get(request.request_id, [])
            assert len(table) * bm.block_size >= request.num_computed_tokens, "computed KV has no block"
        for request in self.waiting:
            assert request.request_id not in bm.block_tables, "a waiting request holds blocks"
            assert request.status == RequestStatus.WAITING
        for request in self.swapped:
            assert request.request_id in bm.swap_tables and request.request_id not in bm.block_tables
        for queue, name in ((self.waiting, WAITING), (self.running, RUNNING), (self.swapped, SWAPPED)):
            assert all(r.wait.queue == name for r in queue if not r.is_padding), f"wait record off {name}"
        due = {(r.deadline_time, r.request_id) for r in queued
               if r.deadline_time is not None and not r.is_finished}
        assert due <= set(self._deadlines), "a queued request's deadline is not watched"


def _num_prefill_left(request: Request) -> int:
    """Tokens a running request computes beyond its next decode token (chunked prefill, recompute)."""
    num_left = request.num_tokens - request.num_computed_tokens
    return num_left if num_left > 1 and not request.is_padding else 0
