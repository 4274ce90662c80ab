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
                                     ChatTokenLogprob, ChatTool, DeltaMessage, TopLogprob)
from cobatch.server.generation import ChoiceUpdate, choice_updates
from cobatch.server.streaming import (DONE, engine_failure, error_event, run_until_disconnect, sse,
                                      sse_headers)
from cobatch.server.tool_format import template_inputs
from cobatch.server.tool_parsers import ToolCallExtractor, assemble_calls
from cobatch.server.tool_request import ToolPlan, plan_tools


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest,
                                 raw: Request) -> ChatCompletionResponse | StreamingResponse:
    """Validate, render the template, submit, and answer (SSE stream or one JSON body)."""
    ctx.check_available()
    ctx.check_model(req.model)
    _check_unsupported(req)
    plan = plan_tools(req)
    prompt_ids = render_messages(ctx, req.messages, req.add_generation_prompt, list(plan.tools))
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = plan.constrain(ctx.sampling_params(req, req.max_completion_tokens or req.max_tokens,
                                                logprobs, raw.headers))
    sub = await ctx.submit("chatcmpl", prompt_ids, params, req.priority, req.user)
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        return StreamingResponse(_stream(ctx, sub, include_usage, plan),
                                 headers=sse_headers(sub.request_id), media_type="text/event-stream")
    return await run_until_disconnect(raw, _collect(ctx, sub, plan))


def _check_unsupported(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")


def render_messages(ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool,
                    tools: list[ChatTool] | None = None) -> list[int]:
    """Messages (and tools) -> prompt token ids through the model's chat template; 400 if it refuses."""
    plain, specs = template_inputs(messages, tools or [], ctx.template_has_tools)
    try:
        return ctx.tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt,
                                                 tools=specs)
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


def _final_reason(finish_reason: str | None, has_calls: bool) -> str | None:
    """A message with tool calls that ended naturally finishes with "tool_calls"."""
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason


def _message(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
    """The whole output as a message: content, and the tool calls read from it."""
    extractor = plan.extractor()
    if extractor is None:
        return AssistantMessage(content=text), finish_reason
    events = extractor.feed(text)
    events.extend(extractor.finish())
    calls = assemble_calls(events.calls)
    if not calls:
        return AssistantMessage(content=events.content), finish_reason
    return (AssistantMessage(content=events.content or None, tool_calls=calls),
            _final_reason(finish_reason, True))


async def _collect(ctx: ServingContext, sub: Submission, plan: ToolPlan) -> ChatCompletionResponse:
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
    messages = [_message(plan, texts[i], finish[i][0]) for i in range(n)]
    choices = [ChatChoice(index=i, message=messages[i][0], logprobs=logprobs[i],
                          finish_reason=messages[i][1], stop_reason=finish[i][1]) for i in range(n)]
    return ChatCompletionResponse(id=sub.request_id, model=ctx.settings.served_model_name,
                                  choices=choices, usage=sub.tracker.usage())


def _delta(extractor: ToolCallExtractor | None, update: ChoiceUpdate) -> tuple[DeltaMessage, str | None]:
    """What one update adds to a streamed choice: content and tool-call pieces, its finish reason."""
    if extractor is None:
        return DeltaMessage(content=update.text or None), update.finish_reason
    events = extractor.feed(update.text)
    if update.finish_reason is not None:
        events.extend(extractor.finish())
    delta = DeltaMessage(content=events.content or None, tool_calls=events.calls or None)
    return delta, _final_reason(update.finish_reason, extractor.num_calls > 0)


async def _stream(ctx: ServingContext, sub: Submission, include_usage: bool,
                  plan: ToolPlan) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[ChatChunkChoice], usage: object = None) -> str:
        return sse(ChatCompletionChunk(id=sub.request_id, created=created,
                                       model=ctx.settings.served_model_name, choices=choices,
                                       usage=usage))  # type: ignore[arg-type]

    wants_logprobs = sub.tracker.params.logprobs is not None
    skip = sub.tracker.params.skip_special_tokens
    extractors = [plan.extractor() for _ in range(sub.tracker.params.n)]
    # OpenAI's first chunk of each choice carries the role (and empty content).
    for i in range(sub.tracker.params.n):
        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
    try:
        async with aclosing(choice_updates(ctx.async_engine, sub.request_id, sub.stream,
                                           sub.tracker)) as updates:
            async for update in updates:
                lp = _chat_logprobs(ctx, update.logprobs, skip) if wants_logprobs else None
                delta, finish_reason = _delta(extractors[update.index], update)
                if not (delta.content or delta.tool_calls or finish_reason or (lp and lp.content)):
                    continue
                yield chunk([ChatChunkChoice(index=update.index, delta=delta, logprobs=lp,
                                             finish_reason=finish_reason,
                                             stop_reason=update.stop_reason)])
        if include_usage:
            yield chunk([], sub.tracker.usage())
    except (RequestFailedError, EngineDeadError) as exc:
        yield error_event(exc)
    yield DONE
