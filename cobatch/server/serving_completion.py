"""POST /v1/completions: a prompt (text or token ids) in, n continuations out, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi.responses import StreamingResponse
from starlette.requests import Request

from cobatch.async_engine import EngineDeadError, RequestFailedError
from cobatch.scheduler_output import TokenLogprobs
from cobatch.server.errors import bad_request
from cobatch.server.frontdoor import ServingContext, Submission
from cobatch.server.generation import ChoiceUpdate, choice_updates
from cobatch.server.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                     CompletionResponse)
from cobatch.server.streaming import (DONE, engine_failure, error_event, run_until_disconnect, sse,
                                      sse_headers)


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
    entries: list[TokenLogprobs] = field(default_factory=list)


async def create_completion(ctx: ServingContext, req: CompletionRequest,
                            raw: Request) -> CompletionResponse | StreamingResponse:
    """Validate, submit, and answer (SSE stream or one JSON body)."""
    ctx.check_available()
    ctx.check_model(req.model)
    _check_unsupported(req)
    prompt_ids, prompt_text = _prompt(ctx, req)
    params = ctx.sampling_params(req, req.max_tokens, req.logprobs, raw.headers)
    sub = await ctx.submit("cmpl", prompt_ids, params, req.priority, req.user)
    echo = prompt_text if req.echo else None
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return StreamingResponse(_stream(ctx, sub, echo, include_usage),
                                 headers=sse_headers(sub.request_id), media_type="text/event-stream")
    return await run_until_disconnect(raw, _collect(ctx, sub, echo))


def _check_unsupported(req: CompletionRequest) -> None:
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of must equal n (beam search / best-of sampling is not supported)",
                          "best_of")
    if req.echo and req.logprobs is not None:
        raise bad_request("echo with logprobs is not supported (no prompt logprobs)", "echo")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")


def _prompt(ctx: ServingContext, req: CompletionRequest) -> tuple[list[int], str]:
    """(prompt token ids, prompt text for echo); batches of prompts are refused."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise bad_request("batched prompts are not supported: send one prompt per request "
                              f"(got {len(prompt)})", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return ctx.tokenizer.encode(prompt), prompt
    ids = [int(t) for t in prompt]  # type: ignore[union-attr]
    ctx.check_token_ids(ids, "prompt")
    return ids, ctx.tokenizer.decode(ids) if req.echo else ""


def _add_logprobs(ctx: ServingContext, choice: _Choice, entries: tuple[TokenLogprobs, ...],
                  target: CompletionLogprobs) -> None:
    for entry in entries:
        token = ctx.token_text(entry.token_id)
        target.tokens.append(token)
        target.token_logprobs.append(entry.logprob)
        target.top_logprobs.append({ctx.token_text(t): lp for t, lp in entry.top} or None)
        target.text_offset.append(choice.text_offset)
        choice.text_offset += len(token)


def _apply(ctx: ServingContext, choice: _Choice, update: ChoiceUpdate, echo: str | None,
           wants_logprobs: bool) -> CompletionChoice:
    """Fold an update into `choice`; return the chunk-sized piece it adds."""
    text = update.text
    if echo is not None and not choice.has_echoed:
        text, choice.has_echoed = echo + text, True
        choice.text_offset = len(echo)
    piece = CompletionLogprobs() if wants_logprobs else None
    if piece is not None:
        _add_logprobs(ctx, choice, update.logprobs, piece)
    choice.text += text
    choice.finish_reason, choice.stop_reason = update.finish_reason, update.stop_reason
    return CompletionChoice(index=update.index, text=text, logprobs=piece,
                            finish_reason=update.finish_reason, stop_reason=update.stop_reason)


async def _collect(ctx: ServingContext, sub: Submission, echo: str | None) -> CompletionResponse:
    wants_logprobs = sub.tracker.params.logprobs is not None
    choices = [_Choice(i, logprobs=CompletionLogprobs() if wants_logprobs else None)
               for i in range(sub.tracker.params.n)]
    try:
        async with aclosing(choice_updates(ctx.async_engine, sub.request_id, sub.stream,
                                           sub.tracker)) as updates:
            async for update in updates:
                piece = _apply(ctx, choices[update.index], update, echo, wants_logprobs)
                _extend(choices[update.index].logprobs, piece.logprobs)
    except (RequestFailedError, EngineDeadError) as exc:
        raise engine_failure(exc) from exc
    return CompletionResponse(
        id=sub.request_id, model=ctx.settings.served_model_name, usage=sub.tracker.usage(),
        choices=[CompletionChoice(index=c.index, text=c.text, logprobs=c.logprobs,
                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                 for c in choices])


def _extend(total: CompletionLogprobs | None, piece: CompletionLogprobs | None) -> None:
    if total is None or piece is None:
        return
    total.tokens += piece.tokens
    total.token_logprobs += piece.token_logprobs
    total.top_logprobs += piece.top_logprobs
    total.text_offset += piece.text_offset


async def _stream(ctx: ServingContext, sub: Submission, echo: str | None,
                  include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())
    model = ctx.settings.served_model_name
    wants_logprobs = sub.tracker.params.logprobs is not None
    choices = [_Choice(i) for i in range(sub.tracker.params.n)]
    try:
        async with aclosing(choice_updates(ctx.async_engine, sub.request_id, sub.stream,
                                           sub.tracker)) as updates:
            async for update in updates:
                piece = _apply(ctx, choices[update.index], update, echo, wants_logprobs)
                if piece.text or piece.finish_reason or (piece.logprobs and piece.logprobs.tokens):
                    yield sse(CompletionResponse(id=sub.request_id, created=created, model=model,
                                                 choices=[piece]))
        if include_usage:
            yield sse(CompletionResponse(id=sub.request_id, created=created, model=model,
                                         choices=[], usage=sub.tracker.usage()))
    except (RequestFailedError, EngineDeadError) as exc:
        yield error_event(exc)
    yield DONE
