"""Driving a real `cobatch serve` process from tests and the soak script: a free port, wait for ready."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx

_LOG_TAIL_CHARS = 4000


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(base_url: str, proc: subprocess.Popen[bytes], timeout_s: float,
               log_path: Path | None = None) -> None:
    """Poll /health until 200; RuntimeError if the process exits first, TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}{_log_tail(log_path)}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.1)
    raise TimeoutError(f"the server was not ready after {timeout_s} s{_log_tail(log_path)}")


@contextmanager
def running_server(cmd: list[str], base_url: str, log_path: Path, ready_timeout_s: float,
                   env: Mapping[str, str] | None = None,
                   cwd: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A server process (any: cobatch serve, llama-server) logging to `log_path`, ready at `base_url`'s
    /health for the block, terminated after it."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))
        try:
            wait_ready(base_url, proc, ready_timeout_s, log_path)
            yield proc
        finally:
            terminate(proc, timeout_s=30)


def terminate(proc: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    """SIGTERM a server that is still running, SIGKILL it after `timeout_s`; its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _log_tail(log_path: Path | None) -> str:
    if log_path is None or not log_path.exists():
        return ""
    return ":\n" + log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
