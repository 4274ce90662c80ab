"""Turning engine deltas into per-choice text: detokenize, stop strings, token counts, logprobs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from cobatch.async_engine import AsyncEngine, RequestStream
from cobatch.outputs import RequestDelta
from cobatch.sampling_params import SamplingParams
from cobatch.scheduler_output import TokenLogprobs
from cobatch.server.protocol import Usage
from cobatch.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer


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
class _Sequence:
    """One choice's text state."""

    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    num_tokens: int = 0
    is_finished: bool = False


@dataclass(slots=True)
class GenerationTracker:
    """Per-request state: one detokenizer and stop checker per choice, and the usage counts."""

    async_engine: AsyncEngine
    tokenizer: Tokenizer
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[_Sequence] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sequences = [
            _Sequence(IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids,
                                             self.params.skip_special_tokens),
                      StopChecker(self.params.stop, self.params.include_stop_str_in_output))
            for _ in range(self.params.n)]

    def usage(self) -> Usage:
        """Prompt tokens once; completion tokens over all choices, up to each one's stop."""
        completion = sum(s.num_tokens for s in self.sequences)
        prompt = len(self.prompt_token_ids)
        return Usage(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion)

    def update(self, delta: RequestDelta) -> ChoiceUpdate | None:
        """The choice update a delta makes; None once the choice has stopped on a stop string."""
        seq = self.sequences[delta.index]
        if seq.is_finished:
            return None  # tokens the engine made before our stop reached it: dropped
        seq.num_tokens += len(delta.new_token_ids)
        text = seq.detokenizer.step(delta.new_token_ids)
        if delta.finished:
            text += seq.detokenizer.flush()
        emit, stopped = seq.stop_checker.process(text)
        logprobs = tuple(delta.new_logprobs)
        if stopped:
            seq.is_finished = True
            stop = seq.stop_checker.hit
            if not delta.finished:  # the engine would go on generating: tell it to stop now
                self.async_engine.stop_sequence(delta.request_id, stop)
            return ChoiceUpdate(delta.index, emit, len(delta.new_token_ids), logprobs, "stop", stop)
        if delta.finished:
            seq.is_finished = True
            emit += seq.stop_checker.flush()
            return ChoiceUpdate(delta.index, emit, len(delta.new_token_ids), logprobs,
                                delta.finish_reason, delta.stop_reason)
        return ChoiceUpdate(delta.index, emit, len(delta.new_token_ids), logprobs)


async def choice_updates(async_engine: AsyncEngine, request_id: str, stream: RequestStream,
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
