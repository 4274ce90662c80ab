"""Prometheus metrics (vLLM's names, `cobatch:` prefix) and the periodic throughput log line.

Each EngineMetrics owns its CollectorRegistry, so two servers (or tests) in one process never share
counters; an engine replica behind the Ray ingress labels every sample with its replica name too. It is fed on the event loop: per step from StepStats, per finished sequence from its
RequestDelta (RequestMetrics times are time.monotonic()).
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest

from cobatch.outputs import RequestDelta
from cobatch.wait_reasons import StepWaits

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                      5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                      60.0, 120.0, 240.0, 480.0, 960.0)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class StepStatsLike(Protocol):
    """The fields of engine.StepStats that metrics read (metrics must not import the engine)."""

    duration_s: float
    predicted_s: float
    num_rows: int
    num_padding_rows: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int
    num_generated_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    waits: StepWaits


class EngineMetrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self, model_name: str, log_interval_s: float = 5.0,
                 replica: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        # Every sample's labels: the model, and the replica when several engines share one endpoint.
        self._labels = {"model_name": model_name} | ({"replica": replica} if replica else {})
        self._build_gauges()
        self._build_counters()
        self._build_histograms()
        self._throughput = _ThroughputLog(log_interval_s)

    # ---- construction ----------------------------------------------------------------------------

    def _gauge(self, name: str, doc: str) -> Gauge:
        gauge = Gauge(f"cobatch:{name}", doc, list(self._labels), registry=self.registry)
        return gauge.labels(**self._labels)

    def _counter(self, name: str, doc: str) -> Counter:
        counter = Counter(f"cobatch:{name}", doc, list(self._labels), registry=self.registry)
        return counter.labels(**self._labels)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        hist = Histogram(f"cobatch:{name}", doc, list(self._labels), buckets=buckets,
                         registry=self.registry)
        return hist.labels(**self._labels)

    def _build_gauges(self) -> None:
        self.num_requests_running = self._gauge("num_requests_running", "Sequences in the running batch.")
        self.num_requests_waiting = self._gauge("num_requests_waiting", "Sequences waiting for a seat.")
        self.num_requests_swapped = self._gauge("num_requests_swapped", "Sequences swapped out to host.")
        self.kv_cache_usage_perc = self._gauge("kv_cache_usage_perc", "KV-cache usage (1 = full).")
        self.prefix_cache_hit_rate = self._gauge(
            "prefix_cache_hit_rate", "Share of looked-up prompt tokens found in the prefix cache.")
        self.step_time_seconds = self._gauge("step_time_seconds", "Duration of the last step.")
        self.step_time_predicted_seconds = self._gauge(
            "step_time_predicted_seconds", "The step-time model's prediction for the last step.")

    def _build_counters(self) -> None:
        # Counters get "_total" appended by the client library.
        self.num_preemptions = self._counter("num_preemptions", "Preemptions (recompute or swap).")
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of finished sequences.")
        self.generation_tokens = self._counter("generation_tokens", "Tokens generated.")
        self.spec_decode_num_draft_tokens = self._counter(
            "spec_decode_num_draft_tokens", "Speculative draft tokens fed to the model.")
        self.spec_decode_num_accepted_tokens = self._counter(
            "spec_decode_num_accepted_tokens", "Speculative draft tokens the model agreed with.")
        self.request_deadline_missed = self._counter(
            "request_deadline_missed", "Sequences the engine ended at their deadline (finish_reason deadline).")
        self.request_deadline_refused = self._counter(
            "request_deadline_refused", "Requests refused at once: first token predicted past their deadline.")
        # One per sequence per step without a row; the reasons: cobatch/wait_reasons.py.
        self.request_wait_steps = Counter(
            "cobatch:request_wait_steps", "Steps a live sequence spent without a row, by reason.",
            [*self._labels, "reason"], registry=self.registry)
        self.num_preemptions_by_mode = Counter(
            "cobatch:num_preemptions_by_mode", "Preemptions by the mode taken (recompute or swap).",
            [*self._labels, "mode"], registry=self.registry)
        self.request_success = Counter(
            "cobatch:request_success", "Finished sequences, by finish reason.",
            [*self._labels, "finished_reason"], registry=self.registry)

    def _build_histograms(self) -> None:
        h = self._histogram
        self.time_to_first_token = h("time_to_first_token_seconds", "Arrival to first token.",
                                     _LATENCY_BUCKETS_S)
        self.inter_token_latency = h("inter_token_latency_seconds", "Time between two tokens.",
                                     _LATENCY_BUCKETS_S)
        self.time_per_output_token = h("request_time_per_output_token_seconds",
                                       "Mean time per output token after the first, per request.",
                                       _LATENCY_BUCKETS_S)
        self.e2e_latency = h("e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS_S)
        self.queue_time = h("request_queue_time_seconds", "Arrival to first scheduled.",
                            _REQUEST_BUCKETS_S)
        self.iteration_tokens = h("iteration_tokens_total", "Tokens computed per step.", _TOKEN_BUCKETS)
        self.batch_size = h("batch_size", "Rows (sequences) per step.", _BATCH_BUCKETS)

    # ---- feeding ---------------------------------------------------------------------------------

    def set_engine_state(self, num_running: int, num_waiting: int, num_swapped: int,
                         kv_usage: float, prefix_cache_hit_rate: float) -> None:
        """Gauges from the engine snapshot published after each engine-loop turn."""
        self.num_requests_running.set(num_running)
        self.num_requests_waiting.set(num_waiting)
        self.num_requests_swapped.set(num_swapped)
        self.kv_cache_usage_perc.set(kv_usage)
        self.prefix_cache_hit_rate.set(prefix_cache_hit_rate)
        self._throughput.set_state(num_running, num_waiting, num_swapped, kv_usage)

    def record_step(self, stats: StepStatsLike) -> None:
        """Per-step telemetry."""
        self.step_time_seconds.set(stats.duration_s)
        self.step_time_predicted_seconds.set(stats.predicted_s)
        num_tokens = stats.num_prefill_tokens + stats.num_decode_tokens
        if stats.num_rows:
            self.iteration_tokens.observe(num_tokens)
            self.batch_size.observe(stats.num_rows - stats.num_padding_rows)
        if stats.num_preempted:
            self.num_preemptions.inc(stats.num_preempted)
        self._record_waits(stats.waits)
        if stats.num_generated_tokens:
            self.generation_tokens.inc(stats.num_generated_tokens)
        if stats.num_draft_tokens:
            self.spec_decode_num_draft_tokens.inc(stats.num_draft_tokens)
            self.spec_decode_num_accepted_tokens.inc(stats.num_accepted_tokens)
        now = time.monotonic()
        self._throughput.add(now, stats.num_prefill_tokens, stats.num_generated_tokens,
                             stats.num_preempted)
        self._throughput.maybe_log(now)

    def _record_waits(self, waits: StepWaits) -> None:
        for reason, num in waits.counts:
            self.request_wait_steps.labels(**self._labels, reason=reason).inc(num)
        for choice in waits.preemptions:
            self.num_preemptions_by_mode.labels(**self._labels, mode=choice.mode).inc()

    def record_inter_token_latency(self, seconds: float) -> None:
        """Gap between two consecutive tokens of one sequence."""
        self.inter_token_latency.observe(seconds)

    def record_finished(self, delta: RequestDelta) -> None:
        """Per-sequence timings and the finish reason, from its finishing delta."""
        self.request_success.labels(**self._labels,
                                    finished_reason=delta.finish_reason or "unknown").inc()
        if delta.finish_reason == "deadline":
            self.request_deadline_missed.inc()
        if delta.index == 0:  # n samples share one prompt: count it once
            self.prompt_tokens.inc(delta.num_prompt_tokens)
        m = delta.metrics
        if m is None or m.finished_time is None:
            return
        self.e2e_latency.observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            self.time_to_first_token.observe(m.first_token_time - m.arrival_time)
            if m.last_token_time is not None and delta.num_output_tokens > 1:
                self.time_per_output_token.observe(
                    (m.last_token_time - m.first_token_time) / (delta.num_output_tokens - 1))

    def record_deadline_refused(self) -> None:
        """A request refused before admission: its deadline was predicted unreachable."""
        self.request_deadline_refused.inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type, for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _ThroughputLog:
    """Accumulates tokens between log lines; logs every `interval_s` while the engine is busy."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.window_start: float | None = None  # first step since the last line: idle time is no load
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_preemptions = 0
        self.state = (0, 0, 0, 0.0)

    def set_state(self, num_running: int, num_waiting: int, num_swapped: int, kv_usage: float) -> None:
        self.state = (num_running, num_waiting, num_swapped, kv_usage)

    def add(self, now: float, num_prompt_tokens: int, num_generation_tokens: int,
            num_preemptions: int) -> None:
        if self.window_start is None:
            self.window_start = now
        self.num_prompt_tokens += num_prompt_tokens
        self.num_generation_tokens += num_generation_tokens
        self.num_preemptions += num_preemptions

    def maybe_log(self, now: float) -> None:
        if self.window_start is None or now - self.window_start < self.interval_s:
            return
        elapsed = now - self.window_start
        running, waiting, swapped, kv_usage = self.state
        logger.info(
            "prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, running: %d, "
            "waiting: %d, swapped: %d, KV cache usage: %.1f%%, preemptions: %d",
            self.num_prompt_tokens / elapsed, self.num_generation_tokens / elapsed, running, waiting,
            swapped, kv_usage * 100.0, self.num_preemptions)
        self.window_start = None
        self.num_prompt_tokens = self.num_generation_tokens = self.num_preemptions = 0
