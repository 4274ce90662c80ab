"""The dashboard's wire format and routes without a browser: step records -> events, timelines, SSE."""

from __future__ import annotations

import json
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.testclient import TestClient

from cobatch.async_engine import EngineState
from cobatch.outputs import RequestDelta, RequestMetrics
from cobatch.server.cli import add_serve_arguments
from cobatch.server.dashboard import add_dashboard_routes
from cobatch.server.dashboard.events import request_timeline, sse, tick_event
from cobatch.server.errors import install_error_handlers
from cobatch.step_history import StepHistory, sequence_segments
from cobatch.wait_reasons import PreemptionChoice, StepWaits


@dataclass(frozen=True, slots=True)
class Step:
    """A StepStats look-alike: the fields the dashboard reads."""

    step: int
    row_request_ids: tuple[str, ...]
    row_kinds: str
    row_num_new_tokens: tuple[int, ...]
    start_time: float = 0.0
    duration_s: float = 0.01
    predicted_s: float = 0.009
    num_running: int = 2
    num_waiting: int = 1
    num_swapped: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_generated_tokens: int = 1
    num_preempted: int = 0
    kv_usage: float = 0.25
    prefix_cache_hit_rate: float = 0.5
    waits: StepWaits = StepWaits()


def steps(*rows: tuple[tuple[str, str, int], ...]) -> list[Step]:
    """One Step per argument: its (id, kind, tokens) rows; step i starts at i * 10 ms."""
    return [Step(i, tuple(r[0] for r in row), "".join(r[1] for r in row), tuple(r[2] for r in row),
                 start_time=i * 0.01) for i, row in enumerate(rows)]


def finished(request_id: str, reason: str = "length") -> RequestDelta:
    metrics = RequestMetrics(arrival_time=-0.005, first_scheduled_time=0.0, first_token_time=0.01,
                             finished_time=0.06, num_preemptions=1)
    return RequestDelta(request_id, request_id.split("#")[0], 0, (7,), (), 8, 5, finish_reason=reason,
                        metrics=metrics)


# a prefill in two chunks, decode, a gap (preempted), a recompute, decode; "b" rides along
HISTORY = steps([("a", "p", 8), ("b", "d", 1)], [("a", "p", 4), ("b", "d", 1)], [("a", "d", 1)],
                [("b", "d", 1)], [("a", "p", 13), ("b", "x", 1)], [("a", "d", 1)])


def test_a_tick_names_each_request_once_and_keeps_rows_kinds_and_tokens_per_step() -> None:
    event = tick_event("engine", "ready", HISTORY[:4], [finished("b")])
    assert event["ids"] == ["a", "b"] and event["replica"] == "engine"
    first, _, all_decode, _ = event["steps"]
    assert first["rows"] == [0, 1] and first["kinds"] == "pd" and first["tokens"] == [8, 1]
    assert all_decode["kinds"] == "d" and all_decode["tokens"] == []  # one token per row: implied
    assert first["ms"] == 10.0 and first["pred_ms"] == 9.0 and first["kv"] == 0.25
    assert event["finished"] == [{"id": 1, "reason": "length", "tokens": 5}]
    assert event["why_waiting"] == {"counts": {}, "waiting": None, "swapped": None}
    assert tick_event("engine", "ready", [], [])["why_waiting"] is None


def test_sse_frames_one_named_event_of_compact_json() -> None:
    frame = sse("tick", {"a": [1, 2]})
    assert frame == 'event: tick\ndata: {"a":[1,2]}\n\n'


def test_segments_merge_runs_and_mark_gaps_and_recomputes() -> None:
    kinds = [(s.kind, s.first_step, s.last_step, s.num_tokens, s.is_recompute)
             for s in sequence_segments(HISTORY, "a")]
    assert kinds == [("prefill", 0, 1, 12, False), ("decode", 2, 2, 1, False),
                     ("unscheduled", 3, 3, 0, False), ("prefill", 4, 4, 13, True),
                     ("decode", 5, 5, 1, False)]
    assert [s.kind for s in sequence_segments(HISTORY, "b")] == ["decode", "unscheduled", "decode", "padding"]


def test_a_request_timeline_starts_at_its_arrival_with_its_wait_and_leaves_the_why_slot_empty() -> None:
    history = StepHistory()
    for stats in HISTORY:
        history.record_step(stats)
    history.record_finished(finished("a", "stop"))
    timeline = request_timeline("a", "engine", history)
    assert timeline is not None
    (seq,) = timeline["sequences"]
    assert seq["status"] == "finished" and seq["finish_reason"] == "stop" and not seq["is_truncated"]
    waiting, *rest = seq["segments"]
    assert waiting["kind"] == "waiting" and (waiting["start_ms"], waiting["end_ms"]) == (0.0, 5.0)
    assert waiting["wait_reason"] is None and waiting["wait_steps"] == {}  # no kept step: no reason
    assert [s["kind"] for s in rest] == ["prefill", "decode", "unscheduled", "prefill", "decode"]
    assert rest[0]["start_ms"] == 5.0 and all(s["wait_reason"] is None for s in rest)
    assert seq["metrics"]["num_preemptions"] == 1 and seq["metrics"]["first_token_ms"] == 15.0
    assert request_timeline("nobody", "engine", history) is None


def waits(held: tuple[tuple[str, str], ...] = (), waiting: str | None = None,
          swapped: str | None = None, preempted: tuple[str, str] | None = None) -> StepWaits:
    choices = (PreemptionChoice(preempted[0], 0, preempted[1], "configured", 9),) if preempted else ()
    return StepWaits(held=held, waiting_reason=waiting, swapped_reason=swapped, preemptions=choices)


def test_a_gap_says_why_from_the_steps_wait_records_and_a_swap_waits_with_the_swapped_queue() -> None:
    rows = [(("a", "d", 1),), (), (), (("a", "d", 1),), (), (), (("a", "d", 1),)]
    gap_waits = [waits(), waits(held=(("a", "preempted"),), preempted=("a", "recompute")),
                 waits(waiting="max_num_seqs", swapped="kv_blocks"), waits(),
                 waits(held=(("a", "preempted"),), preempted=("a", "swap")),
                 waits(waiting="max_num_seqs", swapped="kv_blocks"), waits()]
    history = [Step(i, tuple(r[0] for r in row), "".join(r[1] for r in row), tuple(r[2] for r in row),
                    start_time=i * 0.01, waits=w) for i, (row, w) in enumerate(zip(rows, gap_waits))]
    gaps = [s for s in sequence_segments(history, "a") if s.kind == "unscheduled"]
    assert [g.wait_steps for g in gaps] == [(("preempted", 1), ("max_num_seqs", 1)),
                                            (("preempted", 1), ("kv_blocks", 1))]
    assert [g.preemption.mode for g in gaps] == ["recompute", "swap"]
    # Waiting from its arrival (15 ms) to its first row, behind the queue's head.
    waited = sequence_segments(history[2:4], "a", waited=(0.015, 0.03))
    assert waited[0].kind == "waiting" and waited[0].wait_steps == (("max_num_seqs", 1),)
    assert waited[0].wait_reason == "max_num_seqs"
    assert sequence_segments(history[3:], "a", waited=(0.0, 0.01))[0].kind == "decode"  # row not kept


def test_n_samples_are_one_request_with_a_sequence_each() -> None:
    history = StepHistory()
    for stats in steps([("r#0", "p", 4), ("r#1", "d", 1)], [("r#0", "d", 1), ("r#1", "d", 1)]):
        history.record_step(stats)
    timeline = request_timeline("r", "engine", history)
    assert timeline is not None and [s["id"] for s in timeline["sequences"]] == ["r#0", "r#1"]
    assert all(s["status"] == "live" and s["metrics"] is None for s in timeline["sequences"])


def test_history_hands_out_only_what_a_cursor_has_not_seen() -> None:
    history = StepHistory(max_steps=4, max_finished=2)
    for stats in HISTORY:
        history.record_step(stats)
    assert [s.step for s in history.steps_after(-1, limit=10)] == [2, 3, 4, 5]  # bounded
    assert [s.step for s in history.steps_after(3, limit=10)] == [4, 5]
    assert [s.step for s in history.steps_after(-1, limit=1)] == [5]
    first, second = finished("a"), finished("b")
    history.record_finished(first)
    history.record_finished(second)
    assert history.finished_after(first) == [second] and history.finished_after(second) == []


@dataclass
class StoppedEngine:
    """An EngineClient stand-in as the dashboard reads it: a state and no info."""

    state: EngineState = EngineState.STOPPED
    info: None = None


def dashboard_client(history: StepHistory) -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    add_dashboard_routes(app, StoppedEngine(), {"engine": history})  # type: ignore[arg-type]
    return TestClient(app)


def test_the_routes_serve_the_page_the_stream_and_timelines() -> None:
    history = StepHistory()
    for stats in HISTORY:
        history.record_step(stats)
    client = dashboard_client(history)
    page = client.get("/dashboard")
    assert page.status_code == 200 and "/dashboard/static/dashboard.js" in page.text
    assert client.get("/dashboard/static/dashboard.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/dashboard/static/../routes.py").status_code == 404
    # A stopped engine: hello, one tick with the backlog, then the stream ends (the page reconnects).
    body = client.get("/dashboard/events").text
    events = [block for block in body.split("\n\n") if block.startswith("event:")]
    assert [e.split("\n")[0] for e in events] == ["event: hello", "event: tick"]
    tick = json.loads(events[1].split("data: ", 1)[1])
    assert [s["step"] for s in tick["steps"]] == [0, 1, 2, 3, 4, 5] and tick["state"] == "stopped"
    assert body.startswith("retry: ")
    assert client.get("/dashboard/requests/a").json()["sequences"][0]["id"] == "a"
    assert client.get("/dashboard/requests/zzz").status_code == 404


def test_serve_has_the_dashboard_on_by_default_and_tracing_off() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args([])
    assert args.disable_dashboard is False and args.otlp_traces_endpoint is None
    assert parser.parse_args(["--disable-dashboard"]).disable_dashboard is True
