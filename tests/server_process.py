"""A real `cobatch serve` process on loopback, for the server tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai

from cobatch.testing.server import free_port, terminate, wait_ready

ROOT = Path(__file__).resolve().parent.parent


class ServerProcess:
    """Starts `python -m cobatch.server.cli MODEL --port P FLAGS...` and waits for /health."""

    def __init__(self, model_dir: Path, log_path: Path, *flags: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "cobatch.server.cli", str(model_dir), "--port", str(self.port),
               "--dtype", "float32", "--num-threads", "1", *flags]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        wait_ready(self.base_url, self.proc, timeout_s, self.log_path)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float = 30.0) -> int:
        return self.proc.wait(timeout=timeout_s)

    def stop(self) -> int | None:
        returncode = terminate(self.proc, timeout_s=20)
        self._log.close()
        return returncode


@contextmanager
def serving(model_dir: Path, log_path: Path, *flags: str) -> Iterator[ServerProcess]:
    """A ready server for the `with` block, stopped after it (a module fixture's body)."""
    proc = ServerProcess(model_dir, log_path, *flags)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def tiny_server(model_dir: Path, log_path: Path, max_num_seqs: int, *flags: str) -> Iterator[ServerProcess]:
    """`serving` the tiny test model as "tiny" with fault injection: 64 KV blocks, 256-token context (the body
    of a module fixture: `yield from tiny_server(...)`)."""
    with serving(model_dir, log_path, "--max-num-seqs", str(max_num_seqs), "--num-kv-blocks", "64",
                 "--max-model-len", "256", "--served-model-name", "tiny", "--enable-fault-injection",
                 *flags) as proc:
        yield proc


def metric(text: str, name: str) -> float:
    """The value of one (label-filtered by model_name only) sample in a Prometheus exposition."""
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def openai_client(proc: ServerProcess, api_key: str = "none") -> openai.OpenAI:
    """The official client on the server's /v1, without retries (a test sees every error as it came)."""
    return openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key=api_key, max_retries=0)
