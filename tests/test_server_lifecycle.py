"""Server lifecycle under a real process: overload (429), SIGTERM drain, quiet stops, watchdog, engine death."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server_process import ServerProcess, metric

COMPLETIONS = "/v1/completions"
LONG = {"prompt": "Keep going", "ignore_eos": True, "temperature": 0}


def start(model_dir: Path, tmp: Path, *flags: str) -> ServerProcess:
    proc = ServerProcess(model_dir, tmp / "server.log", "--num-kv-blocks", "64",
                         "--max-model-len", "256", *flags)
    proc.wait_ready()
    return proc


def first_event(lines: Iterator[str]) -> dict[str, object]:
    return json.loads(next(line for line in lines if line.startswith("data: "))[6:])


def wait_metric(base_url: str, name: str, value: float, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(httpx.get(f"{base_url}/metrics").text, name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def bounded(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start(tiny_model_dir, tmp_path_factory.mktemp("bounded"), "--max-num-seqs", "1",
                 "--max-queued-requests", "1", "--shutdown-timeout", "20",
                 "--enable-fault-injection")
    # Every step sleeps 20 ms: the tiny model would otherwise finish anything in milliseconds.
    httpx.post(f"{proc.base_url}/debug/fault",
               json={"kind": "stall", "seconds": 0.02, "num_steps": 100_000})
    yield proc
    proc.stop()


def test_overload_gets_429_with_retry_after(bounded: ServerProcess) -> None:
    url = bounded.base_url
    with httpx.stream("POST", f"{url}{COMPLETIONS}", json={**LONG, "max_tokens": 200,
                                                          "stream": True}, timeout=30) as running:
        lines = running.iter_lines()  # kept: a dropped iterator closes the connection
        first_event(lines)  # holds the only seat
        queued = threading.Thread(target=httpx.post, args=(f"{url}{COMPLETIONS}",),
                                  kwargs={"json": {**LONG, "max_tokens": 2}, "timeout": 30})
        queued.start()
        wait_metric(url, "cobatch:num_requests_waiting", 1.0)
        for stream in (False, True):
            response = httpx.post(f"{url}{COMPLETIONS}", json={"prompt": "x", "stream": stream})
            assert response.status_code == 429, response.text
            assert int(response.headers["Retry-After"]) >= 1
            assert response.json()["error"]["code"] == "rate_limit_exceeded"
    queued.join(timeout=30)  # the seat freed by the disconnect goes to the queued request
    wait_metric(url, "cobatch:num_requests_waiting", 0.0)
    assert httpx.post(f"{url}{COMPLETIONS}", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_sigterm_drains_in_flight_then_exits_0(bounded: ServerProcess) -> None:
    url = bounded.base_url
    body = {**LONG, "max_tokens": 100, "stream": True}
    with httpx.stream("POST", f"{url}{COMPLETIONS}", json=body, timeout=30) as response:
        lines = response.iter_lines()
        first_event(lines)
        bounded.signal()
        wait_health(url, 503)
        refused = httpx.post(f"{url}{COMPLETIONS}", json={"prompt": "late", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["message"]
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert bounded.wait() == 0


def wait_health(url: str, status: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{url}/health").status_code != status:
        assert time.monotonic() < deadline, f"/health never answered {status}"
        time.sleep(0.02)


def assert_quiet_exit(proc: ServerProcess) -> None:
    """Exit 0 and a log with no traceback and no ERROR line."""
    assert proc.wait() == 0
    log = proc.log()
    assert "Traceback" not in log and "ERROR" not in log, log


@pytest.mark.parametrize("signals", [(signal.SIGTERM,), (signal.SIGINT,), (signal.SIGTERM, signal.SIGINT)],
                         ids=["sigterm", "sigint", "sigterm-then-sigint"])
def test_a_stop_after_a_clean_drain_is_quiet(tiny_model_dir: Path, tmp_path: Path,
                                             signals: tuple[int, ...]) -> None:
    """A second signal once stopping changes nothing (it used to skip the lifespan's shutdown)."""
    proc = start(tiny_model_dir, tmp_path)
    try:
        assert httpx.post(f"{proc.base_url}{COMPLETIONS}", json={"prompt": "x", "max_tokens": 2},
                          timeout=30).status_code == 200
        for sig in signals:
            proc.signal(sig)
        assert_quiet_exit(proc)
    finally:
        proc.stop()


def test_a_second_signal_aborts_the_drain_quietly(tiny_model_dir: Path, tmp_path: Path) -> None:
    proc = start(tiny_model_dir, tmp_path, "--enable-fault-injection", "--shutdown-timeout", "60")
    try:
        url = proc.base_url
        httpx.post(f"{url}/debug/fault", json={"kind": "stall", "seconds": 0.05, "num_steps": 100_000})
        with httpx.stream("POST", f"{url}{COMPLETIONS}", json={**LONG, "max_tokens": 200,
                                                              "stream": True}, timeout=30) as resp:
            lines = resp.iter_lines()
            first_event(lines)
            proc.signal(signal.SIGTERM)
            wait_health(url, 503)  # draining: the request goes on
            proc.signal(signal.SIGINT)  # impatient: stop now
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        assert_quiet_exit(proc)
    finally:
        proc.stop()


def test_watchdog_and_drain_timeout_abort(tiny_model_dir: Path, tmp_path: Path) -> None:
    proc = start(tiny_model_dir, tmp_path, "--enable-fault-injection", "--watchdog-timeout", "0.5",
                 "--shutdown-timeout", "0.5")
    try:
        url = proc.base_url
        httpx.post(f"{url}/debug/fault", json={"kind": "stall", "seconds": 2.0})
        with httpx.stream("POST", f"{url}{COMPLETIONS}", json={**LONG, "max_tokens": 100,
                                                              "stream": True}, timeout=30) as resp:
            wait_health(url, 503)  # the stalled step trips the watchdog
            # Then slow (not stalled) steps, so the request is still running when the drain starts: at
            # full speed the tiny model would finish its tokens before the second stall arrives.
            httpx.post(f"{url}/debug/fault", json={"kind": "stall", "seconds": 0.05, "num_steps": 1000})
            wait_health(url, 200)  # and it recovers when steps resume
            lines = resp.iter_lines()
            first_event(lines)
            httpx.post(f"{url}/debug/fault", json={"kind": "stall", "seconds": 2.0})
            proc.signal()  # the drain (0.5 s) times out while the step stalls: the rest is aborted
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        assert proc.wait() == 0
    finally:
        proc.stop()


def test_engine_death_fails_fast_and_exits_nonzero(tiny_model_dir: Path, tmp_path: Path) -> None:
    proc = start(tiny_model_dir, tmp_path, "--enable-fault-injection")
    try:
        url = proc.base_url
        with httpx.stream("POST", f"{url}{COMPLETIONS}", json={**LONG, "max_tokens": 200,
                                                              "stream": True}, timeout=30) as resp:
            lines = resp.iter_lines()
            first_event(lines)
            httpx.post(f"{url}/debug/fault", json={"kind": "engine_death"})
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
        assert httpx.get(f"{url}/health").status_code == 503
        start_time = time.monotonic()
        refused = httpx.post(f"{url}{COMPLETIONS}", json={"prompt": "x"}, timeout=5)
        assert refused.status_code == 503 and time.monotonic() - start_time < 1.0
        assert proc.wait(timeout_s=15) == 1
    finally:
        proc.stop()
