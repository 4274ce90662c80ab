"""Why is it waiting, outside the core: AsyncEngine.request_status, the Prometheus counters, and
GET /debug/requests/{id} of a real `cobatch serve` (its stream's x-request-id header names the id)."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cobatch.async_engine import AsyncEngine
from cobatch.config import SchedulerConfig
from cobatch.engine import Engine
from cobatch.metrics import EngineMetrics
from cobatch.testing.faults import FaultInjector
from cobatch.wait_reasons import MAX_NUM_SEQS
from tests.fakes import FakeRunner
from tests.server_process import ServerProcess, metric, tiny_server
from tests.test_async_engine import collect, params, run, started
from tests.test_server import metrics_text, slow_steps, wait_idle


def one_seat_engine() -> Engine:
    """One seat and slow steps: a second request waits for max_num_seqs while the first runs."""
    faults = FaultInjector()
    faults.inject("stall", seconds=0.01, num_steps=1_000_000)
    runner = faults.wrap(FakeRunner(num_kv_blocks=32, block_size=4, max_model_len=64))
    return Engine(runner, SchedulerConfig(num_kv_blocks=32, block_size=4, max_model_len=64, max_num_seqs=1))


def wait_steps_of(text: str, reason: str) -> float:
    match = re.search(rf'^cobatch:request_wait_steps_total{{[^}}]*reason="{reason}"[^}}]*}} (\S+)$',
                      text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_the_async_engine_answers_for_live_and_finished_sequences() -> None:
    async def main() -> None:
        metrics = EngineMetrics("fake")
        engine = await started(one_seat_engine, metrics=metrics)
        first = engine.add("first", [5, 6, 7], params(max_tokens=20))
        second = engine.add("second", [5, 6, 8], params(max_tokens=2, n=2))
        await asyncio.sleep(0.1)
        live = await engine.request_status("second")
        assert live is not None and [s.seq_id for s in live] == ["second#0", "second#1"]
        assert all(s.state == "waiting" and s.reason == MAX_NUM_SEQS and s.is_behind for s in live)
        assert [s.queue_position for s in live] == [0, 1] and live[0].wait_steps[MAX_NUM_SEQS] >= 2
        await collect(first)
        await collect(second)
        done = await engine.request_status("second")
        assert done is not None and all(s.state == "finished" for s in done)
        assert (await engine.request_status("second#1")) == done[1:]
        assert done[1].wait_steps[MAX_NUM_SEQS] > live[1].wait_steps[MAX_NUM_SEQS]
        assert await engine.request_status("nobody") is None
        body, _ = metrics.render()  # every step's waits, counted once per sequence
        assert wait_steps_of(body.decode(), MAX_NUM_SEQS) == sum(s.wait_steps[MAX_NUM_SEQS] for s in done)
        await engine.shutdown()

    run(main())


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from tiny_server(tiny_model_dir, tmp_path_factory.mktemp("request_status") / "server.log", 1)


def test_debug_requests_says_why_a_request_waits(server: ServerProcess) -> None:
    body = {"model": "tiny", "prompt": "count", "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=30.0) as http, slow_steps(http, 0.03):
        busy = threading.Thread(target=lambda: http.post("/v1/completions", json={**body, "stream": False}))
        busy.start()
        try:
            while metric(metrics_text(http), "cobatch:num_requests_running") < 1:  # it holds the seat
                time.sleep(0.01)
            with http.stream("POST", "/v1/completions", json={**body, "max_tokens": 2}) as stream:
                request_id = stream.headers["x-request-id"]  # sent before its first token
                answer = http.get(f"/debug/requests/{request_id}").json()
                if answer["sequences"][0]["reason"] is None:  # asked before a step had seen it
                    time.sleep(0.1)
                    answer = http.get(f"/debug/requests/{request_id}").json()
                stream.read()
        finally:
            busy.join()
        (seq,) = answer["sequences"]
        assert answer["id"] == request_id and seq["state"] == "waiting" and seq["reason"] == MAX_NUM_SEQS
        after = http.get(f"/debug/requests/{request_id}").json()["sequences"][0]
        assert after["state"] == "finished" and after["wait_steps"][MAX_NUM_SEQS] >= 1
        assert wait_steps_of(wait_idle(http), MAX_NUM_SEQS) >= after["wait_steps"][MAX_NUM_SEQS]
        missing = http.get("/debug/requests/cmpl-nobody")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "request_not_found"
