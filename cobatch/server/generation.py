"""Turning engine deltas into per-choice text: detokenize, stop strings, token counts, logprobs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from cobatch.outputs import RequestDelta
from cobatch.sampling_params import SamplingParams
from cobatch.scheduler_output import TokenLogprobs
from cobatch.server.engine_client import EngineClient, OutputStream
from cobatch.server.protocol import PromptTokensDetails, Usage
from cobatch.tokenizer import TextStream, Tokenizer


@dataclass(slots=True)
class ChoiceUpdate:
    """What one delta adds to one choice, after detokenizing and stop-string trimming."""

    index: int
    text: str
    num_tokens: int
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class GenerationTracker:
    """Per-request state: one text stream per choice, and the usage counts."""

    async_engine: EngineClient
    tokenizer: Tokenizer
    prompt_token_ids: list[int]
    params: SamplingParams
    streams: list[TextStream] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # per choice, up to its finish
    # With params.prompt_logprobs: one entry per prompt token (None first), from sample 0's first delta.
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    num_cached_tokens: int = 0  # of the prompt, served from the prefix cache (sample 0's: it reads the prompt first)

    def __post_init__(self) -> None:
        self.streams = [TextStream(self.tokenizer, self.params, self.prompt_token_ids)
                        for _ in range(self.params.n)]
        self.num_tokens = [0] * self.params.n

    def usage(self) -> Usage:
        """Prompt tokens once; completion tokens over all choices, up to each one's stop."""
        completion = sum(self.num_tokens)
        prompt = len(self.prompt_token_ids)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=self.num_cached_tokens))

    def update(self, delta: RequestDelta) -> ChoiceUpdate | None:
        """The choice update a delta makes; None once the choice has finished (on a stop string)."""
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.metrics is not None and delta.index == 0:
            self.num_cached_tokens = delta.metrics.num_cached_tokens
        stream = self.streams[delta.index]
        if stream.is_finished:
            return None  # tokens the engine made before our stop reached it: dropped
        self.num_tokens[delta.index] += len(delta.new_token_ids)
        text = stream.add(delta)
        if text.engine_stop is not None:
            self.async_engine.stop_sequence(delta.request_id, text.engine_stop)
        return ChoiceUpdate(delta.index, text.text, len(delta.new_token_ids),
                            tuple(delta.new_logprobs), text.finish_reason, text.stop_reason)


async def choice_updates(async_engine: EngineClient, request_id: str, stream: OutputStream,
                         tracker: GenerationTracker) -> AsyncIterator[ChoiceUpdate]:
    """The request's choice updates; aborts the request if the consumer leaves early."""
    try:
        async with aclosing(stream.__aiter__()) as deltas:
            async for delta in deltas:
                update = tracker.update(delta)
                if update is not None:
                    yield update
    finally:
        async_engine.abort(request_id)  # a no-op once every sequence has finished
