"""Benchmark metric math: per-request latencies, percentiles, throughput and goodput (pure functions).

Definitions (the same as vLLM's benchmark_serving, so numbers compare across tools):
    TTFT  = first token time - request start
    TPOT  = (E2E - TTFT) / (output_tokens - 1)   mean time per output token after the first
    ITL   = gaps between consecutive token arrivals (one list per request, pooled for percentiles)
    E2E   = last token time - request start
    goodput = requests/s of completed requests that meet every given SLO
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PERCENTILES: tuple[int, ...] = (50, 90, 99)


@dataclass(slots=True)
class RequestTiming:
    """One request's measured timeline, in seconds on one clock."""

    start_s: float
    token_times_s: list[float] = field(default_factory=list)  # arrival of each output chunk
    num_output_tokens: int = 0  # tokens, not chunks: a chunk may hold several tokens
    num_prompt_tokens: int = 0
    success: bool = True
    error: str = ""

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.start_s if self.token_times_s else None

    @property
    def e2e_s(self) -> float | None:
        return self.token_times_s[-1] - self.start_s if self.token_times_s else None

    @property
    def tpot_s(self) -> float | None:
        return tpot(self.e2e_s, self.ttft_s, self.num_output_tokens)

    @property
    def itl_s(self) -> list[float]:
        return itl(self.token_times_s)


def tpot(e2e_s: float | None, ttft_s: float | None, num_output_tokens: int) -> float | None:
    """(e2e - ttft) / (n - 1); None with fewer than two tokens (no inter-token time exists)."""
    if e2e_s is None or ttft_s is None or num_output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (num_output_tokens - 1)


def itl(token_times_s: list[float]) -> list[float]:
    """Gaps between consecutive token (chunk) arrivals."""
    return [b - a for a, b in zip(token_times_s, token_times_s[1:])]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default); NaN when empty."""
    if not values:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean / p50 / p90 / p99 of `values`, multiplied by `scale` (seconds -> ms by default)."""
    out = {"mean": sum(values) / len(values) * scale if values else math.nan}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q) * scale
    return out


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency objectives in milliseconds; None means not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))


def parse_slo(items: list[str]) -> Slo:
    """Parse `["ttft:500", "tpot:50", "e2el:3000"]` (milliseconds)."""
    values: dict[str, float] = {}
    for item in items:
        name, sep, number = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"bad SLO {item!r}: expected ttft:MS, tpot:MS or e2el:MS")
        values[f"{name}_ms"] = float(number)
        if values[f"{name}_ms"] <= 0:
            raise ValueError(f"SLO {item!r} must be positive")
    return Slo(**values)


def meets_slo(timing: RequestTiming, slo: Slo) -> bool:
    """True if the request completed and every set objective holds (TPOT holds trivially for n<2)."""
    if not timing.success or timing.ttft_s is None:
        return False
    checks = ((slo.ttft_ms, timing.ttft_s), (slo.tpot_ms, timing.tpot_s), (slo.e2el_ms, timing.e2e_s))
    return all(limit is None or value is None or value * 1000.0 <= limit for limit, value in checks)


def summarize_run(timings: list[RequestTiming], duration_s: float, slo: Slo = Slo()) -> dict:
    """The benchmark report: counts, throughputs, goodput and latency percentiles (ms)."""
    done = [t for t in timings if t.success]
    num_output = sum(t.num_output_tokens for t in done)
    report: dict = {
        "duration_s": duration_s,
        "completed": len(done),
        "failed": len(timings) - len(done),
        "total_input_tokens": sum(t.num_prompt_tokens for t in done),
        "total_output_tokens": num_output,
        "request_throughput": len(done) / duration_s if duration_s > 0 else math.nan,
        "output_throughput": num_output / duration_s if duration_s > 0 else math.nan,
        "ttft_ms": summarize([t.ttft_s for t in done if t.ttft_s is not None]),
        "tpot_ms": summarize([v for t in done if (v := t.tpot_s) is not None]),
        "itl_ms": summarize([gap for t in done for gap in t.itl_s]),
        "e2el_ms": summarize([t.e2e_s for t in done if t.e2e_s is not None]),
    }
    if slo.is_set:
        good = [t for t in done if meets_slo(t, slo)]
        report["slo"] = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2el_ms": slo.e2el_ms}
        report["good_requests"] = len(good)
        report["goodput"] = len(good) / duration_s if duration_s > 0 else math.nan
        report["good_output_throughput"] = (sum(t.num_output_tokens for t in good) / duration_s
                                            if duration_s > 0 else math.nan)
    return report
