"""`cobatch bench serve`: an HTTP load generator for any OpenAI-compatible server (cobatch, vLLM, llama.cpp).

HTTP only, by design: this module imports nothing of the engine, so it measures other servers the same
way. Requests stream (SSE); each chunk's arrival time gives TTFT and ITL; the usage block of the last
chunk (stream_options.include_usage) gives the exact output token count when the server sends it.
Arrivals are a gamma process: `--burstiness 1` is Poisson at `--request-rate`; lower is burstier.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import time
from dataclasses import dataclass, replace

import httpx

from cobatch.bench import plots
from cobatch.bench.common import add_workload_arguments, workload_from_args, write_json
from cobatch.bench.datasets import BenchRequest
from cobatch.bench.metrics import RequestTiming, Slo, parse_slo, summarize_run


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """How requests are sent."""

    base_url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    use_token_ids: bool = False  # send prompt_token_ids as the prompt (completions only)
    timeout_s: float = 600.0
    seed: int = 0


def arrival_delays(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps before each request: gamma(shape=burstiness, mean=1/rate); all zero when rate is inf."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(num)]


def request_body(request: BenchRequest, spec: LoadSpec) -> dict:
    """The JSON body: greedy, ignore_eos (a vLLM/cobatch extension others ignore), streamed with usage."""
    body: dict = {"model": spec.model, "max_tokens": request.max_tokens, "temperature": 0.0,
                  "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    if spec.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt or ""}]
    elif spec.use_token_ids and request.prompt_token_ids is not None:
        body["prompt"] = list(request.prompt_token_ids)
    else:
        body["prompt"] = request.prompt or ""
    return body


def _chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def send_one(client: httpx.AsyncClient, request: BenchRequest, spec: LoadSpec) -> RequestTiming:
    """One streamed request, timed; failures are recorded, never raised."""
    path = "/v1/chat/completions" if spec.endpoint == "chat" else "/v1/completions"
    timing = RequestTiming(time.perf_counter(), num_prompt_tokens=request.num_prompt_tokens)
    num_chunks, usage_tokens = 0, None
    try:
        async with client.stream("POST", spec.base_url.rstrip("/") + path,
                                 json=request_body(request, spec)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status_code}: {body[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if _chunk_text(chunk):
                    timing.token_times_s.append(time.perf_counter())
                    num_chunks += 1
                usage = chunk.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens")
                    timing.num_prompt_tokens = usage.get("prompt_tokens") or timing.num_prompt_tokens
        timing.num_output_tokens = usage_tokens if usage_tokens is not None else num_chunks
        # Tokens whose text is empty (a padded vocabulary's ids, random weights) still count when the
        # server's usage reports them; such a request has no TTFT or TPOT.
        timing.success = bool(timing.token_times_s) or bool(usage_tokens)
        timing.error = "" if timing.success else "no tokens received"
    except (httpx.HTTPError, RuntimeError, json.JSONDecodeError) as exc:
        timing.success, timing.error = False, f"{type(exc).__name__}: {exc}"
    return timing


async def benchmark(requests: list[BenchRequest], spec: LoadSpec, slo: Slo = Slo(),
                    show_progress: bool = True) -> dict:
    """Send every request on the arrival schedule; the summary report (see metrics.summarize_run)."""
    from tqdm.asyncio import tqdm

    limit = asyncio.Semaphore(spec.max_concurrency or len(requests) or 1)
    delays = arrival_delays(len(requests), spec.request_rate, spec.burstiness, spec.seed)
    progress = tqdm(total=len(requests), disable=not show_progress, desc="requests")
    limits = httpx.Limits(max_connections=spec.max_concurrency or len(requests) or 1)

    async with httpx.AsyncClient(timeout=spec.timeout_s, limits=limits) as client:
        async def limited(request: BenchRequest) -> RequestTiming:
            async with limit:
                result = await send_one(client, request, spec)
            progress.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for request, delay in zip(requests, delays):
            await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(request)))
        timings = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    progress.close()
    report = summarize_run(list(timings), duration, slo)
    report["request_rate"] = spec.request_rate
    report["burstiness"] = spec.burstiness
    report["max_concurrency"] = spec.max_concurrency
    report["errors"] = sorted({t.error for t in timings if not t.success})[:5]
    return report


def resolve_model(base_url: str, model: str | None) -> str:
    """The given model name, else the server's first /v1/models entry, else 'default'."""
    if model:
        return model
    try:
        data = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=10.0).json()
        return data["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        return "default"


# cobatch's counters of why sequences waited and how they were preempted (docs/SERVER.md, Metrics).
_SCRAPED = {"waits": ("cobatch:request_wait_steps_total", "reason"),
            "preemptions_by_mode": ("cobatch:num_preemptions_by_mode_total", "mode")}


def scrape_counters(base_url: str) -> dict[str, dict[str, float]] | None:
    """cobatch's wait and preemption counters from /metrics, by label (summed over replicas);
    None when the server does not expose them (it is not cobatch)."""
    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=10.0).text
    except httpx.HTTPError:
        return None
    if _SCRAPED["waits"][0] not in text:
        return None
    found: dict[str, dict[str, float]] = {}
    for key, (name, label) in _SCRAPED.items():
        values = found.setdefault(key, {})
        for labels, value in re.findall(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.MULTILINE):
            match = re.search(rf'{label}="([^"]*)"', labels)
            if match:
                values[match.group(1)] = values.get(match.group(1), 0.0) + float(value)
    return found


def counters_during(before: dict[str, dict[str, float]] | None,
                    after: dict[str, dict[str, float]] | None) -> dict[str, dict[str, float]] | None:
    """What the counters grew by between two scrapes (None unless both found them)."""
    if before is None or after is None:
        return None
    return {key: {label: value - before.get(key, {}).get(label, 0.0)
                  for label, value in values.items() if value > before.get(key, {}).get(label, 0.0)}
            for key, values in after.items()}


def format_server_counters(counters: dict[str, dict[str, float]]) -> list[str]:
    """The summary lines of a cobatch server's wait reasons and preemption modes during the run."""
    lines = []
    waits = counters.get("waits", {})
    total = sum(waits.values())
    if total:
        shares = ", ".join(f"{reason} {num:.0f} ({100 * num / total:.0f}%)"
                           for reason, num in sorted(waits.items(), key=lambda kv: -kv[1]))
        lines.append(f"{'waits (sequence-steps, server)':<34}{shares}")
    modes = counters.get("preemptions_by_mode", {})
    if modes:
        lines.append(f"{'preemptions by mode (server)':<34}"
                     + ", ".join(f"{mode} {num:.0f}" for mode, num in sorted(modes.items())))
    return lines


def format_report(report: dict) -> str:
    """The vLLM-style text summary."""
    lines = [
        f"{'completed / failed':<34}{report['completed']} / {report['failed']}",
        f"{'duration (s)':<34}{report['duration_s']:.2f}",
        f"{'request throughput (req/s)':<34}{report['request_throughput']:.2f}",
        f"{'output throughput (tok/s)':<34}{report['output_throughput']:.1f}",
    ]
    if "goodput" in report:
        lines.append(f"{'goodput (req/s meeting SLO)':<34}{report['goodput']:.2f}"
                     f"  ({report['good_requests']} requests)")
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E")):
        s = report[key]
        lines.append(f"{name + ' ms  mean/p50/p90/p99':<34}"
                     f"{s['mean']:.1f} / {s['p50']:.1f} / {s['p90']:.1f} / {s['p99']:.1f}")
    if report.get("server_counters"):
        lines.extend(format_server_counters(report["server_counters"]))
    for error in report.get("errors", []):
        lines.append(f"error: {error}")
    return "\n".join(lines)


def plot_sweep(reports: list[dict], path: str) -> str:
    """Throughput vs latency: one point per request rate."""
    fig, (ax_tpot, ax_ttft) = plots.new_figure(1, 2, width=11.0)
    tput = [r["output_throughput"] for r in reports]
    for ax, key, name in ((ax_tpot, "tpot_ms", "TPOT"), (ax_ttft, "ttft_ms", "TTFT")):
        for q in ("p50", "p99"):
            ax.plot(tput, [r[key][q] for r in reports], "o-", label=f"{name} {q}")
        for r, x in zip(reports, tput):
            ax.annotate(f"{r['request_rate']:g}/s", (x, r[key]["p50"]), fontsize="small")
        ax.set(xlabel="output tokens/s", ylabel=f"{name} (ms)", title=f"{name} vs throughput")
        ax.grid(alpha=0.3)
        ax.legend()
    return str(plots.save(fig, path))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    parser.add_argument("--model", default=None, help="model name to send (default: from /v1/models)")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf = all at once")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--goodput", nargs="*", default=[], metavar="NAME:MS",
                        help="SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    parser.add_argument("--use-token-ids", action="store_true",
                        help="send token ids as the prompt (servers that accept them: cobatch, vLLM)")
    parser.add_argument("--sweep-rates", default=None, help="r1,r2,...: one run per rate, plus a curve")
    parser.add_argument("--save-result", default=None, help="JSON file")
    parser.add_argument("--plot", default="bench-serve-sweep.png", help="PNG for --sweep-rates")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--disable-tqdm", action="store_true")
    add_workload_arguments(parser, default="chat")


def main(args: argparse.Namespace) -> int:
    slo = parse_slo(args.goodput)
    requests = workload_from_args(args, as_text=not args.use_token_ids)
    spec = LoadSpec(args.base_url, resolve_model(args.base_url, args.model), args.endpoint,
                    args.request_rate, args.burstiness, args.max_concurrency, args.use_token_ids,
                    args.timeout, args.workload_seed)
    rates = [float(r) for r in args.sweep_rates.split(",")] if args.sweep_rates else [args.request_rate]
    reports = []
    for rate in rates:
        run_spec = replace(spec, request_rate=rate)
        print(f"--- {len(requests)} requests to {spec.base_url} ({spec.model}), rate {rate:g}/s")
        before = scrape_counters(spec.base_url)
        report = asyncio.run(benchmark(requests, run_spec, slo, not args.disable_tqdm))
        counters = counters_during(before, scrape_counters(spec.base_url))
        if counters is not None:
            report["server_counters"] = counters
        print(format_report(report))
        reports.append(report)
    if args.save_result:
        result = reports[0] if len(reports) == 1 else {"sweep": reports}
        print(f"wrote {write_json(args.save_result, result)}")
    if args.sweep_rates:
        print(f"wrote {plot_sweep(reports, args.plot)}")
    return 0 if all(r["failed"] == 0 for r in reports) else 1
