"""What the engine hands out about a request: per-step deltas, its timings, and the offline results.

Contracts (plain data, no torch): the scheduler emits `RequestDelta`s, the server streams them, the
offline facade (`LLM`) folds them into `RequestOutput`s. None of them needs `request.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cobatch.scheduler_output import TokenLogprobs
from cobatch.wait_reasons import PreemptionChoice


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (time.monotonic seconds) and counters of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_swaps: int = 0
    num_recomputed_tokens: int = 0  # tokens computed again after a recompute preemption
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Filled when it finishes: its steps without a row by reason, and its latest preemptions.
    wait_steps: dict[str, int] = field(default_factory=dict)
    preemptions: tuple[PreemptionChoice, ...] = ()


@dataclass(frozen=True, slots=True)
class RequestDelta:
    """What one step added to one sequence: new tokens, and the finish if it finished."""

    request_id: str
    parent_id: str
    index: int
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprobs, ...]
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    metrics: RequestMetrics | None = None  # a copy, on the finishing delta only
    error: str | None = None
    # sampling_params.prompt_logprobs: one entry per prompt token (None for the first), once, on the
    # first delta after the prompt was computed (the one with the first token).
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's n samples."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class RequestOutput:
    """The result of one prompt: its n completions and the request's timings."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics | None = None
    finished: bool = False
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with sampling_params.prompt_logprobs
