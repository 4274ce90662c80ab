"""The real server (tiny model) under load, overload, a storm of impatient clients, a scheduler that
stops making progress, and the determinism a client can observe (batch, stream, seed)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server_process import ServerProcess, metric
from tests.test_server import sse_events, wait_idle

COMPLETIONS = "/v1/completions"
SHORT = {"prompt": "Hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("reliability") / "server.log"
    proc = ServerProcess(tiny_model_dir, log, "--max-num-seqs", "64", "--num-kv-blocks", "1024",
                         "--max-model-len", "256", "--enable-fault-injection",
                         "--watchdog-timeout", "2", "--log-level", "warning")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture()
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30.0) as client:
        yield client


def async_client(server: ServerProcess, timeout_s: float = 60.0) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=0)
    return httpx.AsyncClient(base_url=server.base_url, timeout=timeout_s, limits=limits)


class HealthWatcher(threading.Thread):
    """Polls /health every 50 ms from its own thread (and connection) until stopped: the probe's
    latency is the server's, not the wait of a client event loop busy with hundreds of requests."""

    def __init__(self, server: ServerProcess) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.stop_event = threading.Event()
        self.samples: list[tuple[int, float]] = []

    def run(self) -> None:
        with httpx.Client(base_url=self.server.base_url, timeout=10.0) as client:
            while not self.stop_event.is_set():
                start = time.monotonic()
                status = client.get("/health").status_code
                self.samples.append((status, time.monotonic() - start))
                self.stop_event.wait(0.05)

    def stop(self) -> list[tuple[int, float]]:
        self.stop_event.set()
        self.join()
        return self.samples


# ---- load ---------------------------------------------------------------------------------------

def test_500_concurrent_requests_succeed_and_health_stays_fast(server: ServerProcess) -> None:
    async def main() -> list[httpx.Response]:
        async with async_client(server) as client:
            body = lambda i: {**SHORT, "prompt": f"Request number {i}", "stream": i % 5 == 0}
            return await asyncio.gather(*(client.post(COMPLETIONS, json=body(i)) for i in range(500)))

    watcher = HealthWatcher(server)
    watcher.start()
    responses = asyncio.run(main())
    health = watcher.stop()
    statuses = [r.status_code for r in responses]
    assert statuses == [200] * 500, {s: statuses.count(s) for s in set(statuses)}
    assert all(r.text.rstrip().endswith("[DONE]") if i % 5 == 0 else r.json()["choices"]
               for i, r in enumerate(responses))
    assert len(health) >= 2 and all(status == 200 for status, _ in health), health
    # A kubelet with default probe settings (timeout 1 s, failureThreshold 3) must never restart the
    # server: no 3 probes in a row over 1 s. (One slow probe alone happens on a busy 2-core machine: the
    # probe thread shares this process's GIL with the 500 requests' client side.)
    slow = [seconds >= 1.0 for _, seconds in health]
    assert not any(all(slow[i:i + 3]) for i in range(len(slow) - 2)), \
        f"/health over 1 s three times in a row under load: {[round(s, 2) for _, s in health]}"
    assert sorted(seconds for _, seconds in health)[len(health) // 2] < 0.5, health  # typically fast
    with httpx.Client(base_url=server.base_url) as http:
        wait_idle(http)


def test_a_storm_of_impatient_clients_leaves_nothing_behind(server: ServerProcess,
                                                            http: httpx.Client) -> None:
    """200 clients give up after 0.5 s (stream and not); the server recovers at once."""
    http.post("/debug/fault", json={"kind": "stall", "seconds": 0.02, "num_steps": 100_000})
    try:
        async def impatient(client: httpx.AsyncClient, i: int) -> int:
            body = {**SHORT, "max_tokens": 200, "stream": i % 2 == 0}
            # A total deadline: httpx's own timeout is per read, and a stream reads every step.
            return (await asyncio.wait_for(client.post(COMPLETIONS, json=body), 0.5)).status_code

        async def storm() -> list[BaseException | int]:
            async with async_client(server) as client:
                return await asyncio.gather(*(impatient(client, i) for i in range(200)),
                                            return_exceptions=True)

        results = asyncio.run(storm())
        assert all(isinstance(r, asyncio.TimeoutError) for r in results), results
        start = time.monotonic()
        fresh = http.post(COMPLETIONS, json=SHORT, timeout=5.0)
        assert fresh.status_code == 200 and time.monotonic() - start < 5.0
    finally:
        http.post("/debug/fault", json={"kind": "clear"})
    text = wait_idle(http, timeout_s=10.0)  # running = waiting = 0, KV usage 0
    assert metric(text, "cobatch:num_requests_swapped") == 0.0


def test_no_progress_with_live_work_trips_the_watchdog(server: ServerProcess,
                                                       http: httpx.Client) -> None:
    """Steps keep running but schedule nothing: /health must say so, then recover."""
    http.post("/debug/fault", json={"kind": "no_progress", "seconds": 3.5})
    with http.stream("POST", COMPLETIONS, json={**SHORT, "stream": True}) as response:
        deadline = time.monotonic() + 3.0
        while http.get("/health").status_code == 200:
            assert time.monotonic() < deadline, "the watchdog never noticed"
            time.sleep(0.05)
        events = sse_events(response)  # the scheduler resumes and the request completes
    assert events[-1] == "[DONE]" and '"finish_reason":"length"' in events[-2]
    assert http.get("/health").status_code == 200


# ---- overload --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bounded(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("bounded-burst") / "server.log"
    proc = ServerProcess(tiny_model_dir, log, "--max-num-seqs", "2", "--num-kv-blocks", "64",
                         "--max-model-len", "256", "--max-queued-requests", "4",
                         "--enable-fault-injection", "--log-level", "warning")
    try:
        proc.wait_ready()
        httpx.post(f"{proc.base_url}/debug/fault",
                   json={"kind": "stall", "seconds": 0.01, "num_steps": 100_000})
        yield proc
    finally:
        proc.stop()


def test_a_burst_over_the_queue_bound_gets_429s_and_the_rest_complete(bounded: ServerProcess) -> None:
    async def burst() -> list[httpx.Response]:
        async with async_client(bounded) as client:
            body = lambda i: {**SHORT, "max_tokens": 16, "stream": i % 2 == 1}
            return await asyncio.gather(*(client.post(COMPLETIONS, json=body(i))
                                          for i in range(60)))

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert set(statuses) == {200, 429}, statuses
    # At least the queue's four places: adds the engine has not seen yet count as queued, so a
    # burst can fill the queue before the engine moves anyone to a seat.
    assert statuses.count(200) >= 4
    refused = [(i, r) for i, r in enumerate(responses) if r.status_code == 429]
    assert any(i % 2 == 1 for i, _ in refused), "a streaming request must be refused too"
    for _, response in refused:
        assert int(response.headers["Retry-After"]) >= 1
        assert response.json()["error"]["type"] == "rate_limit_error"
    with httpx.Client(base_url=bounded.base_url) as http:
        wait_idle(http, timeout_s=10.0)


# ---- determinism through the server -----------------------------------------------------------------

def _texts(server: ServerProcess, bodies: list[dict[str, object]]) -> list[str]:
    """The completion text of each body, all sent at once (streamed ones joined from chunks)."""
    async def send() -> list[httpx.Response]:
        async with async_client(server) as client:
            return await asyncio.gather(*(client.post(COMPLETIONS, json=b) for b in bodies))

    texts = []
    for body, response in zip(bodies, asyncio.run(send()), strict=True):
        assert response.status_code == 200, response.text
        if body.get("stream"):
            events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
            texts.append("".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"]))
        else:
            texts.append(response.json()["choices"][0]["text"])
    return texts


def test_greedy_and_seeded_answers_do_not_depend_on_the_batch_or_streaming(
        server: ServerProcess) -> None:
    greedy = {"prompt": "The history of", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    seeded = {"prompt": "A poem:", "max_tokens": 24, "temperature": 1.0, "seed": 42,
              "ignore_eos": True}
    alone = _texts(server, [greedy]) + _texts(server, [seeded])
    noise = [{"prompt": f"Noise {i}", "max_tokens": 8 + i, "temperature": 1.0, "ignore_eos": True}
             for i in range(28)]
    batch = [greedy, {**greedy, "stream": True}, seeded, {**seeded, "stream": True}, *noise]
    together = _texts(server, batch)[:4]
    assert together == [alone[0], alone[0], alone[1], alone[1]]
    assert len(set(_texts(server, [{**seeded, "seed": s} for s in (1, 2, 3)]))) > 1  # seeds matter
