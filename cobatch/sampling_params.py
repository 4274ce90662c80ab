"""Per-request sampling parameters (frozen, validated at construction)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from typing import Any


def _check_finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")


def _canonical_json_schema(schema: str | dict[str, Any]) -> str:
    """One compact JSON text per schema (key order kept: it is the order the output's keys follow)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}")
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's names); exactly one of the five is set.

    `json`: a JSON schema (dict or JSON text; stored as compact JSON text so the object stays hashable);
    `regex`: the whole output matches it; `choice`: the output is one of these strings; `grammar`: a
    context-free grammar, in Lark (llguidance's dialect) or GBNF (llama.cpp's), told apart by the text
    (docs/SERVER.md "Structured outputs"); `json_object`: any JSON object. `disable_any_whitespace`:
    JSON without free whitespace between tokens; `disable_additional_properties`: objects in `json`
    carry only their declared properties unless the schema itself allows more (OpenAI's strict mode);
    `lenient`: JSON-schema keywords the backend does not implement are ignored instead of refused;
    `whitespace_pattern`: a regex for the whitespace JSON may put between its tokens (None: one
    optional newline and up to 32 spaces or tabs, so a sampled output cannot wander off in blanks).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    lenient: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if self.json is not None:
            object.__setattr__(self, "json", _canonical_json_schema(self.json))
        if self.choice is not None:
            if isinstance(self.choice, str):
                raise ValueError("structured_outputs.choice must be a list of strings, got one string")
            object.__setattr__(self, "choice", tuple(self.choice))
        self._validate()

    def _validate(self) -> None:
        num_set = sum(getattr(self, k) not in (None, False) for k in _CONSTRAINT_KINDS)
        if num_set != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, "
                             f"json_object; got {num_set}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c
                                                                   for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        """Which constraint is set: json, regex, choice, grammar or json_object."""
        return next(k for k in _CONSTRAINT_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[Any, ...]:
        """A hashable key for the compiled grammar: every field (the compile depends on all of them)."""
        return tuple(getattr(self, f.name) for f in fields(self))


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
    # Number of top log-probabilities per prompt position (the first position has none), computed
    # in the prefill (vLLM's prompt_logprobs). 0: only the prompt token's own logprob.
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    skip_special_tokens: bool = True
    # End the request this long after its arrival, with finish_reason "deadline" (a stop condition
    # like max_tokens: its deltas so far stand). Relative, so it crosses processes (Ray replicas).
    deadline_ms: float | None = None
    # Constrain the output to a JSON schema, regex, choice or grammar (None: unconstrained).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**self.structured_outputs))
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
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
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
        """Params for the index-th of n parallel samples: n=1, and a distinct derived seed.

        The prompt is the same for all n: only sample 0 computes its prompt logprobs (the others
        then read the prompt from the prefix cache)."""
        seed = None if self.seed is None else self.seed + index
        prompt_logprobs = self.prompt_logprobs if index == 0 else None
        return replace(self, n=1, seed=seed, prompt_logprobs=prompt_logprobs)

