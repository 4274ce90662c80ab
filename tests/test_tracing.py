"""cobatch.tracing: span trees built at each sequence's finish, read back from an in-memory exporter."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from cobatch.config import SchedulerConfig
from cobatch.engine import Engine
from cobatch.outputs import RequestMetrics
from cobatch.sampling_params import SamplingParams
from tests.fakes import FakeRunner
from tests.test_async_engine import collect, make_engine, params, run, started

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace import ReadableSpan  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind  # noqa: E402

from cobatch.tracing import (RequestTracer, build_tracer, phases,  # noqa: E402
                             request_attributes, traces_url)

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def traced_run(factory, requests: dict[str, SamplingParams]) -> list[ReadableSpan]:
    """Run `requests` concurrently through an AsyncEngine whose finishes feed a tracer; its spans."""
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(SimpleSpanProcessor(exporter), model_name="fake")

    async def main() -> None:
        engine = await started(factory, on_finished=tracer.on_finished)
        streams = [engine.add(rid, PROMPT, p) for rid, p in requests.items()]
        await asyncio.gather(*(collect(s) for s in streams))
        await engine.shutdown()

    run(main())
    tracer.shutdown()
    return list(exporter.get_finished_spans())


def by_name(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def test_a_request_is_one_span_tree_queue_prefill_decode_with_gen_ai_attributes() -> None:
    spans = traced_run(make_engine, {"r1": params(max_tokens=5)})
    (root,) = by_name(spans, "llm_request")
    assert root.kind == SpanKind.SERVER and root.parent is None
    children = sorted((s for s in spans if s is not root), key=lambda s: s.start_time)
    assert [s.name for s in children] == ["queue", "prefill", "decode"]
    for child in children:
        assert child.parent.span_id == root.context.span_id
        assert child.context.trace_id == root.context.trace_id
        assert root.start_time <= child.start_time <= child.end_time <= root.end_time
    assert children[0].end_time == children[1].start_time and children[1].end_time == children[2].start_time
    attributes = root.attributes
    assert attributes["gen_ai.request.id"] == "r1" and attributes["gen_ai.response.model"] == "fake"
    assert attributes["gen_ai.usage.prompt_tokens"] == len(PROMPT)
    assert attributes["gen_ai.usage.completion_tokens"] == 5
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert 0 <= attributes["gen_ai.latency.time_in_queue"] <= attributes["gen_ai.latency.time_to_first_token"]
    assert attributes["gen_ai.latency.time_to_first_token"] <= attributes["gen_ai.latency.e2e"]
    assert attributes["cobatch.num_preemptions"] == 0 and not root.events


def tiny_pool_engine() -> Engine:
    """Three requests of 8 + 12 tokens need 15 blocks of 4; 8 force recompute preemptions."""
    runner = FakeRunner(num_kv_blocks=8, block_size=4, max_model_len=32)
    return Engine(runner, SchedulerConfig(num_kv_blocks=8, block_size=4, max_model_len=32,
                                          max_num_batched_tokens=64))


def test_a_preempted_request_carries_one_event_per_preemption_at_the_step_it_lost_its_row() -> None:
    spans = traced_run(tiny_pool_engine, {f"r{i}": params(max_tokens=12) for i in range(3)})
    roots = by_name(spans, "llm_request")
    assert len(roots) == 3 and len(by_name(spans, "decode")) == 3
    preempted = [r for r in roots if r.attributes["cobatch.num_preemptions"]]
    assert preempted, "the pool was meant to force a preemption"
    for root in preempted:
        events = [e for e in root.events if e.name == "preempted"]
        assert len(events) == root.attributes["cobatch.num_preemptions"]
        assert all(root.start_time < e.timestamp < root.end_time for e in events)
        for event in events:
            assert event.attributes["cobatch.num_steps_unscheduled"] >= 1
            assert event.attributes["cobatch.preemption.mode"] == "recompute"  # the default mode
            assert event.attributes["cobatch.preemption.why"] == "configured"
        assert root.attributes["cobatch.wait_steps.preempted"] == len(events)


def test_phases_stop_where_the_sequence_got_before_it_ended() -> None:
    waiting = RequestMetrics(arrival_time=1.0)
    assert phases(waiting, end=3.0) == [("queue", 1.0, 3.0)]
    prefilling = RequestMetrics(arrival_time=1.0, first_scheduled_time=2.0)
    assert phases(prefilling, end=3.0) == [("queue", 1.0, 2.0), ("prefill", 2.0, 3.0)]
    assert "gen_ai.latency.time_to_first_token" not in request_attributes(
        _delta(prefilling), prefilling, "m")


def test_traces_url_adds_the_otlp_path_only_to_a_bare_collector_url() -> None:
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("http://c:4318/custom/spans") == "http://c:4318/custom/spans"


def test_the_otlp_tracer_builds_without_reaching_its_collector() -> None:
    tracer = build_tracer("http://127.0.0.1:9", "m")  # nothing listens there: nothing is sent yet
    assert isinstance(tracer, RequestTracer) and tracer.model_name == "m"
    tracer.shutdown()


def test_tracing_off_loads_no_opentelemetry() -> None:
    """`import cobatch` and the engine load none of it; the server, none of its SDK (FastAPI imports
    the opentelemetry API on its own)."""
    code = ("import sys; import cobatch, cobatch.async_engine; "
            "print(any(m.startswith('opentelemetry') for m in sys.modules)); "
            "import cobatch.server.app, cobatch.server.cli; "
            "print(any(m.startswith(('opentelemetry.sdk', 'cobatch.tracing')) for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def _delta(metrics: RequestMetrics):
    from cobatch.outputs import RequestDelta

    return RequestDelta("r", "r", 0, (), (), 3, 0, finish_reason="abort", metrics=metrics)
