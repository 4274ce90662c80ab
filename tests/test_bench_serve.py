"""`bench serve` against a tiny fake OpenAI server (FastAPI + uvicorn on a free port, SSE streaming)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from cobatch.bench.datasets import BenchRequest
from cobatch.bench.metrics import Slo
from cobatch.bench.serve import LoadSpec, arrival_delays, benchmark, request_body, resolve_model

TOKEN_GAP_S = 0.002


def fake_app() -> FastAPI:
    """Streams max_tokens chunks (one token each) a few ms apart; prompt 'FAIL' gets a 500."""
    app = FastAPI()
    app.state.max_in_flight = app.state.in_flight = 0

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def stream(body: dict, chat: bool):
        app.state.in_flight += 1
        app.state.max_in_flight = max(app.state.max_in_flight, app.state.in_flight)
        try:
            for i in range(body["max_tokens"]):
                await asyncio.sleep(TOKEN_GAP_S)
                choice = {"index": 0, "delta": {"content": f" t{i}"}} if chat else {"index": 0, "text": f" t{i}"}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            usage = {"prompt_tokens": 3, "completion_tokens": body["max_tokens"]}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            app.state.in_flight -= 1

    async def handle(request: Request, chat: bool):
        body = await request.json()
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if prompt == "FAIL":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, chat=True)

    return app


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, FastAPI]]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    app = fake_app()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", app
    srv.should_exit = True
    thread.join(timeout=5)


def requests_of(lengths: list[int], prompt: str = "hello world") -> list[BenchRequest]:
    return [BenchRequest(n, prompt_token_ids=(1, 2, 3), prompt=prompt) for n in lengths]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serve_measures_a_streaming_server(server, endpoint: str) -> None:
    url, _ = server
    spec = LoadSpec(url, resolve_model(url, None), endpoint=endpoint)
    assert spec.model == "fake-model"
    report = asyncio.run(benchmark(requests_of([5, 10, 20]), spec, Slo(tpot_ms=1000.0), False))
    assert report["completed"] == 3 and report["failed"] == 0
    assert report["total_output_tokens"] == 35 and report["good_requests"] == 3
    assert report["ttft_ms"]["p50"] >= TOKEN_GAP_S * 1000 * 0.5
    assert report["tpot_ms"]["mean"] >= TOKEN_GAP_S * 1000 * 0.5
    assert report["output_throughput"] > 0


def test_failures_are_counted_not_raised(server) -> None:
    url, _ = server
    requests = requests_of([4]) + requests_of([4], prompt="FAIL")
    report = asyncio.run(benchmark(requests, LoadSpec(url, "fake-model"), show_progress=False))
    assert report["completed"] == 1 and report["failed"] == 1
    assert "HTTP 500" in report["errors"][0]


def test_max_concurrency_bounds_requests_in_flight(server) -> None:
    url, app = server
    app.state.max_in_flight = 0
    spec = LoadSpec(url, "fake-model", max_concurrency=2)
    report = asyncio.run(benchmark(requests_of([5] * 6), spec, show_progress=False))
    assert report["completed"] == 6 and app.state.max_in_flight <= 2


def test_tight_slo_gives_zero_goodput(server) -> None:
    url, _ = server
    report = asyncio.run(benchmark(requests_of([10, 10]), LoadSpec(url, "fake-model"),
                                   Slo(tpot_ms=0.001), False))
    assert report["good_requests"] == 0 and report["goodput"] == 0.0


def test_arrivals_are_poisson_on_average_and_instant_at_inf() -> None:
    assert arrival_delays(5, float("inf"), 1.0, 0) == [0.0] * 5
    gaps = arrival_delays(4000, 10.0, 1.0, 0)
    assert sum(gaps) / len(gaps) == pytest.approx(0.1, rel=0.06)
    bursty = arrival_delays(4000, 10.0, 0.25, 0)
    assert sum(bursty) / len(bursty) == pytest.approx(0.1, rel=0.15)
    assert max(bursty) > max(gaps)  # same mean, heavier tail


def test_request_body_variants() -> None:
    r = BenchRequest(7, prompt_token_ids=(5, 6), prompt="hi there")
    assert request_body(r, LoadSpec("u", "m"))["prompt"] == "hi there"
    assert request_body(r, LoadSpec("u", "m", use_token_ids=True))["prompt"] == [5, 6]
    chat = request_body(r, LoadSpec("u", "m", endpoint="chat"))
    assert chat["messages"] == [{"role": "user", "content": "hi there"}] and chat["max_tokens"] == 7


def test_bench_serve_loads_no_engine_and_no_torch() -> None:
    """It must be able to measure other servers: importing it pulls in nothing of the engine."""
    import subprocess
    import sys

    code = ("import sys, cobatch.bench.serve; "
            "print([m for m in ('torch', 'cobatch.engine', 'cobatch.scheduler', 'cobatch.runner') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
