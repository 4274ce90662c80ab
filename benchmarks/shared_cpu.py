"""`python -m benchmarks.shared_cpu`: served tokens/s on an idle CPU and beside a busy neighbour, in one run.

Each setup is one `cobatch serve` process (the default model, or --model's GGUF file / HF folder), all up
at once (idle servers take no CPU), measured in turn so they share the machine's noise. Against each,
alternating in one run:

    single   one stream: --num-single requests one after another (concurrency 1)
    batch    --batch-size requests at once (all decoding together)

each first with the machine as it is ("idle"), then with a busy neighbour beside the server: one
pure-Python spin loop, pinned nowhere, so it competes for every core like a real neighbour (a sidecar,
another tenant, the client itself). Ratio = busy tok/s / idle tok/s of the same load in the same
repeat; the load average before each measurement is recorded with it (the machine is shared). The
client is `cobatch bench serve`'s, in this process. Results: docs/bench/shared_cpu.json + a plot.

    .venv/bin/python -m benchmarks.shared_cpu [--repeats 3] [--setups fixed,adaptive] [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from cobatch.bench.common import write_json
from cobatch.bench.datasets import BenchRequest, LengthSpec, WorkloadSpec, synthesize
from cobatch.bench.serve import LoadSpec, benchmark, resolve_model
from cobatch.runner.cpu_usage import read_cpu_sample, usable_cpus
from cobatch.testing.server import free_port, running_server

ROOT = Path(__file__).resolve().parent.parent
_READY_TIMEOUT_S = 300.0
_SETTLE_S = 0.5  # the neighbour is running and the scheduler has seen it before the load starts
_COMMON_FLAGS = ("--kv-cache-memory-gb", "0.5")  # plenty for these loads; several servers fit in memory
_QUIET_CORES = 0.3  # an "idle" measurement waits (a while) for the other sessions' work to drop below this
# ... over this many 1 s windows in a row: "idle" is a machine that has been idle, not one whose
# neighbour (or the other setup's server) left a moment ago; the adaptive policy takes a thread back
# ~2 s after that when the server is idle (one idle poll, then up_after_s), and that lag is not idle speed.
_QUIET_WINDOWS = 3
_SPIN = "while True:\n    pass\n"
_THREAD_CHANGE = re.compile(r"compute threads (\d+ -> \d+)")


@dataclass(frozen=True, slots=True)
class Setup:
    """One server configuration: `cobatch serve` flags and extra environment."""

    name: str
    flags: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


SETUPS = {
    # Today's behaviour before the thread policy: the machine's threads, whatever the load.
    "fixed": Setup("fixed", ("--thread-policy", "fixed")),
    "adaptive": Setup("adaptive", ("--thread-policy", "adaptive")),
    "one-thread": Setup("one-thread", ("--thread-policy", "fixed", "--num-threads", "1")),
    "passive": Setup("passive", ("--thread-policy", "fixed"), (("OMP_WAIT_POLICY", "PASSIVE"),)),
}


@dataclass(slots=True)
class ServerLog:
    """A running server's URL and log; the thread policy's changes it logged since the last call."""

    base_url: str
    path: Path
    pid: int
    read_chars: int = 0

    def thread_changes(self) -> list[str]:
        text = self.path.read_text(errors="replace")
        new, self.read_chars = text[self.read_chars:], len(text)
        return _THREAD_CHANGE.findall(new)


@contextmanager
def server(setup: Setup, log_dir: Path, model: str | None) -> Iterator[ServerLog]:
    """`cobatch serve` (`model`, or the default model) on a free port for the block, logging at info."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log_path = log_dir / f"shared_cpu-{setup.name}.log"
    cmd = [sys.executable, "-m", "cobatch.cli", "serve", "--port", str(port), "--log-level", "info",
           *_COMMON_FLAGS, *setup.flags, *(("--model", model) if model else ())]
    with running_server(cmd, base_url, log_path, _READY_TIMEOUT_S, dict(setup.env), ROOT) as proc:
        yield ServerLog(base_url, log_path, proc.pid)


@contextmanager
def busy_neighbour(enabled: bool) -> Iterator[int | None]:
    """A spin loop in its own process for the block, its pid (nothing, None, when not enabled)."""
    if not enabled:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-c", _SPIN])
    try:
        time.sleep(_SETTLE_S)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def workload(num: int, output_len: int, input_len: int, seed: int) -> list[BenchRequest]:
    """`num` requests of `input_len` random token ids, exactly `output_len` tokens each."""
    spec = WorkloadSpec(num, LengthSpec(((input_len, input_len),)), LengthSpec(((output_len, output_len),)),
                        seed=seed)
    return synthesize(spec)


def measure(log: ServerLog, model: str, requests: list[BenchRequest], concurrency: int,
            busy: bool) -> dict[str, object]:
    """One load, idle or beside the neighbour: output tok/s, its TPOT, the load average before it and
    the thread changes the server logged (the policy's, "2 -> 1"), and the CPU this client used (cores)."""
    load_1m = os.getloadavg()[0]
    log.thread_changes()  # from here on
    spec = LoadSpec(log.base_url, model, max_concurrency=concurrency, use_token_ids=True, timeout_s=300.0)
    with busy_neighbour(busy) as neighbour:
        meter = CpuMeter({"server": log.pid, **({"neighbour": neighbour} if neighbour else {})})
        start = meter.read()
        report = asyncio.run(benchmark(requests, spec, show_progress=False))
        cores = meter.cores(start, meter.read())
    if report["failed"]:
        raise RuntimeError(f"{report['failed']} requests failed: {report['errors']}")
    return {"tok_s": report["output_throughput"], "tpot_ms_p50": report["tpot_ms"]["p50"],
            "loadavg_1m": load_1m, "cores": cores, "thread_changes": log.thread_changes()}


class CpuMeter:
    """Who used the CPUs over a measurement, in cores: the server, this client, the neighbour, and the
    background (every other process on this shared machine: what makes "idle" not idle)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids, self.cpus = pids, usable_cpus()

    def read(self) -> dict[str, float]:
        sample = read_cpu_sample(self.cpus)
        assert sample is not None, "needs Linux's /proc/stat"
        return {"time": sample.time_s, "busy": sample.busy_s, "client": sample.own_s,
                **{name: _process_cpu_s(pid) for name, pid in self.pids.items()}}

    def cores(self, start: dict[str, float], end: dict[str, float]) -> dict[str, float]:
        elapsed = end["time"] - start["time"]
        used = {k: (end[k] - start[k]) / elapsed for k in end if k not in ("time", "busy")}
        background = (end["busy"] - start["busy"]) / elapsed - sum(used.values())
        return {**used, "background": max(0.0, background)}


def _process_cpu_s(pid: int) -> float:
    """utime + stime of a process (its threads, not its children), from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(server_pid: int, max_wait_s: float) -> float:
    """Wait (1 s windows, up to max_wait_s) until the background has used under _QUIET_CORES for
    _QUIET_WINDOWS windows in a row; the seconds waited."""
    meter, started, quiet = CpuMeter({"server": server_pid}), time.monotonic(), 0
    while quiet < _QUIET_WINDOWS and time.monotonic() - started < max_wait_s:
        start = meter.read()
        time.sleep(1.0)
        quiet = quiet + 1 if meter.cores(start, meter.read())["background"] < _QUIET_CORES else 0
    return time.monotonic() - started


def loads(args: argparse.Namespace) -> dict[str, tuple[list[BenchRequest], int]]:
    """The two loads: name -> (requests, concurrency)."""
    return {"single": (workload(args.num_single, args.output_len, args.input_len, 0), 1),
            "batch": (workload(args.batch_size, args.output_len, args.input_len, 1), args.batch_size)}


def run_all(setups: list[Setup], args: argparse.Namespace, log_dir: Path) -> dict[str, dict]:
    """Every setup's server up at once (an idle one takes no CPU), warmed up; then per repeat and load,
    each setup in turn, idle then busy: setups compared under the same noise. Medians per setup and load."""
    runs: dict[str, dict[str, list[dict]]] = {s.name: {load: [] for load in loads(args)} for s in setups}
    with ExitStack() as stack:
        logs = {s.name: stack.enter_context(server(s, log_dir, args.model)) for s in setups}
        model = resolve_model(next(iter(logs.values())).base_url, None)
        for log in logs.values():
            for requests, concurrency in loads(args).values():  # warm-up: first steps, allocations
                measure(log, model, requests[:concurrency], concurrency, busy=False)
        for repeat in range(args.repeats):
            for load, (requests, concurrency) in loads(args).items():
                for name, log in logs.items():
                    run = _idle_then_busy(log, model, requests, concurrency, args.quiet_wait_s)
                    runs[name][load].append(run)
                    _print_run(name, load, repeat, run)
    return {s.name: {"flags": list(s.flags), "env": dict(s.env),
                     **{load: {"runs": r, **_medians(r)} for load, r in runs[s.name].items()}}
            for s in setups}


def _idle_then_busy(log: ServerLog, model: str, requests: list[BenchRequest], concurrency: int,
                    quiet_wait_s: float) -> dict:
    waited_s = wait_for_quiet(log.pid, quiet_wait_s)
    idle = measure(log, model, requests, concurrency, busy=False)
    busy = measure(log, model, requests, concurrency, busy=True)
    return {"idle": idle, "busy": busy, "ratio": busy["tok_s"] / idle["tok_s"], "quiet_wait_s": waited_s}


def _print_run(name: str, load: str, repeat: int, run: dict) -> None:
    idle, busy = run["idle"], run["busy"]
    print(f"{name:10s} {load:6s} #{repeat}: idle {idle['tok_s']:7.1f} tok/s (background "
          f"{idle['cores']['background']:.2f} cores, load {idle['loadavg_1m']:.2f})  busy {busy['tok_s']:7.1f} "
          f"tok/s (background {busy['cores']['background']:.2f})  ratio {run['ratio']:.2f}  threads "
          f"{idle['thread_changes']} / {busy['thread_changes']}", flush=True)


def _medians(runs: list[dict]) -> dict[str, float]:
    return {"idle_tok_s": statistics.median(r["idle"]["tok_s"] for r in runs),
            "busy_tok_s": statistics.median(r["busy"]["tok_s"] for r in runs),
            "ratio": statistics.median(r["ratio"] for r in runs)}


def plot(results: dict[str, dict], path: Path, model: str | None) -> None:
    """Idle vs busy tok/s (medians), one group per setup and load, the ratio written above."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, load in zip(axes, ("single", "batch")):
        names = list(results)
        idle = [results[n][load]["idle_tok_s"] for n in names]
        busy = [results[n][load]["busy_tok_s"] for n in names]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], idle, 0.4, label="idle")
        ax.bar([x + 0.2 for x in xs], busy, 0.4, label="busy neighbour")
        for x, n in zip(xs, names):
            ax.annotate(f"{results[n][load]['ratio']:.0%}", (x + 0.2, busy[x]), ha="center", va="bottom")
        ax.set_xticks(list(xs), names)
        ax.set_title("one stream" if load == "single" else "batch of 16")
        ax.set_ylabel("output tok/s")
        ax.legend()
    served = Path(model).name if model else "the default model"
    fig.suptitle(f"cobatch serve ({served}) on 2 cores, idle vs one busy process beside it")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", default="fixed,adaptive", help=f"comma list of {', '.join(SETUPS)}")
    parser.add_argument("--model", help="GGUF file or HF folder to serve (default: the bundled model)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-single", type=int, default=3, help="requests of the one-stream load")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--json", default=str(ROOT / "docs/bench/shared_cpu.json"))
    parser.add_argument("--plot", default=str(ROOT / "docs/img/shared_cpu.png"))
    parser.add_argument("--log-dir", default="/tmp")
    parser.add_argument("--quiet-wait-s", type=float, default=30.0,
                        help="before each idle measurement, wait up to this long for the machine's other "
                             "work to quiet down")
    args = parser.parse_args()
    results = run_all([SETUPS[name] for name in args.setups.split(",")], args, Path(args.log_dir))
    machine = {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
               "date": time.strftime("%Y-%m-%d %H:%M"), "uname": " ".join(os.uname())}
    settings = {k: getattr(args, k) for k in ("model", "repeats", "num_single", "batch_size", "input_len",
                                              "output_len", "quiet_wait_s")}
    print(f"wrote {write_json(args.json, {'machine': machine, 'settings': settings, 'setups': results})}")
    plot(results, Path(args.plot), args.model)
    print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
