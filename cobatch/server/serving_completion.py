"""POST /v1/completions: one prompt or a list (text or token ids), n continuations each, streamed or not.

Every prompt of a list is its own engine request, all checked before any is submitted (one bad
prompt is a 400 and nothing runs) and submitted together; choice `i * n + j` is sample j of prompt i.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field, replace

from fastapi.responses import StreamingResponse
from starlette.requests import Request

from cobatch.async_engine import EngineDeadError, RequestFailedError
from cobatch.sampling_params import SamplingParams
from cobatch.scheduler_output import TokenLogprobs
from cobatch.server.errors import bad_request
from cobatch.server.frontdoor import ServingContext, Submission
from cobatch.server.generation import ChoiceUpdate
from cobatch.server.multiplex import merged_updates
from cobatch.server.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                     CompletionResponse, PromptLogprob, PromptTokensDetails, Usage)
from cobatch.server.streaming import (DONE, engine_failure, error_event, run_until_disconnect, sse,
                                      sse_headers)

_MIN_LOGPROB = -9999.0  # what OpenAI sends for -inf (JSON has no infinity)


@dataclass(slots=True)
class _Prompt:
    """One prompt of the request: its token ids and the text echo returns."""

    token_ids: list[int]
    text: str | None  # None: token ids, decoded for echo once every prompt passed the checks


@dataclass(slots=True)
class _Choice:
    """One choice being assembled (non-stream) or tracked for text offsets (stream)."""

    index: int
    text: str = ""
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_offset: int = 0
    has_echoed: bool = False


@dataclass(slots=True)
class _Completion:
    """The request's prompts, their submissions, and every choice (prompt index * n + sample index)."""

    ctx: ServingContext
    prompts: list[_Prompt]
    subs: list[Submission]
    echo: bool
    params: SamplingParams
    choices: list[_Choice] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.choices = [_Choice(i) for i in range(len(self.prompts) * self.params.n)]

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs is not None

    def apply(self, prompt_index: int, update: ChoiceUpdate) -> CompletionChoice:
        """Fold an update into its choice; return the chunk-sized piece it adds (echo first)."""
        choice = self.choices[prompt_index * self.params.n + update.index]
        piece = CompletionLogprobs() if self.wants_logprobs else None
        text = update.text
        if self.echo and not choice.has_echoed:
            echo = self.prompts[prompt_index].text or ""
            text, choice.has_echoed = echo + text, True
            if piece is not None:
                self._add_prompt(piece, choice, prompt_index)
            choice.text_offset = len(echo)
        if piece is not None:
            skip = self.params.skip_special_tokens
            for entry in update.logprobs:
                _append(self.ctx, piece, choice, entry.token_id, entry, skip)
        choice.text += text
        choice.finish_reason, choice.stop_reason = update.finish_reason, update.stop_reason
        return CompletionChoice(index=choice.index, text=text, logprobs=piece,
                                finish_reason=update.finish_reason, stop_reason=update.stop_reason)

    def _add_prompt(self, piece: CompletionLogprobs, choice: _Choice, prompt_index: int) -> None:
        """The echoed prompt's tokens: null for the first, then their prompt logprobs."""
        token_ids = self.prompts[prompt_index].token_ids
        entries = self.subs[prompt_index].tracker.prompt_logprobs or (None,) * len(token_ids)
        for token_id, entry in zip(token_ids, entries):
            _append(self.ctx, piece, choice, token_id, entry, False)  # the prompt as the model saw it

    def usage(self) -> Usage:
        """Summed over every prompt (each prompt counted once, its completions over all n)."""
        parts = [sub.tracker.usage() for sub in self.subs]
        prompt = sum(u.prompt_tokens for u in parts)
        completion = sum(u.completion_tokens for u in parts)
        cached = sum(u.prompt_tokens_details.cached_tokens for u in parts if u.prompt_tokens_details is not None)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def prompt_logprobs(self, prompt_index: int) -> list[dict[int, PromptLogprob] | None] | None:
        """vLLM's choices[i].prompt_logprobs (the prompt_logprobs extension), else None."""
        entries = self.subs[prompt_index].tracker.prompt_logprobs
        if entries is None:
            return None
        return [None if e is None else _vllm_logprobs(self.ctx, e) for e in entries]


async def create_completion(ctx: ServingContext, req: CompletionRequest,
                            raw: Request) -> CompletionResponse | StreamingResponse:
    """Validate, submit every prompt, and answer (SSE stream or one JSON body)."""
    ctx.check_available()
    ctx.check_model(req.model)
    _check_unsupported(req)
    prompts = _prompts(ctx, req)
    params = ctx.sampling_params(req, req.max_tokens, req.logprobs, raw.headers)
    params = replace(params, prompt_logprobs=_num_prompt_logprobs(req))
    subs = await ctx.submit_all("cmpl", [p.token_ids for p in prompts], params, req.priority, req.user)
    for p in prompts:
        if p.text is None:  # the prompt as the model sees it, special tokens included (as vLLM echoes)
            p.text = ctx.tokenizer.decode(p.token_ids, skip_special_tokens=False) if req.echo else ""
    job = _Completion(ctx, prompts, subs, req.echo, params)
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return StreamingResponse(_stream(job, include_usage), headers=sse_headers(subs[0].request_id),
                                 media_type="text/event-stream")
    return await run_until_disconnect(raw, _collect(job, req.prompt_logprobs is not None))


def _check_unsupported(req: CompletionRequest) -> None:
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (beam search / best-of sampling is not supported)",
                          "best_of")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    if req.prompt_logprobs is not None and req.stream:  # as vLLM: they have no place in a chunk
        raise bad_request("prompt_logprobs is not available with stream=true (use echo with logprobs)",
                          "prompt_logprobs")


def _num_prompt_logprobs(req: CompletionRequest) -> int | None:
    """What the engine computes: the extension's count, and echo's logprobs (OpenAI's echo + logprobs)."""
    wanted = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
    return max(wanted) if wanted else None


def _prompts(ctx: ServingContext, req: CompletionRequest) -> list[_Prompt]:
    """OpenAI's four forms: a string, a list of strings, a list of token ids, a list of token-id lists."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [_Prompt(ctx.tokenizer.encode(prompt), prompt)]
    if not prompt:
        raise bad_request("the prompt list is empty", "prompt")
    if isinstance(prompt[0], int):
        return [_Prompt([int(t) for t in prompt], None)]  # type: ignore[union-attr]
    if isinstance(prompt[0], str):
        return [_Prompt(ctx.tokenizer.encode(text), text) for text in prompt]  # type: ignore[union-attr]
    return [_Prompt([int(t) for t in ids], None) for ids in prompt]  # type: ignore[union-attr]


def _append(ctx: ServingContext, target: CompletionLogprobs, choice: _Choice, token_id: int,
            entry: TokenLogprobs | None, skip_special_tokens: bool) -> None:
    """One token in the legacy completions shape: its top_logprobs are the top k and the token itself."""
    token = ctx.token_text(token_id, skip_special_tokens)
    target.tokens.append(token)
    target.text_offset.append(choice.text_offset)
    choice.text_offset += len(token)
    if entry is None:  # the prompt's first token: nothing scores it
        target.token_logprobs.append(None)
        target.top_logprobs.append(None)
        return
    top = {ctx.token_text(t, skip_special_tokens): max(lp, _MIN_LOGPROB) for t, lp in entry.top}
    top.setdefault(token, max(entry.logprob, _MIN_LOGPROB))
    target.token_logprobs.append(max(entry.logprob, _MIN_LOGPROB))
    target.top_logprobs.append(top)


def _vllm_logprobs(ctx: ServingContext, entry: TokenLogprobs) -> dict[int, PromptLogprob]:
    """vLLM's {token id: Logprob} at one prompt position: the top k, and the prompt's own token."""
    out = {t: PromptLogprob(logprob=max(lp, _MIN_LOGPROB), rank=rank, decoded_token=ctx.token_text(t))
           for rank, (t, lp) in enumerate(entry.top, start=1)}
    out.setdefault(entry.token_id, PromptLogprob(logprob=max(entry.logprob, _MIN_LOGPROB), rank=entry.rank,
                                                 decoded_token=ctx.token_text(entry.token_id)))
    return out


async def _collect(job: _Completion, with_prompt_logprobs: bool) -> CompletionResponse:
    totals = [CompletionLogprobs() if job.wants_logprobs else None for _ in job.choices]
    try:
        async with aclosing(merged_updates(job.ctx.async_engine, job.subs)) as updates:
            async for prompt_index, update in updates:
                piece = job.apply(prompt_index, update)
                _extend(totals[piece.index], piece.logprobs)
    except (RequestFailedError, EngineDeadError) as exc:
        raise engine_failure(exc) from exc
    n = job.params.n
    choices = [CompletionChoice(index=c.index, text=c.text, logprobs=totals[c.index],
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                prompt_logprobs=job.prompt_logprobs(c.index // n) if with_prompt_logprobs else None)
               for c in job.choices]
    return CompletionResponse(id=job.subs[0].request_id, model=job.ctx.settings.served_model_name,
                              usage=job.usage(), choices=choices)


def _extend(total: CompletionLogprobs | None, piece: CompletionLogprobs | None) -> None:
    if total is None or piece is None:
        return
    total.tokens += piece.tokens
    total.token_logprobs += piece.token_logprobs
    total.top_logprobs += piece.top_logprobs
    total.text_offset += piece.text_offset


async def _stream(job: _Completion, include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())
    request_id, model = job.subs[0].request_id, job.ctx.settings.served_model_name

    def chunk(choices: Sequence[CompletionChoice], usage: Usage | None = None) -> str:
        return sse(CompletionResponse(id=request_id, created=created, model=model, choices=list(choices),
                                      usage=usage))

    try:
        async with aclosing(merged_updates(job.ctx.async_engine, job.subs)) as updates:
            async for prompt_index, update in updates:
                piece = job.apply(prompt_index, update)
                if piece.text or piece.finish_reason or (piece.logprobs and piece.logprobs.tokens):
                    yield chunk([piece])
        if include_usage:
            yield chunk([], job.usage())
    except (RequestFailedError, EngineDeadError) as exc:
        yield error_event(exc)
    yield DONE
