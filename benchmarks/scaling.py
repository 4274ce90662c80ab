"""`python -m benchmarks.scaling`: replicas on Ray Serve, measured with `cobatch bench serve` unchanged.

One shared-prefix workload (system prompts x users, token ids, written as JSONL) is replayed by
`cobatch bench serve --dataset` against each configuration, started as `cobatch serve ...`:

    cobatch-2x1   2 replicas x 1 thread, cobatch's router           \
    pow2-2x1      2 replicas x 1 thread, Ray's power of two choices  > same replicas, same KV per replica
    rr-2x1        2 replicas x 1 thread, round robin                /
    cobatch-1x2   1 replica x 2 threads on Ray (twice the KV blocks)
    single-2      one `cobatch serve` process, 2 threads (no Ray; same KV as 1x2)

For each: prefix-cache hit rate (the replicas' own counters, weighted by their prompt tokens), TTFT
p50/p99, throughput and goodput under a TPOT SLO (bench serve's report), the resident memory of the
idle app (the server's process tree, Ray's processes included), and for 1x2 vs single-2 the time to
first token of lone short requests (what the ingress hop adds). Results: docs/bench/scaling.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from cobatch.bench.common import write_json
from cobatch.bench.datasets import BenchRequest, write_jsonl
from cobatch.testing.server import free_port, terminate, wait_ready

ROOT = Path(__file__).resolve().parent.parent
COBATCH = [sys.executable, "-m", "cobatch.cli"]
_READY_TIMEOUT_S = 300.0
_IDLE_SETTLE_S = 5.0
_TOKEN_RANGE = (1000, 30000)


@dataclass(frozen=True, slots=True)
class Setup:
    """One server configuration: `cobatch serve` flags."""

    name: str
    flags: tuple[str, ...]
    probes_hop: bool = False  # measure lone requests' TTFT here too


def setups(kv_blocks: int, max_model_len: int) -> list[Setup]:
    # A small KV pool on purpose: what a replica can cache is what routing by prefix is about.
    common = ("--max-model-len", str(max_model_len))
    two = ("--replicas", "2", "--num-threads", "1", "--num-kv-blocks", str(kv_blocks), *common)
    one = ("--num-threads", "2", "--num-kv-blocks", str(2 * kv_blocks), *common)
    return [Setup("cobatch-2x1", (*two, "--router", "cobatch")),
            Setup("pow2-2x1", (*two, "--router", "power_of_two")),
            Setup("rr-2x1", (*two, "--router", "round_robin")),
            Setup("cobatch-1x2", ("--replicas", "1", *one), probes_hop=True),
            Setup("single-2", one, probes_hop=True)]


def shared_prefix_workload(num_system: int, num_users: int, system_len: int, user_len: int,
                           output_len: int, seed: int) -> list[BenchRequest]:
    """num_system system prompts x num_users users each, in a shuffled arrival order."""
    rng = random.Random(seed)
    systems = [[rng.randrange(*_TOKEN_RANGE) for _ in range(system_len)] for _ in range(num_system)]
    requests = [BenchRequest(output_len, prompt_token_ids=tuple(
        system + [rng.randrange(*_TOKEN_RANGE) for _ in range(user_len)]))
        for system in systems for _ in range(num_users)]
    rng.shuffle(requests)
    return requests


def hop_workload(num: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(2, prompt_token_ids=tuple(rng.randrange(*_TOKEN_RANGE) for _ in range(16)))
            for _ in range(num)]


# ---- a server ----------------------------------------------------------------------------------------

class Server:
    """`cobatch serve` on a free port, its log in a file; stopped with SIGTERM (the drain)."""

    def __init__(self, setup: Setup, model: str | None, log_dir: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_dir / f"{setup.name}.log", "w")
        cmd = [*COBATCH, "serve", *([model] if model else []), "--port", str(self.port),
               "--log-level", "warning", *setup.flags]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            wait_ready(self.base_url, self.proc, _READY_TIMEOUT_S, Path(self._log.name))
        except BaseException:  # not ready, or interrupted: no server (nor its Ray) left behind
            self.stop()
            raise

    def resident_mb(self) -> float:
        """RSS of the server and every process under it (Ray's gcs, raylet, workers, replicas)."""
        root = psutil.Process(self.proc.pid)
        total = 0
        for proc in [root, *root.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except psutil.Error:
                pass
        return total / 2**20

    def stop(self) -> None:
        terminate(self.proc, timeout_s=120)
        self._log.close()


def prefix_hit_rate(metrics: str) -> float:
    """The replicas' prefix-cache hit rates weighted by the prompt tokens each processed."""
    rates = _samples(metrics, "cobatch:prefix_cache_hit_rate")
    tokens = _samples(metrics, "cobatch:prompt_tokens_total")
    total = sum(tokens.values())
    return sum(rates.get(k, 0.0) * v for k, v in tokens.items()) / total if total else 0.0


def prompt_share_computed(metrics: str) -> float:
    """Prompt tokens the engines computed (recomputed after preemption included) per prompt token.

    Steps computed prefill + decode tokens; each finished sequence's first token came with its
    prefill, every other one took a decode token. 1 - this is the hit rate net of recomputation.
    """
    computed = sum(_samples(metrics, "cobatch:iteration_tokens_total_sum").values())
    generated = sum(_samples(metrics, "cobatch:generation_tokens_total").values())
    finished = sum(_samples(metrics, "cobatch:request_success_total").values())
    prompt = sum(_samples(metrics, "cobatch:prompt_tokens_total").values())
    return (computed - (generated - finished)) / prompt if prompt else 0.0


def _samples(metrics: str, name: str) -> dict[str, float]:
    """replica label (or "" for a single engine) -> value."""
    out = {}
    for line in metrics.splitlines():
        if line.startswith(name + "{"):
            match = re.search(r'replica="([^"]*)"', line)
            out[match.group(1) if match else ""] = float(line.rsplit(" ", 1)[1])
    return out


def bench_serve(base_url: str, dataset: Path, result: Path, concurrency: int,
                tpot_slo_ms: float) -> dict:
    """`cobatch bench serve`, unchanged, against the endpoint; its saved report."""
    cmd = [*COBATCH, "bench", "serve", "--base-url", base_url, "--dataset", str(dataset),
           "--use-token-ids", "--max-concurrency", str(concurrency), "--goodput",
           f"tpot:{tpot_slo_ms:g}", "--save-result", str(result), "--disable-tqdm"]
    subprocess.run(cmd, cwd=ROOT, check=False, stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())


# ---- one setup -----------------------------------------------------------------------------------------

def measure(setup: Setup, args: argparse.Namespace, files: dict[str, Path], log_dir: Path) -> dict:
    print(f"--- {setup.name}: cobatch serve {' '.join(setup.flags)}", flush=True)
    started = time.monotonic()
    server = Server(setup, args.model, log_dir)
    try:
        result: dict = {"flags": list(setup.flags), "start_s": time.monotonic() - started,
                        "load_average_before": os.getloadavg()[0]}
        time.sleep(_IDLE_SETTLE_S)
        result["idle_resident_mb"] = server.resident_mb()
        report = bench_serve(server.base_url, files["workload"], log_dir / f"{setup.name}.json",
                             args.max_concurrency, args.tpot_slo_ms)
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30.0).text
        result.update(_summary(report, metrics))
        if "--replicas" in setup.flags:  # the routing decisions, for reading afterwards
            decisions = httpx.get(f"{server.base_url}/debug/routing", params={"limit": 256},
                                  timeout=30.0).json()
            (log_dir / f"{setup.name}-decisions.json").write_text(json.dumps(decisions))
        if setup.probes_hop:
            hop = bench_serve(server.base_url, files["hop"], log_dir / f"{setup.name}-hop.json", 1,
                              args.tpot_slo_ms)
            result["lone_ttft_ms_p50"] = hop["ttft_ms"]["p50"]
        print(json.dumps(result), flush=True)
        return result
    finally:
        server.stop()


def _summary(report: dict, metrics: str) -> dict:
    routed = _samples(metrics, "cobatch:router_routed_requests_total")
    return {"prefix_hit_rate": prefix_hit_rate(metrics),
            "prompt_share_computed": prompt_share_computed(metrics),
            "num_preemptions": sum(_samples(metrics, "cobatch:num_preemptions_total").values()),
            "completed": report["completed"],
            "failed": report["failed"], "duration_s": report["duration_s"],
            "output_throughput": report["output_throughput"],
            "goodput": report.get("goodput"), "ttft_ms": report["ttft_ms"],
            "tpot_ms": report["tpot_ms"], "requests_per_replica": sorted(routed.values()),
            "errors": report.get("errors", [])}


def markdown(results: dict[str, dict]) -> str:
    lines = ["| setup | prefix hit rate | prompt computed | TTFT p50 / p99 ms | TPOT p50 ms | output tok/s "
             "| goodput req/s | idle RSS MB |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "ttft_ms" not in r:
            lines.append(f"| {name} | failed: {r.get('error', '')} | | | | | | |")
            continue
        lines.append(f"| {name} | {r['prefix_hit_rate']:.1%} | {r['prompt_share_computed']:.1%} | "
                     f"{r['ttft_ms']['p50']:.0f} / "
                     f"{r['ttft_ms']['p99']:.0f} | {r['tpot_ms']['p50']:.0f} | "
                     f"{r['output_throughput']:.1f} | {r['goodput'] or 0:.2f} | "
                     f"{r['idle_resident_mb']:.0f} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default=None, help="MODEL for cobatch serve (default: the bundled SmolLM2-135M)")
    add("--system-prompts", type=int, default=8)
    add("--users", type=int, default=12, help="requests per system prompt")
    add("--system-len", type=int, default=768, help="tokens of each system prompt")
    add("--user-len", type=int, default=32, help="tokens of each user's own part")
    add("--output-len", type=int, default=16)
    # Holds about half the system prompts besides the running requests: what each replica can
    # cache is what routing by prefix is about.
    add("--kv-blocks", type=int, default=256, help="KV blocks per one-thread replica (x2 for 1x2)")
    add("--max-concurrency", type=int, default=8)
    add("--tpot-slo-ms", type=float, default=300.0, help="goodput: requests within this TPOT")
    add("--only", default=None, help="comma-separated setup names")
    add("--output", default=str(ROOT / "docs" / "bench" / "scaling.json"))
    add("--seed", type=int, default=0)


def _interrupt(sig: int, frame: object) -> None:
    raise KeyboardInterrupt  # so a SIGTERM still stops the server (and its Ray) under measurement


def main(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    log_dir = Path(tempfile.mkdtemp(prefix="cobatch-scaling-"))
    files = {"workload": log_dir / "shared_prefix.jsonl", "hop": log_dir / "hop.jsonl"}
    write_jsonl(shared_prefix_workload(args.system_prompts, args.users, args.system_len,
                                       args.user_len, args.output_len, args.seed), files["workload"])
    write_jsonl(hop_workload(20, args.seed), files["hop"])
    chosen = set(args.only.split(",")) if args.only else None
    results: dict[str, dict] = {}
    max_model_len = args.system_len + args.user_len + args.output_len
    for setup in setups(args.kv_blocks, -(-max_model_len // 64) * 64):
        if chosen is None or setup.name in chosen:
            try:
                results[setup.name] = measure(setup, args, files, log_dir)
            except (RuntimeError, TimeoutError, OSError, ValueError) as exc:
                results[setup.name] = {"flags": list(setup.flags), "error": str(exc)[-2000:]}
    settings = {k: v for k, v in vars(args).items() if k != "output"}
    write_json(args.output, {"settings": settings, "load_average": os.getloadavg(),
                             "logs": str(log_dir), "results": results})
    print(markdown(results))
    print(f"wrote {args.output} (server logs in {log_dir})")
    return 0 if all("error" not in r for r in results.values()) else 1


def cli(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(cli())
