"""The front door shared by every generation endpoint: state, model name, inputs, queue bound, submit.

Every check happens before a response starts, so a streaming request gets a real status code too.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from cobatch.async_engine import EngineDeadError, EngineState
from cobatch.sampling_params import SamplingParams
from cobatch.server.engine_client import (DeadlineUnreachableError, EngineClient,
                                          EngineOverloadedError, OutputStream)
from cobatch.server.errors import APIError, bad_request
from cobatch.server.generation import GenerationTracker
from cobatch.server.protocol import MAX_STOP_STRINGS, _SamplingRequest
from cobatch.server.settings import ServerSettings
from cobatch.server.structured_request import structured_outputs_of
from cobatch.server.tool_format import template_supports_tools
from cobatch.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_LOG_FIELD_MAX = 120
_LOG_PARAMS_MAX = 1000  # a request's whole SamplingParams, at debug level
DEADLINE_HEADER = "x-cobatch-deadline-ms"  # for gateways that impose a deadline without touching bodies


def escape_for_log(value: object, limit: int = _LOG_FIELD_MAX) -> str:
    """A client-supplied value made safe for one log line: control characters escaped, truncated."""
    text = str(value)
    escaped = text.encode("unicode_escape", errors="backslashreplace").decode("ascii")
    return escaped if len(escaped) <= limit else escaped[:limit] + "..."


@dataclass(slots=True)
class Submission:
    """An admitted request: its id, its output stream and the tracker that turns deltas into text."""

    request_id: str
    stream: OutputStream
    tracker: GenerationTracker


@dataclass(slots=True)
class ServingContext:
    """What the handlers share: the engine, the tokenizer, the settings, a token-text cache."""

    async_engine: EngineClient
    tokenizer: Tokenizer
    settings: ServerSettings
    _token_text: dict[tuple[int, bool], str] = field(default_factory=dict)
    # Whether the chat template renders `tools` itself (else tool_format writes them in the text).
    template_has_tools: bool = field(init=False)

    def __post_init__(self) -> None:
        self.template_has_tools = template_supports_tools(self.tokenizer)

    # ---- checks -----------------------------------------------------------------------------------

    def check_available(self) -> None:
        """503 while the engine starts, drains, has stopped or died."""
        state = self.async_engine.state
        if state == EngineState.READY:
            return
        reason = {EngineState.STARTING: "the model is still loading",
                  EngineState.DRAINING: "the server is shutting down",
                  EngineState.STOPPED: "the server is shutting down",
                  EngineState.DEAD: "the engine has failed; the server is restarting"}[state]
        raise APIError(503, reason, code="service_unavailable", headers={"Retry-After": "5"})

    def check_model(self, model: str | None) -> None:
        """404 for a model name this server does not serve (None means the served one)."""
        if model is not None and model != self.settings.served_model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                           f"{self.settings.served_model_name!r}", param="model",
                           code="model_not_found")

    @property
    def vocab_size(self) -> int:
        """Valid token ids are below this (the smaller of the model's and the tokenizer's)."""
        info = self.async_engine.info
        model_vocab = info.vocab_size if info is not None and info.vocab_size else None
        return min(self.tokenizer.vocab_size, model_vocab or self.tokenizer.vocab_size)

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """400 for token ids outside the vocabulary."""
        vocab = self.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of the vocabulary [0, {vocab})", param)

    def check_queue(self, num_new: int = 1) -> None:
        """429 + Retry-After when the waiting queue has no room for `num_new` more requests."""
        bound = self.settings.max_queued_requests
        if bound is not None and self.async_engine.num_queued_requests + num_new > bound:
            raise overloaded(f"the server is overloaded: {bound} requests are already waiting; "
                             "retry later", self.settings.retry_after_s)

    # ---- building --------------------------------------------------------------------------------

    def sampling_params(self, req: _SamplingRequest, max_tokens: int | None, logprobs: int | None,
                        headers: Mapping[str, str]) -> SamplingParams:
        """SamplingParams from the request's fields (and deadline header); 400 on anything invalid."""
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are supported", "stop")
        stop_token_ids = list(req.stop_token_ids or [])
        self.check_token_ids(stop_token_ids, "stop_token_ids")
        try:
            return SamplingParams(
                n=req.n, temperature=_or(req.temperature, 1.0), top_p=_or(req.top_p, 1.0),
                top_k=_or(req.top_k, 0), min_p=_or(req.min_p, 0.0),
                presence_penalty=_or(req.presence_penalty, 0.0),
                frequency_penalty=_or(req.frequency_penalty, 0.0),
                repetition_penalty=_or(req.repetition_penalty, 1.0), seed=req.seed,
                stop=tuple(stop), stop_token_ids=tuple(stop_token_ids),
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos, max_tokens=max_tokens, min_tokens=req.min_tokens,
                logprobs=logprobs, logit_bias=self._logit_bias(req.logit_bias),
                skip_special_tokens=req.skip_special_tokens,
                deadline_ms=request_deadline_ms(req.deadline_ms, headers),
                structured_outputs=structured_outputs_of(req))
        except ValueError as exc:
            raise bad_request(str(exc), sampling_error_param(str(exc))) from exc

    def _logit_bias(self, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        """String keys -> token ids in the vocabulary; the values are SamplingParams' to check."""
        items = []
        for key, value in (bias or {}).items():
            try:
                token_id = int(key)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {escape_for_log(key)!r}",
                                  "logit_bias") from None
            self.check_token_ids([token_id], "logit_bias")
            items.append((token_id, value))
        return tuple(items)

    def token_text(self, token_id: int, skip_special_tokens: bool = False) -> str:
        """A token's own text (for logprobs), cached; a special token is "" where `text` skips it too."""
        key = (token_id, skip_special_tokens)
        text = self._token_text.get(key)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=skip_special_tokens)
            self._token_text[key] = text
        return text

    # ---- submit ----------------------------------------------------------------------------------

    async def submit(self, prefix: str, prompt_token_ids: list[int], params: SamplingParams,
                     priority: int, user: str | None) -> Submission:
        """Length check, queue bound, then hand the request to the engine (joins its next step)."""
        return (await self.submit_all(prefix, [prompt_token_ids], params, priority, user))[0]

    async def submit_all(self, prefix: str, prompts: list[list[int]], params: SamplingParams,
                         priority: int, user: str | None) -> list[Submission]:
        """Every prompt checked first (a 400 naming the bad one: nothing runs), then each submitted as
        its own request, all handed to the engine at once (AsyncEngine.joined): they join one step."""
        self.check_available()
        for index, prompt_token_ids in enumerate(prompts):
            self._check_prompt(prompt_token_ids, params, f"prompt {index} of {len(prompts)}: "
                               if len(prompts) > 1 else "")
        self.check_queue(len(prompts))
        submissions: list[Submission] = []
        try:
            with self.async_engine.joined():
                for prompt_token_ids in prompts:
                    submissions.append(await self._submit_checked(prefix, prompt_token_ids, params, priority,
                                                                  user))
        except BaseException:
            for sub in submissions:  # a later one was refused (a routed engine): none of them runs
                self.async_engine.abort(sub.request_id)
            raise
        return submissions

    def _check_prompt(self, prompt_token_ids: list[int], params: SamplingParams, which: str) -> None:
        try:
            self.check_token_ids(prompt_token_ids, "prompt")
            self.async_engine.validate(prompt_token_ids, params)
        except APIError as exc:
            raise bad_request(which + exc.message, "prompt") from exc
        except ValueError as exc:
            raise bad_request(which + str(exc), "max_tokens" if prompt_token_ids else "prompt") from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="service_unavailable") from exc

    async def _submit_checked(self, prefix: str, prompt_token_ids: list[int], params: SamplingParams,
                              priority: int, user: str | None) -> Submission:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            stream = await self.async_engine.submit(request_id, prompt_token_ids, params, priority)
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="service_unavailable") from exc
        except EngineOverloadedError as exc:  # a routed engine: every replica's queue is full
            raise overloaded(str(exc), exc.retry_after_s) from exc
        except DeadlineUnreachableError as exc:  # refused before any prefill
            # 429, not 5xx: load shedding the client's own deadline asked for, not a server fault
            # (5xx stays "something broke" for dashboards and the hostile-input test).
            raise APIError(429, str(exc), param="deadline_ms", code="deadline_unreachable") from exc
        logger.info("request %s: %d prompt tokens, n=%d, max_tokens=%s, user=%s", request_id,
                    len(prompt_token_ids), params.n, params.max_tokens,
                    escape_for_log(user) if user else "-")
        logger.debug("request %s: %s", request_id, escape_for_log(params, limit=_LOG_PARAMS_MAX))
        tracker = GenerationTracker(self.async_engine, self.tokenizer, prompt_token_ids, params)
        return Submission(request_id, stream, tracker)


def overloaded(message: str, retry_after_s: int) -> APIError:
    """The 429 + Retry-After of a full queue."""
    return APIError(429, message, code="rate_limit_exceeded",
                    headers={"Retry-After": str(retry_after_s)})


def request_deadline_ms(body_ms: float | None, headers: Mapping[str, str]) -> float | None:
    """The request's deadline: the tighter of the body's deadline_ms and the header (400 if it is bad)."""
    value = headers.get(DEADLINE_HEADER)
    if value is None:
        return body_ms
    try:
        header_ms = float(value)
    except ValueError:
        header_ms = math.nan
    if not (math.isfinite(header_ms) and header_ms > 0):
        raise bad_request(f"the {DEADLINE_HEADER} header must be a positive number of milliseconds, "
                          f"got {escape_for_log(value)!r}", DEADLINE_HEADER)
    return header_ms if body_ms is None else min(body_ms, header_ms)


def _or(value: float | int | None, default: float | int) -> float | int:
    return default if value is None else value


_SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__)


def sampling_error_param(message: str) -> str | None:
    """The request field a SamplingParams error names: its messages start with the field's name."""
    name = message.split(" ", 1)[0]
    return name if name in _SAMPLING_FIELDS else None
