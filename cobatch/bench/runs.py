"""Drive an Engine over a workload and record what happened: the shared core of the offline benchmarks.

One loaded runner serves many engines: each run builds a fresh Engine (fresh scheduler, block manager
and step-time model) around the same runner with its own SchedulerConfig, so static vs continuous,
max_num_seqs sweeps and KV budgets are compared on the same weights in the same process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from cobatch.bench.datasets import BenchRequest
from cobatch.bench.metrics import RequestTiming
from cobatch.config import Batching, EngineConfig, PreemptionMode
from cobatch.engine import Engine, Runner, StepStats
from cobatch.sampling_params import SamplingParams


@dataclass(slots=True)
class RunResult:
    """One workload run on one engine configuration."""

    label: str
    batching: str
    max_num_seqs: int
    num_kv_blocks: int
    duration_s: float
    timings: list[RequestTiming]
    stats: list[StepStats]
    finished_step: dict[str, int]  # request id -> step whose deltas finished it
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    num_swaps: int = 0
    tpot_slo_ms: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def num_output_tokens(self) -> int:
        """Useful generated tokens (padding rows of static batching produce none)."""
        return sum(t.num_output_tokens for t in self.timings)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def mean_running(self) -> float:
        """Time-weighted mean number of rows computing useful tokens."""
        total = sum(s.duration_s for s in self.stats)
        rows = sum((s.num_rows - s.num_padding_rows) * s.duration_s for s in self.stats)
        return rows / total if total else 0.0

    @property
    def max_running(self) -> int:
        return max((s.num_rows - s.num_padding_rows for s in self.stats), default=0)

    def summary(self) -> dict:
        """JSON-ready figures (no per-step data)."""
        return {
            "label": self.label, "batching": self.batching, "max_num_seqs": self.max_num_seqs,
            "num_kv_blocks": self.num_kv_blocks, "tpot_slo_ms": self.tpot_slo_ms,
            "num_requests": len(self.timings), "duration_s": self.duration_s,
            "num_output_tokens": self.num_output_tokens, "tokens_per_s": self.tokens_per_s,
            "num_steps": len(self.stats), "mean_running": self.mean_running,
            "max_running": self.max_running, "num_preemptions": self.num_preemptions,
            "num_recomputed_tokens": self.num_recomputed_tokens, "num_swaps": self.num_swaps,
            **self.extra,
        }


class EngineFactory:
    """Builds engines with different scheduler settings around one loaded runner."""

    def __init__(self, runner: Runner, config: EngineConfig) -> None:
        self.runner = runner
        self.config = config

    @classmethod
    def load(cls, config: EngineConfig) -> EngineFactory:
        """Load the model once (ModelRunner.load)."""
        from cobatch.runner.model_runner import ModelRunner  # torch only when a real model runs

        return cls(ModelRunner.load(config), config)

    def make(self, batching: Batching = "continuous", max_num_seqs: int | None = None,
             num_kv_blocks: int | None = None, tpot_slo_ms: float | None = None,
             preemption_mode: PreemptionMode | None = None) -> Engine:
        """A fresh engine; `num_kv_blocks` may only shrink the runner's pool (a smaller KV budget)."""
        blocks = min(num_kv_blocks or self.runner.num_kv_blocks, self.runner.num_kv_blocks)
        config = replace(self.config, batching=batching, tpot_slo_ms=tpot_slo_ms,
                         max_num_seqs=max_num_seqs or self.config.max_num_seqs,
                         preemption_mode=preemption_mode or self.config.preemption_mode)
        scheduler_config = config.scheduler_config(blocks, self.runner.num_swap_blocks,
                                                   self.runner.max_model_len)
        return Engine(self.runner, scheduler_config, stats_history=None)


def run_workload(engine: Engine, requests: list[BenchRequest], label: str = "") -> RunResult:
    """Submit every request at once (offline), step until drained, and time each request."""
    start = time.monotonic()
    timings: dict[str, RequestTiming] = {}
    for i, request in enumerate(requests):
        if request.prompt_token_ids is None:
            raise ValueError("offline runs need prompt_token_ids (tokenize text prompts first)")
        params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)
        engine.add_request(f"r{i}", list(request.prompt_token_ids), params, arrival_time=start)
        timings[f"r{i}"] = RequestTiming(start, num_prompt_tokens=len(request.prompt_token_ids))
    finished_step: dict[str, int] = {}
    totals = {"num_preemptions": 0, "num_recomputed_tokens": 0, "num_swaps": 0}
    runner_s: dict[str, float] = {}  # the runner's own split of execute (prepare, forward, sample)
    while engine.has_unfinished_requests():
        deltas = engine.step()
        now = time.monotonic()
        for part, seconds in getattr(engine.runner, "last_timings", {}).items():
            runner_s[part] = runner_s.get(part, 0.0) + seconds
        for delta in deltas:
            timing = timings[delta.parent_id]
            if delta.new_token_ids:
                timing.token_times_s.append(now)
                timing.num_output_tokens += len(delta.new_token_ids)
            if delta.finished:
                finished_step[delta.request_id] = engine.num_steps - 1
                timing.success = delta.error is None
                if delta.metrics is not None:
                    totals["num_preemptions"] += delta.metrics.num_preemptions
                    totals["num_recomputed_tokens"] += delta.metrics.num_recomputed_tokens
                    totals["num_swaps"] += delta.metrics.num_swaps
    config = engine.config
    return RunResult(label or config.batching, config.batching, config.max_num_seqs,
                     config.num_kv_blocks, time.monotonic() - start, list(timings.values()),
                     list(engine.stats), finished_step, tpot_slo_ms=config.tpot_slo_ms, **totals,
                     extra={"runner_s": runner_s} if runner_s else {})


def warm_up(factory: EngineFactory, num_tokens: int = 8) -> None:
    """One-time costs land in no measurement: the KV pool made resident first, as `cobatch serve` does
    before it reports ready (its pages are mapped lazily, and the first touch of each would land in the
    first run's prefill steps, which the runs after it would not pay), then a tiny run for the allocator and the kernels' first calls."""
    engine = factory.make(max_num_seqs=4)
    engine.prefault_kv_cache()
    warm = [BenchRequest(num_tokens, prompt_token_ids=tuple(range(1000, 1000 + 16 * (i + 1))))
            for i in range(4)]
    run_workload(engine, warm, "warm-up")
