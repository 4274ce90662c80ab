"""A request's state inside the engine (what it emits lives in outputs.py)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

from cobatch.outputs import RequestMetrics
from cobatch.sampling_params import SamplingParams
from cobatch.scheduler_output import TokenLogprobs
from cobatch.spec_decode import NgramIndex
from cobatch.wait_ledger import WaitRecord


class RequestStatus(enum.IntEnum):
    """Ordered so that `status >= FINISHED_STOPPED` means finished."""

    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6
    FINISHED_DEADLINE = 7  # its sampling_params.deadline_ms passed before it finished

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_DEADLINE: "deadline",
}


class OutputGrammar(Protocol):
    """A constrained sequence's grammar state (cobatch/structured_output's RequestGrammar)."""

    @property
    def is_ready(self) -> bool: ...  # compiled: the sequence may be scheduled

    @property
    def is_terminated(self) -> bool: ...  # the grammar is complete: the sequence stops

    def accept_token(self, token_id: int) -> None: ...


@dataclass(slots=True)
class Request:
    """One sequence being generated. `n` parallel samples are `n` Requests sharing `parent_id`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_tokens: int  # resolved: sampling_params.max_tokens clamped to the model length
    priority: int = 0
    parent_id: str = ""
    index: int = 0  # which of the parent's n samples
    # A sibling whose prompt blocks this request shares: not scheduled before that one's prompt is
    # computed, so the prefix cache (not a second prefill) serves it.
    waits_for: Request | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # sampling_params.prompt_logprobs: the entries of prompt tokens 1.. as their prefill chunks ran,
    # handed out once, on the first delta after the prompt is computed.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    has_sent_prompt_logprobs: bool = False
    stop_reason: int | str | None = None
    is_padding: bool = False  # static batching: finished, but its row is kept until the batch ends
    # Hashes of the full blocks of token_ids, computed incrementally (prefix caching).
    block_hashes: list[int] = field(default_factory=list)
    ngram_index: NgramIndex | None = None  # speculative decoding's lookup table, built on first use
    wait: WaitRecord = field(default_factory=WaitRecord)  # its steps without a row (wait_ledger.py)
    grammar: OutputGrammar | None = None  # sampling_params.structured_outputs, set by the engine
    metrics: RequestMetrics = field(init=False)
    deadline_time: float | None = field(init=False)  # time.monotonic() it must be done by, if any

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        self.token_ids = list(self.prompt_token_ids)
        self.parent_id = self.parent_id or self.request_id
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        deadline_ms = self.sampling_params.deadline_ms
        self.deadline_time = None if deadline_ms is None else self.arrival_time + deadline_ms / 1e3

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_prompt_computed(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and some prompt positions are not scored yet."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    def take_prompt_logprobs(self) -> tuple[TokenLogprobs | None, ...] | None:
        """The prompt logprobs (None for the first token) once they are complete; None before, and after."""
        if (self.sampling_params.prompt_logprobs is None or self.has_sent_prompt_logprobs
                or self.needs_prompt_logprobs):
            return None
        self.has_sent_prompt_logprobs = True
        return (None, *self.prompt_logprobs)

    def is_past_deadline(self, now: float) -> bool:
        return self.deadline_time is not None and now >= self.deadline_time

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None, now: float) -> None:
        """Record one sampled token (called only from Scheduler.update)."""
        self.token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept_token(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status the last appended token causes, if any."""
        token = self.token_ids[-1]
        past_min = self.num_output_tokens >= self.sampling_params.min_tokens
        if past_min and token in self.sampling_params.stop_token_ids:
            self.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if past_min and not self.sampling_params.ignore_eos and token in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if self.grammar is not None and self.grammar.is_terminated:  # complete: nothing more may follow
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
