"""`cobatch serve MODEL --replicas 2` as a process: it serves, and SIGTERM drains without losing a request."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve")

from tests.server_process import ServerProcess  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_sigterm_lets_the_stream_in_flight_finish_then_exits_0(tiny_model_dir: Path,
                                                                tmp_path: Path) -> None:
    server = ServerProcess(tiny_model_dir, tmp_path / "serve.log", "--replicas", "2",
                           "--num-kv-blocks", "128", "--max-num-batched-tokens", "64",
                           "--enable-fault-injection")
    try:
        server.wait_ready(timeout_s=180.0)
        models = httpx.get(f"{server.base_url}/v1/models", timeout=10.0).json()
        assert models["data"][0]["id"] == tiny_model_dir.name
        # Slow steps, so that the request is still streaming when the signal comes.
        httpx.post(f"{server.base_url}/debug/fault", json={"kind": "stall", "seconds": 0.01,
                                                           "num_steps": 100_000}, timeout=30.0)
        body = {"prompt": "drain me", "max_tokens": 120, "ignore_eos": True, "stream": True}
        events: list[str] = []
        first = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                              timeout=120.0) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60.0)
        server.signal(signal.SIGTERM)
        reader.join(120.0)
        assert server.wait(90.0) == 0
    finally:
        server.stop()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    log = (tmp_path / "serve.log").read_text(errors="replace")
    assert "SIGTERM received" not in log and "shutting down" in log  # ours, not Ray's handler
