"""The engine: one step = schedule -> runner.execute -> scheduler.update, with step telemetry."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from cobatch.config import EngineConfig, SchedulerConfig
from cobatch.cost_model import CopyTimeEstimate, StepTimeModel, predict_recompute_s
from cobatch.outputs import RequestDelta
from cobatch.request import Request, RequestStatus
from cobatch.sampling_params import SamplingParams
from cobatch.scheduler import Scheduler, SchedulerStats
from cobatch.scheduler_output import RunnerOutput, ScheduledRow, SchedulerOutput
from cobatch.structured_output.grammar_spec import check_grammar
from cobatch.structured_output.manager import StructuredOutputManager, load_backend
from cobatch.structured_output.request_grammar import RequestGrammar
from cobatch.wait_reasons import SequenceWaitStatus, StepWaits

if TYPE_CHECKING:
    from cobatch.structured_output.bitmask import GrammarBitmask  # torch: only where a model runs
    from cobatch.tokenizer import Tokenizer

# A step with no row while grammars compile waits this long for one to finish (instead of spinning).
_COMPILE_WAIT_S = 0.02


class Runner(Protocol):
    """What the engine needs of a model runner (the real one, or a fake in tests)."""

    num_kv_blocks: int
    num_swap_blocks: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]

    # execute(output, grammar_bitmask=...) too when a row is constrained (ModelRunner: the masks go
    # on the logits before sampling); runners that never see constrained rows need not take it.
    def execute(self, output: SchedulerOutput) -> RunnerOutput: ...


@dataclass(frozen=True, slots=True)
class StepStats:
    """One step's telemetry: cheap enough to keep for every step."""

    step: int
    start_time: float  # time.monotonic()
    duration_s: float
    schedule_s: float
    execute_s: float
    num_running: int
    num_waiting: int
    num_swapped: int
    num_rows: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_padding_rows: int
    num_context_tokens: int
    num_kv_blocks_used: int
    kv_usage: float
    num_preempted: int
    num_generated_tokens: int  # useful tokens appended this step
    num_draft_tokens: int  # speculative drafts fed this step (spec_decode.py)
    num_accepted_tokens: int  # of which the model agreed with (each saved a step for its row)
    predicted_s: float  # the step-time model's prediction before the step (0 until fitted)
    prefix_cache_hit_rate: float  # cumulative share of looked-up prompt tokens found in the cache
    row_request_ids: tuple[str, ...]  # who occupies each row: the "metro" timeline
    # Per row, the live views' cell: "p" prefill chunk (or recompute), "d" decode (speculative too),
    # "x" static-batching padding; and the row's new tokens.
    row_kinds: str = ""
    row_num_new_tokens: tuple[int, ...] = ()
    # Who had no row and why (counts by reason, the examined sequences, each queue's shared reason),
    # and the step's preemptions with their mode and predicted costs.
    waits: StepWaits = StepWaits()


class Engine:
    """Owns the scheduler and the runner; single-threaded by design (see AsyncEngine)."""

    def __init__(self, runner: Runner, scheduler_config: SchedulerConfig,
                 stats_history: int | None = 4096,
                 structured_outputs: StructuredOutputManager | None = None) -> None:
        self.runner = runner
        # Grammars for sampling_params.structured_outputs (None: such requests are refused).
        self.structured_outputs = structured_outputs
        self.config = scheduler_config
        self.step_time_model = StepTimeModel()  # every step
        # Pure decode steps only: a prefill token costs a fraction of a decode row (GEMM efficiency),
        # so one linear fit over both regimes misjudges the all-decoding batch the SLO seat check asks about.
        self.decode_time_model = StepTimeModel()
        self.copy_time = CopyTimeEstimate()  # of the runner's swap copies, as measured
        self.scheduler = Scheduler(scheduler_config, self.predict_step_s, self.predict_preemption_s)
        self.scheduler_stats: SchedulerStats = self.scheduler.stats()  # as of the last step
        self.stats: deque[StepStats] = deque(maxlen=stats_history)
        self.num_steps = 0
        self._unfinished: dict[str, set[str]] = {}  # request id -> its unfinished sequence ids

    @classmethod
    def from_config(cls, config: EngineConfig, stats_history: int | None = 4096,
                    wrap_runner: Callable[[Runner], Runner] | None = None,
                    tokenizer: Tokenizer | None = None) -> Engine:
        """Load the model, size the KV pools, and build the engine (its runner wrapped, if asked;
        grammars built on `tokenizer`, when the caller has loaded the model's already)."""
        from cobatch.runner.model_runner import ModelRunner  # torch only where a model runs

        runner: Runner = ModelRunner.load(config)
        if wrap_runner is not None:  # e.g. cobatch.testing's fault injection (serve --enable-fault-injection)
            runner = wrap_runner(runner)
        scheduler_config = config.scheduler_config(
            runner.num_kv_blocks, runner.num_swap_blocks, runner.max_model_len)
        structured = StructuredOutputManager(load_backend(config.model, runner.eos_token_ids, tokenizer))
        return cls(runner, scheduler_config, stats_history, structured)

    def on_idle(self) -> None:
        """Called by a serving loop that waited a poll with nothing to run (ModelRunner.on_idle)."""
        on_idle = getattr(self.runner, "on_idle", None)
        if on_idle is not None:
            on_idle()

    def prefault_kv_cache(self) -> None:
        """Make the KV pool resident before serving (see ModelRunner.prefault_kv_cache)."""
        prefault = getattr(self.runner, "prefault_kv_cache", None)
        if prefault is not None:
            prefault()

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # ---- requests ------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request fits the model; return its resolved max_tokens. ValueError if not."""
        vocab_size = getattr(getattr(self.runner, "model_config", None), "vocab_size", None)
        return validate_request(prompt_token_ids, params, self.max_model_len, vocab_size)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None) -> list[str]:
        """Queue a request (n sequences for n samples); returns the sequence ids."""
        if request_id in self._unfinished:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = self.validate(prompt_token_ids, params)
        if params.structured_outputs is not None and self.structured_outputs is None:
            raise ValueError("structured_outputs: this engine has no grammar backend")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        first: Request | None = None
        ids = []
        for index in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{index}"
            request = Request(seq_id, list(prompt_token_ids), params.for_sample(index),
                              self.runner.eos_token_ids, max_tokens, priority=priority,
                              parent_id=request_id, index=index, waits_for=first,
                              arrival_time=arrival)
            first = first or request
            if params.structured_outputs is not None and self.structured_outputs is not None:
                request.grammar = self.structured_outputs.grammar_for(seq_id, params.structured_outputs)
            self.scheduler.add_request(request)
            ids.append(seq_id)
        self._unfinished[request_id] = set(ids)
        return ids

    def abort_request(self, request_id: str) -> list[RequestDelta]:
        """Abort all sequences of a request, wherever they are; their blocks are free at once."""
        deltas = []
        for seq_id in sorted(self._unfinished.pop(request_id, ())):
            delta = self.scheduler.abort_request(seq_id)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def stop_sequence(self, seq_id: str, stop_reason: str) -> RequestDelta | None:
        """Finish one sequence with "stop" (the caller found a stop string in its text)."""
        delta = self.scheduler.abort_request(seq_id, RequestStatus.FINISHED_STOPPED, stop_reason)
        if delta is not None:
            self._forget_finished([delta])
        return delta

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- step ----------------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """Run one iteration over the current batch; returns the deltas it produced."""
        start = time.monotonic()
        # Before scheduling, so that no row is given to a request whose deadline has passed.
        expired = self.scheduler.expire_deadlines(start) + self._fail_grammars()
        output = self.scheduler.schedule()
        grammar_bitmask = self._grammar_bitmask(output)
        scheduled = time.monotonic()
        predicted_s = self._predict(output)
        deltas: list[RequestDelta]
        # A failed step fails its requests, not the engine; a BaseException (KeyboardInterrupt, the
        # engine_death fault of cobatch.testing) is not a failed step and ends the engine loop.
        try:
            runner_output = (self.runner.execute(output) if grammar_bitmask is None else
                             self.runner.execute(output, grammar_bitmask=grammar_bitmask))  # type: ignore[call-arg]
        except Exception as exc:  # noqa: BLE001
            deltas = self.scheduler.fail_step(output, f"{type(exc).__name__}: {exc}")
        else:
            self.copy_time.observe(runner_output.num_copied_blocks, runner_output.copy_s)
            deltas = self.scheduler.update(output, runner_output)
        deltas = expired + deltas
        end = time.monotonic()
        self._record(output, deltas, start, scheduled, end, predicted_s)
        self._forget_finished(deltas)
        return deltas

    def _fail_grammars(self) -> list[RequestDelta]:
        """Sequences whose grammar failed to compile end with the error (before any token)."""
        if self.structured_outputs is None or not self.structured_outputs.has_pending:
            return []
        deltas = []
        for seq_id, error in self.structured_outputs.take_compile_errors():
            delta = self.scheduler.abort_request(seq_id, RequestStatus.FINISHED_ERROR,
                                                 error=f"structured_outputs: {error}")
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _grammar_bitmask(self, output: SchedulerOutput) -> GrammarBitmask | None:
        """The step's token masks of constrained rows; a step with no row waits a little for a compile."""
        structured = self.structured_outputs
        if structured is None or not structured.is_active:
            return None
        if not output.rows and structured.has_pending:
            structured.wait_for_compile(_COMPILE_WAIT_S)
        return structured.bitmask(output.rows, self._grammar_of)

    def _grammar_of(self, seq_id: str) -> RequestGrammar | None:
        request = self.scheduler.requests.get(seq_id)
        return request.grammar if request is not None else None  # type: ignore[return-value]

    def predict_step_s(self, num_rows: int, num_tokens: int, num_context_tokens: int) -> float:
        """Predicted seconds of a step of this shape (0 until the models have seen enough steps)."""
        if num_tokens == num_rows and self.decode_time_model.is_ready:
            return self.decode_time_model.predict(num_rows, num_tokens, num_context_tokens)
        return self.step_time_model.predict(num_rows, num_tokens, num_context_tokens)

    def predict_preemption_s(self, num_computed_tokens: int, num_cached_tokens: int,
                             num_blocks: int) -> tuple[float | None, float | None]:
        """Predicted seconds of (recompute, swap out and back in) for a victim; None: not known yet."""
        recompute_s = None
        if self.step_time_model.is_ready:
            recompute_s = predict_recompute_s(self.step_time_model.fitted_coefficients, num_computed_tokens,
                                              num_cached_tokens, self.config.max_num_batched_tokens)
        return recompute_s, self.copy_time.predict_s(2 * num_blocks)

    def request_status(self, request_id: str) -> list[SequenceWaitStatus] | None:
        """Why each live sequence of a request (or one sequence id) is waiting; None if none is live."""
        seq_ids = self._unfinished.get(request_id) or ({request_id} & self.scheduler.requests.keys())
        found = [self.scheduler.wait_status(seq_id) for seq_id in sorted(seq_ids)]
        statuses = [status for status in found if status is not None]
        return statuses or None

    def _predict(self, output: SchedulerOutput) -> float:
        return self.predict_step_s(*_shape(output))

    def _forget_finished(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            seq_ids = self._unfinished.get(delta.parent_id)
            if delta.finished and seq_ids is not None:
                seq_ids.discard(delta.request_id)
                if not seq_ids:
                    del self._unfinished[delta.parent_id]

    def _record(self, output: SchedulerOutput, deltas: list[RequestDelta], start: float,
                scheduled: float, end: float, predicted_s: float) -> None:
        rows, tokens, context = _shape(output)
        if rows:
            self.step_time_model.observe(rows, tokens, context, end - start)
            if tokens == rows:
                self.decode_time_model.observe(rows, tokens, context, end - start)
        prefill = sum(r.num_new_tokens for r in output.rows
                      if r.num_computed_tokens < r.num_prompt_tokens and not r.is_padding)
        padding = sum(1 for r in output.rows if r.is_padding)
        # Speculative counters only move in update(): the last step's totals are this step's "before".
        before, now = self.scheduler_stats, self.scheduler.stats()
        self.scheduler_stats = now
        self.stats.append(StepStats(
            step=self.num_steps, start_time=start, duration_s=end - start,
            schedule_s=scheduled - start, execute_s=end - scheduled,
            num_running=now.num_running, num_waiting=now.num_waiting,
            num_swapped=now.num_swapped, num_rows=rows, num_prefill_tokens=prefill,
            num_decode_tokens=tokens - prefill - padding, num_context_tokens=context,
            num_padding_rows=padding,
            num_kv_blocks_used=now.num_kv_blocks_used,
            kv_usage=now.kv_usage, num_preempted=output.num_preempted,
            num_generated_tokens=sum(len(d.new_token_ids) for d in deltas),
            num_draft_tokens=now.num_draft_tokens_total - before.num_draft_tokens_total,
            num_accepted_tokens=now.num_accepted_tokens_total - before.num_accepted_tokens_total,
            predicted_s=predicted_s,
            prefix_cache_hit_rate=now.prefix_cache_hit_rate,
            row_request_ids=tuple(r.request_id for r in output.rows),
            row_kinds="".join(map(_row_kind, output.rows)),
            row_num_new_tokens=tuple(r.num_new_tokens for r in output.rows),
            waits=self.scheduler.waits.last))
        self.num_steps += 1


def validate_request(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int,
                     vocab_size: int | None = None) -> int:
    """Check a request fits a model of `max_model_len` (and its vocabulary, when known); return its
    resolved max_tokens (ValueError if not).

    Module-level so that a router in front of several engines checks exactly as each engine does.
    An id outside the vocabulary would fail the embedding lookup of the whole step it joins.
    """
    if vocab_size is not None:
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the model's vocabulary [0, {vocab_size})")
    if params.structured_outputs is not None:
        check_grammar(params.structured_outputs)  # an unsupported or invalid constraint: a 400 naming it
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise ValueError("the prompt must contain at least one token")
    room = max_model_len - num_prompt
    if room < 1:
        raise ValueError(f"the prompt has {num_prompt} tokens; this model's maximum context "
                         f"length is {max_model_len}, leaving no room to generate")
    if params.max_tokens is not None and params.max_tokens > room:
        raise ValueError(
            f"this model's maximum context length is {max_model_len} tokens; the request "
            f"asks for {num_prompt + params.max_tokens} ({num_prompt} in the prompt, "
            f"{params.max_tokens} to generate): lower max_tokens or the prompt")
    return params.max_tokens if params.max_tokens is not None else room


def _row_kind(row: ScheduledRow) -> str:
    """StepStats.row_kinds' letter: a decode row feeds one known output token (and any drafts).

    Not from len(token_ids): the row shares the request's list, which update() has already grown.
    """
    if row.is_padding:
        return "x"
    is_prefill = (row.num_computed_tokens < row.num_prompt_tokens
                  or row.num_new_tokens > 1 + len(row.spec_token_ids))  # a recompute chunk of output
    return "p" if is_prefill else "d"


def _shape(output: SchedulerOutput) -> tuple[int, int, int]:
    """(rows, batched tokens, context tokens): the step-time model's inputs."""
    context = sum(r.num_computed_tokens + r.num_new_tokens for r in output.rows)
    return len(output.rows), output.num_batched_tokens, context
