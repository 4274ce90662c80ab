"""POST /v1/chat/completions: messages through the chat template, n assistant replies out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi.responses import StreamingResponse
from starlette.requests import Request

from cobatch.async_engine import EngineDeadError, RequestFailedError
from cobatch.scheduler_output import TokenLogprobs
from cobatch.server.errors import bad_request
from cobatch.server.frontdoor import ServingContext, Submission
from cobatch.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice,
                                     ChatCompletionChunk, ChatCompletionRequest,
                                     ChatCompletionResponse, ChatLogprobs, ChatMessage,
                                     ChatTokenLogprob, DeltaMessage, TopLogprob)
from cobatch.server.generation import choice_updates
from cobatch.server.streaming import (DONE, engine_failure, error_event, run_until_disconnect, sse,
                                      sse_headers)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest,
                                 raw: Request) -> ChatCompletionResponse | StreamingResponse:
    """Validate, render the template, submit, and answer (SSE stream or one JSON body)."""
    ctx.check_available()
    ctx.check_model(req.model)
    _check_unsupported(req)
    prompt_ids = render_messages(ctx, req.messages, req.add_generation_prompt)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = ctx.sampling_params(req, req.max_completion_tokens or req.max_tokens, logprobs,
                                 raw.headers)
    sub = await ctx.submit("chatcmpl", prompt_ids, params, req.priority, req.user)
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return StreamingResponse(_stream(ctx, sub, include_usage),
                                 headers=sse_headers(sub.request_id), media_type="text/event-stream")
    return await run_until_disconnect(raw, _collect(ctx, sub))


def _check_unsupported(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
    if req.tools:
        raise bad_request("tools (function calling) are not supported", "tools")
    if req.tool_choice not in (None, "none", "auto"):
        raise bad_request("tool_choice is not supported", "tool_choice")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")


def render_messages(ctx: ServingContext, messages: list[ChatMessage],
                    add_generation_prompt: bool) -> list[int]:
    """Messages -> prompt token ids through the model's chat template; 400 if it refuses them."""
    plain = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
             for m in messages]
    try:
        return ctx.tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # noqa: BLE001 - a template's own error (e.g. role order) is bad input
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from exc


def _top(ctx: ServingContext, token_id: int, logprob: float, skip_special_tokens: bool) -> TopLogprob:
    text = ctx.token_text(token_id, skip_special_tokens)  # "" for a special token `content` skips too
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))


def _chat_logprobs(ctx: ServingContext, entries: tuple[TokenLogprobs, ...],
                   skip_special_tokens: bool) -> ChatLogprobs:
    content = []
    for entry in entries:
        top = _top(ctx, entry.token_id, entry.logprob, skip_special_tokens)
        content.append(ChatTokenLogprob(token=top.token, logprob=top.logprob, bytes=top.bytes,
                                        top_logprobs=[_top(ctx, t, lp, skip_special_tokens)
                                                      for t, lp in entry.top]))
    return ChatLogprobs(content=content)


async def _collect(ctx: ServingContext, sub: Submission) -> ChatCompletionResponse:
    n = sub.tracker.params.n
    wants_logprobs = sub.tracker.params.logprobs is not None
    skip = sub.tracker.params.skip_special_tokens
    texts = [""] * n
    logprobs = [ChatLogprobs(content=[]) if wants_logprobs else None for _ in range(n)]
    finish: list[tuple[str | None, int | str | None]] = [(None, None)] * n
    try:
        async with aclosing(choice_updates(ctx.async_engine, sub.request_id, sub.stream,
                                           sub.tracker)) as updates:
            async for update in updates:
                texts[update.index] += update.text
                target = logprobs[update.index]
                if target is not None and target.content is not None:
                    target.content += _chat_logprobs(ctx, update.logprobs, skip).content or []
                if update.finish_reason is not None:
                    finish[update.index] = (update.finish_reason, update.stop_reason)
    except (RequestFailedError, EngineDeadError) as exc:
        raise engine_failure(exc) from exc
    choices = [ChatChoice(index=i, message=AssistantMessage(content=texts[i]), logprobs=logprobs[i],
                          finish_reason=finish[i][0], stop_reason=finish[i][1]) for i in range(n)]
    return ChatCompletionResponse(id=sub.request_id, model=ctx.settings.served_model_name,
                                  choices=choices, usage=sub.tracker.usage())


async def _stream(ctx: ServingContext, sub: Submission, include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[ChatChunkChoice], usage: object = None) -> str:
        return sse(ChatCompletionChunk(id=sub.request_id, created=created,
                                       model=ctx.settings.served_model_name, choices=choices,
                                       usage=usage))  # type: ignore[arg-type]

    wants_logprobs = sub.tracker.params.logprobs is not None
    skip = sub.tracker.params.skip_special_tokens
    # OpenAI's first chunk of each choice carries the role (and empty content).
    for i in range(sub.tracker.params.n):
        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
    try:
        async with aclosing(choice_updates(ctx.async_engine, sub.request_id, sub.stream,
                                           sub.tracker)) as updates:
            async for update in updates:
                lp = _chat_logprobs(ctx, update.logprobs, skip) if wants_logprobs else None
                if not (update.text or update.finish_reason or (lp and lp.content)):
                    continue
                yield chunk([ChatChunkChoice(
                    index=update.index, delta=DeltaMessage(content=update.text or None),
                    logprobs=lp, finish_reason=update.finish_reason,
                    stop_reason=update.stop_reason)])
        if include_usage:
            yield chunk([], sub.tracker.usage())
    except (RequestFailedError, EngineDeadError) as exc:
        yield error_event(exc)
    yield DONE
