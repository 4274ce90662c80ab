"""Offline facade in vLLM's shape: `LLM(...).generate(prompts, params)` and `.chat(messages)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm import tqdm

from cobatch.config import EngineConfig
from cobatch.engine import Engine
from cobatch.outputs import CompletionOutput, RequestDelta, RequestOutput
from cobatch.sampling_params import SamplingParams
from cobatch.tokenizer import TextStream, Tokenizer

PromptType = str | dict[str, list[int]]
Message = dict[str, str]


class LLM:
    """Load a model and generate for many prompts at once, continuously batched."""

    def __init__(self, model: str | None = None, **engine_options: object) -> None:
        self.config = EngineConfig(model=model, **engine_options)  # type: ignore[arg-type]
        self.tokenizer = Tokenizer.load(self.config.model)
        self.engine = Engine.from_config(self.config, stats_history=None, tokenizer=self.tokenizer)
        self._ids = itertools.count()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (strings or {"prompt_token_ids": [...]}); outputs in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = _per_prompt(sampling_params, len(prompts))
        outputs: list[RequestOutput] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                outputs.append(self._add(p, sp, priority[i] if priority else 0))
        except ValueError:  # a refused prompt: none of the call's prompts stays queued
            for output in outputs:
                self.engine.abort_request(output.request_id)
            raise
        self._run(outputs, params, use_tqdm)
        return outputs

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.tokenizer.apply_chat_template(list(c))}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def summary(self) -> str:
        """Useful tokens/s and batch figures of everything generated so far."""
        stats = list(self.engine.stats)
        if not stats:
            return "no steps run"
        wall = stats[-1].start_time + stats[-1].duration_s - stats[0].start_time
        generated = sum(s.num_generated_tokens for s in stats)
        rows = sum(s.num_rows for s in stats) / len(stats)
        totals = self.engine.scheduler_stats  # as of the last step
        drafts = (f", {totals.num_accepted_tokens_total} of {totals.num_draft_tokens_total} speculative "
                  f"drafts accepted" if totals.num_draft_tokens_total else "")
        return (f"{len(stats)} steps, {generated} tokens generated in {wall:.2f} s "
                f"({generated / wall:.1f} tok/s), mean batch {rows:.1f} rows, "
                f"{totals.num_preemptions_total} preemptions{drafts}")

    # ---- internals -----------------------------------------------------------------------------

    def _add(self, prompt: PromptType, params: SamplingParams, priority: int) -> RequestOutput:
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt["prompt_token_ids"])
        request_id = str(next(self._ids))
        self.engine.add_request(request_id, token_ids, params, priority=priority)
        outputs = [CompletionOutput(i, logprobs=[] if params.logprobs is not None else None)
                   for i in range(params.n)]
        return RequestOutput(request_id, text, token_ids, outputs)

    def _run(self, outputs: list[RequestOutput], params: list[SamplingParams], use_tqdm: bool) -> None:
        by_id = {o.request_id: (o, sp) for o, sp in zip(outputs, params)}
        streams = {(o.request_id, c.index): TextStream(self.tokenizer, sp, o.prompt_token_ids)
                   for o, sp in zip(outputs, params) for c in o.outputs}
        bar = tqdm(total=len(outputs), desc="generate", disable=not use_tqdm or len(outputs) < 2)
        remaining = sum(len(o.outputs) for o in outputs)
        while remaining:
            for delta in self.engine.step():
                output, _ = by_id[delta.parent_id]
                remaining -= self._apply(output, delta, streams[(delta.parent_id, delta.index)])
                if output.finished:
                    bar.update(1)
        bar.close()

    def _apply(self, output: RequestOutput, delta: RequestDelta, stream: TextStream) -> int:
        """Fold one delta into the output; returns 1 when that sequence has just finished."""
        completion = output.outputs[delta.index]
        if delta.prompt_logprobs is not None:
            output.prompt_logprobs = list(delta.prompt_logprobs)
        if completion.finish_reason is not None:
            return 0  # already closed by a stop string
        completion.token_ids.extend(delta.new_token_ids)
        if completion.logprobs is not None:
            completion.logprobs.extend(delta.new_logprobs)
        text = stream.add(delta)
        completion.text += text.text
        if text.engine_stop is not None:
            self.engine.stop_sequence(delta.request_id, text.engine_stop)
        if text.finish_reason is None:
            return 0
        completion.finish_reason, completion.stop_reason = text.finish_reason, text.stop_reason
        if delta.finished:
            output.metrics = delta.metrics
        output.finished = all(c.finish_reason is not None for c in output.outputs)
        return 1


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None,
                n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return list(params)
