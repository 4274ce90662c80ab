"""Optional OpenTelemetry tracing: one span tree per finished sequence, built from its RequestMetrics.

Off by default; `cobatch serve --otlp-traces-endpoint URL` turns it on (OTLP over HTTP/protobuf, the
`cobatch[otel]` extra). Nothing runs per step: when a sequence finishes, on the event loop, its
timestamps become a root span and three children, and a batching processor exports them on its own
thread. opentelemetry is imported by this module only, and only once tracing is on, so `import cobatch`
stays free of it.

    llm_request  [arrival ................................................. finished]
      queue      [arrival .. first scheduled]
      prefill                [first scheduled .. first token]
      decode                                   [first token ............... finished]
      events: "preempted" at each step where the sequence lost its row, with the mode chosen

Attribute names are vLLM's gen_ai.* where it has one; cobatch.* for the rest.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from cobatch.outputs import RequestDelta, RequestMetrics
from cobatch.step_history import Segment, StepHistory

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.trace import Span

logger = logging.getLogger(__name__)

_TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for spans, when the URL names only the collector


def traces_url(endpoint: str) -> str:
    """The collector's span URL: `endpoint` as given, or with OTLP's /v1/traces when it has no path."""
    return endpoint if urlsplit(endpoint).path.strip("/") else endpoint.rstrip("/") + _TRACES_PATH


def build_tracer(endpoint: str, model_name: str) -> RequestTracer:
    """A tracer exporting to an OTLP/HTTP collector at `endpoint` (ImportError without cobatch[otel])."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    return RequestTracer(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))), model_name)


class RequestTracer:
    """Turns each finished sequence into spans (AsyncEngine's on_finished); its own TracerProvider."""

    def __init__(self, span_processor: SpanProcessor, model_name: str,
                 service_name: str = "cobatch") -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        self.model_name = model_name
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(span_processor)
        self._tracer = self._provider.get_tracer("cobatch")

    def on_finished(self, delta: RequestDelta, history: StepHistory) -> None:
        """Emit the sequence's spans; never raises (a tracing fault must not stop the deltas)."""
        if delta.metrics is None:
            return
        try:
            self._emit(delta, delta.metrics, history)
        except Exception:  # noqa: BLE001 - log and go on serving
            logger.exception("tracing: could not record request %s", delta.request_id)

    def shutdown(self) -> None:
        """Export what is still buffered and stop the exporter."""
        self._provider.shutdown()

    def _emit(self, delta: RequestDelta, metrics: RequestMetrics, history: StepHistory) -> None:
        from opentelemetry import trace

        to_ns = _Converter()
        end = metrics.finished_time or time.monotonic()
        root = self._tracer.start_span("llm_request", kind=trace.SpanKind.SERVER,
                                       start_time=to_ns(metrics.arrival_time),
                                       attributes=request_attributes(delta, metrics, self.model_name))
        context = trace.set_span_in_context(root)
        for name, start, stop in phases(metrics, end):
            self._tracer.start_span(name, context=context, start_time=to_ns(start)).end(to_ns(stop))
        if metrics.num_preemptions:  # the step history is read for preempted sequences only
            _add_preemption_events(root, history.segments(delta.request_id), to_ns)
        if delta.error is not None:
            root.set_status(trace.Status(trace.StatusCode.ERROR, delta.error))
        root.end(to_ns(end))


def phases(metrics: RequestMetrics, end: float) -> list[tuple[str, float, float]]:
    """(name, start, end) of queue, prefill and decode, as far as the sequence got before `end`."""
    marks = [metrics.arrival_time, metrics.first_scheduled_time, metrics.first_token_time]
    found: list[tuple[str, float, float]] = []
    for index, name in enumerate(("queue", "prefill", "decode")):
        start = marks[index]
        if start is None:
            break
        stop = next((m for m in marks[index + 1:] if m is not None), None)
        found.append((name, start, end if stop is None else stop))
    return found


def request_attributes(delta: RequestDelta, metrics: RequestMetrics,
                       model_name: str) -> dict[str, str | int | float | tuple[str, ...]]:
    """The root span's attributes: vLLM's gen_ai.* names, latencies in seconds."""
    attributes: dict[str, str | int | float | tuple[str, ...]] = {
        "gen_ai.request.id": delta.parent_id,
        "gen_ai.response.model": model_name,
        "gen_ai.response.finish_reasons": (delta.finish_reason or "",),
        "gen_ai.usage.prompt_tokens": delta.num_prompt_tokens,
        "gen_ai.usage.completion_tokens": delta.num_output_tokens,
        "gen_ai.usage.cached_tokens": metrics.num_cached_tokens,
        "cobatch.sequence.id": delta.request_id,
        "cobatch.sequence.index": delta.index,
        "cobatch.num_preemptions": metrics.num_preemptions,
        "cobatch.num_swaps": metrics.num_swaps,
        "cobatch.num_recomputed_tokens": metrics.num_recomputed_tokens,
        **{f"cobatch.wait_steps.{reason}": n for reason, n in metrics.wait_steps.items()},
    }
    end = metrics.finished_time
    latencies = {
        "gen_ai.latency.time_in_queue": (metrics.arrival_time, metrics.first_scheduled_time),
        "gen_ai.latency.time_to_first_token": (metrics.arrival_time, metrics.first_token_time),
        "gen_ai.latency.e2e": (metrics.arrival_time, end),
        "gen_ai.latency.time_in_model_prefill": (metrics.first_scheduled_time, metrics.first_token_time),
        "gen_ai.latency.time_in_model_decode": (metrics.first_token_time, end),
        "gen_ai.latency.time_in_model_inference": (metrics.first_scheduled_time, end),
    }
    for name, (start, stop) in latencies.items():
        if start is not None and stop is not None:
            attributes[name] = stop - start
    return attributes


def _add_preemption_events(root: Span, segments: list[Segment], to_ns: _Converter) -> None:
    """One event per kept gap that a preemption began, at the step where the sequence lost its row."""
    for gap in segments:
        choice = gap.preemption
        if choice is None:
            continue
        attributes: dict[str, str | int | float] = {
            "cobatch.step": gap.first_step, "cobatch.preemption.mode": choice.mode,
            "cobatch.preemption.why": choice.why,
            "cobatch.preemption.num_computed_tokens": choice.num_computed_tokens,
            "cobatch.num_steps_unscheduled": gap.last_step - gap.first_step + 1}
        for name, seconds in (("recompute_s", choice.recompute_s), ("swap_s", choice.swap_s)):
            if seconds is not None:
                attributes[f"cobatch.preemption.predicted_{name}"] = seconds
        root.add_event("preempted", timestamp=to_ns(gap.start_time), attributes=attributes)


class _Converter:
    """time.monotonic() seconds -> epoch nanoseconds (OpenTelemetry's clock), one offset per span tree."""

    def __init__(self) -> None:
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    def __call__(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._offset_ns
