"""Per-request sampling parameters (frozen, validated at construction)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


def _check_finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop, for one request (vLLM's field names)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # number of top log-probabilities per generated token
    logit_bias: tuple[tuple[int, float], ...] = ()
    skip_special_tokens: bool = True
    # End the request this long after its arrival, with finish_reason "deadline" (a stop condition
    # like max_tokens: its deltas so far stand). Relative, so it crosses processes (Ray replicas).
    deadline_ms: float | None = None

    def __post_init__(self) -> None:
        # Accept lists/dicts/str from callers but store hashable tuples (the object is frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(k), float(v)) for k, v in bias))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            _check_finite(name, getattr(self, name))
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.deadline_ms is not None and not (math.isfinite(self.deadline_ms) and self.deadline_ms > 0):
            raise ValueError(f"deadline_ms must be a positive number of milliseconds, got {self.deadline_ms}")
        for _, bias in self.logit_bias:
            _check_finite("logit_bias value", bias)
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def for_sample(self, index: int) -> SamplingParams:
        """Params for the index-th of n parallel samples: n=1, and a distinct derived seed."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)

