#!/usr/bin/env python3
"""Soak test: minutes of Poisson load with mixed lengths, disconnects and bad requests on a real server.

Starts `cobatch serve` (the default model unless --model), drives it over HTTP only, and records the
server's resident memory (/proc/<pid>/status VmRSS), /metrics at idle (leaked KV blocks show as usage
> 0 with nothing running) and every 5xx. Writes JSON and prints a markdown block for docs/BENCHMARKS.md.

    .venv/bin/python scripts/soak.py --minutes 10 --rate 1     # -> out/soak.json, out/soak-server.log
    .venv/bin/python scripts/soak.py --minutes 3 -- --max-num-seqs 16   # extra serve flags after --
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from cobatch.testing.server import free_port, wait_ready

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the quick brown fox jumps over a lazy dog while seven wise owls count stars above "
         "quiet rivers and distant mountains").split()
BAD_BODIES: tuple[bytes, ...] = (
    b'{"prompt": "x", ',  # invalid JSON
    b'{"prompt": "x", "temperature": NaN}',
    b'{"prompt": "x", "frobnicate": 1}',
    b'{"prompt": [1, 2, 99999999]}',
    b'{"prompt": "x", "max_tokens": 100000}',
    b'{"messages": []}',
    b'{"prompt": "x", "logit_bias": {"5": 1e999}}',
    b'{"prompt": "x", "max_tokens": 1, "user": "\\nINFO forged", "n": 0}',
)


@dataclass(slots=True)
class Tally:
    """Outcome counts of the load generator."""

    sent: int = 0
    ok: int = 0
    client_errors: int = 0  # 4xx, expected for the bad requests
    server_errors: int = 0  # 5xx: must stay 0
    disconnects: int = 0  # the client gave up on purpose
    transport_errors: int = 0
    unexpected_ok_for_bad: int = 0
    latencies_s: list[float] = field(default_factory=list)
    server_error_samples: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Sample:
    """One periodic reading of the server process."""

    t_s: float
    rss_mib: float
    running: float
    waiting: float
    kv_usage: float


def rss_mib(pid: int) -> float:
    """Resident memory of `pid` in MiB, from /proc (psutil is not a dependency)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else float("nan")


def start_server(args: argparse.Namespace, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "cobatch.server.cli", *([args.model] if args.model else []),
           "--port", str(port), "--log-level", "warning", *args.server_args]
    log = open(log_path, "wb")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


# ---- load -------------------------------------------------------------------------------------------

def good_request(rng: random.Random) -> tuple[str, dict[str, object]]:
    """A valid request of mixed shape: completion or chat, short or long, streamed or not."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(int(rng.lognormvariate(3.0, 1.0)) + 1))
    prompt = " ".join(prompt.split()[:400])
    common = {"max_tokens": rng.choice([4, 16, 32, 64, 128]), "temperature": rng.choice([0.0, 0.8]),
              "stream": rng.random() < 0.5, "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.5:
        return "/v1/completions", {"prompt": prompt, **common}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **common}


async def send_good(client: httpx.AsyncClient, rng: random.Random, tally: Tally,
                    disconnect_after_s: float | None) -> None:
    path, body = good_request(rng)
    start = time.monotonic()
    try:
        response = await asyncio.wait_for(client.post(path, json=body), disconnect_after_s)
    except asyncio.TimeoutError:
        tally.disconnects += 1
        return
    except httpx.HTTPError:
        tally.transport_errors += 1
        return
    record(tally, response, expect_ok=True)
    if response.status_code == 200:
        tally.latencies_s.append(time.monotonic() - start)


async def send_bad(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    body = rng.choice(BAD_BODIES)
    try:
        response = await client.post("/v1/completions", content=body,
                                     headers={"Content-Type": "application/json"})
    except httpx.HTTPError:
        tally.transport_errors += 1
        return
    record(tally, response, expect_ok=False)


def record(tally: Tally, response: httpx.Response, expect_ok: bool) -> None:
    status = response.status_code
    if status >= 500:
        tally.server_errors += 1
        tally.server_error_samples = (tally.server_error_samples + [response.text[:300]])[:10]
    elif status >= 400:
        tally.client_errors += 1
    else:
        tally.ok += 1
        tally.unexpected_ok_for_bad += not expect_ok


async def one_request(client: httpx.AsyncClient, rng: random.Random, tally: Tally,
                      args: argparse.Namespace) -> None:
    tally.sent += 1
    draw = rng.random()
    if draw < args.bad_share:
        await send_bad(client, rng, tally)
    elif draw < args.bad_share + args.disconnect_share:
        await send_good(client, rng, tally, disconnect_after_s=rng.uniform(0.05, 2.0))
    else:
        await send_good(client, rng, tally, disconnect_after_s=None)


async def drive(base_url: str, args: argparse.Namespace, tally: Tally, stop_at: float) -> None:
    """Poisson arrivals at args.rate per second until stop_at; waits for the stragglers."""
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=50)
    async with httpx.AsyncClient(base_url=base_url, timeout=600.0, limits=limits) as client:
        tasks: set[asyncio.Task[None]] = set()
        while time.monotonic() < stop_at:
            await asyncio.sleep(rng.expovariate(args.rate))
            task = asyncio.ensure_future(one_request(client, rng, tally, args))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)


async def sample_forever(base_url: str, pid: int, t0: float, samples: list[Sample],
                         interval_s: float) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=30.0) as client:
        while True:
            text = (await client.get("/metrics")).text
            samples.append(Sample(round(time.monotonic() - t0, 1), round(rss_mib(pid), 1),
                                  metric(text, "cobatch:num_requests_running"),
                                  metric(text, "cobatch:num_requests_waiting"),
                                  metric(text, "cobatch:kv_cache_usage_perc")))
            await asyncio.sleep(interval_s)


# ---- report ---------------------------------------------------------------------------------------

def idle_metrics(base_url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits; the KV usage then is what leaked."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
        values = {name: metric(text, f"cobatch:{name}") for name in (
            "num_requests_running", "num_requests_waiting", "num_requests_swapped",
            "kv_cache_usage_perc", "num_preemptions_total")}
        idle = values["num_requests_running"] == 0 and values["num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            values["reached_idle"] = float(idle)
            return values
        time.sleep(0.5)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def rss_drift(samples: list[Sample], warmup_s: float) -> dict[str, float]:
    """Resident memory after warm-up: first vs last minute (mean), and the peak."""
    after = [s for s in samples if s.t_s >= warmup_s]
    if len(after) < 4:
        return {"rss_first_mib": float("nan"), "rss_last_mib": float("nan"), "drift_pct": float("nan")}
    span = max(1, len(after) // 5)
    first = sum(s.rss_mib for s in after[:span]) / span
    last = sum(s.rss_mib for s in after[-span:]) / span
    return {"rss_first_mib": round(first, 1), "rss_last_mib": round(last, 1),
            "rss_peak_mib": max(s.rss_mib for s in after),
            "drift_pct": round(100.0 * (last - first) / first, 2)}


def markdown(report: dict[str, object]) -> str:
    t, idle, rss = report["tally"], report["idle"], report["rss"]  # type: ignore[index]
    return "\n".join([
        f"Soak: {report['minutes']} min, Poisson {report['rate']} req/s, model {report['model']}, "
        f"{report['date']}",
        "",
        "| requests | ok | 4xx (bad input) | 5xx | client disconnects | p50 / p99 latency (s) "
        "| RSS after warm-up: first -> last (drift) | KV usage at idle | running / waiting at idle |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {t['sent']} | {t['ok']} | {t['client_errors']} | {t['server_errors']} | "
        f"{t['disconnects']} | {report['p50_s']:.2f} / {report['p99_s']:.2f} | "
        f"{rss['rss_first_mib']} -> {rss['rss_last_mib']} MiB ({rss['drift_pct']:+.2f}%) | "
        f"{idle['kv_cache_usage_perc']:.3f} | {idle['num_requests_running']:.0f} / "
        f"{idle['num_requests_waiting']:.0f} |"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--warmup-minutes", type=float, default=1.0)
    parser.add_argument("--rate", type=float, default=1.0, help="mean arrivals per second")
    parser.add_argument("--bad-share", type=float, default=0.1, help="share of malformed requests")
    parser.add_argument("--disconnect-share", type=float, default=0.15,
                        help="share of clients that give up after 0.05-2 s")
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-interval", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=Path("out/soak.json"))
    parser.add_argument("--log", type=Path, default=Path("out/soak-server.log"))
    parser.add_argument("server_args", nargs="*", help="extra `cobatch serve` flags (after --)")
    return parser.parse_args(argv)


async def soak(base_url: str, pid: int, args: argparse.Namespace) -> tuple[Tally, list[Sample]]:
    tally, samples = Tally(), []
    t0 = time.monotonic()
    sampler = asyncio.ensure_future(sample_forever(base_url, pid, t0, samples, args.sample_interval))
    await drive(base_url, args, tally, t0 + args.minutes * 60.0)
    sampler.cancel()
    return tally, samples


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    proc = start_server(args, port, args.log)
    try:
        wait_ready(base_url, proc, timeout_s=300.0, log_path=args.log)
        tally, samples = asyncio.run(soak(base_url, proc.pid, args))
        idle = idle_metrics(base_url)
        time.sleep(args.sample_interval)  # one more RSS reading at idle
        samples.append(Sample(samples[-1].t_s + args.sample_interval if samples else 0.0,
                              round(rss_mib(proc.pid), 1), idle["num_requests_running"],
                              idle["num_requests_waiting"], idle["kv_cache_usage_perc"]))
    finally:
        proc.terminate()
        exit_code = proc.wait(timeout=60)
    report = {
        "date": time.strftime("%Y-%m-%d"), "minutes": args.minutes, "rate": args.rate,
        "model": args.model or "SmolLM2-135M-Instruct (default)", "server_exit_code": exit_code,
        "tally": {k: v for k, v in asdict(tally).items() if k != "latencies_s"},
        "p50_s": percentile(tally.latencies_s, 0.5), "p99_s": percentile(tally.latencies_s, 0.99),
        "idle": idle, "rss": rss_drift(samples, args.warmup_minutes * 60.0),
        "samples": [asdict(s) for s in samples]}
    report["markdown"] = markdown(report)
    args.out.write_text(json.dumps(report, indent=1))
    print(report["markdown"])
    healthy = tally.server_errors == 0 and idle["kv_cache_usage_perc"] == 0.0 and exit_code == 0
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
