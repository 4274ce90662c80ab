"""The measurements behind `python -m benchmarks.claims`, one function per seed claim.

Each returns a Section: a markdown body (tables, plot links) and the raw figures for the JSON file.
All runs share one loaded runner (EngineFactory), so every comparison is side by side in one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cobatch.bench import plots, steps, timeline
from cobatch.bench.datasets import BenchRequest, LengthSpec, WorkloadSpec, output_length_cv, synthesize
from cobatch.bench.metrics import Slo, summarize_run
from cobatch.bench.offline import compare
from cobatch.bench.runs import EngineFactory, RunResult, run_workload


@dataclass(slots=True)
class Section:
    """One claim's result."""

    key: str
    title: str
    markdown: str
    data: dict = field(default_factory=dict)


@dataclass(slots=True)
class ClaimsContext:
    """What every section needs."""

    factory: EngineFactory
    img_dir: Path
    scale: float = 1.0  # < 1 shrinks every workload (smoke runs)
    tpot_slo_ms: float | None = None  # set by section (a) when not given
    step_model: object | None = None

    def workload(self, num: int, inputs: str, outputs: str, seed: int = 0) -> list[BenchRequest]:
        """A seeded workload, shrunk by `scale` (counts and output lengths)."""
        out = LengthSpec.parse(outputs)
        if self.scale < 1.0:
            out = LengthSpec(tuple((max(1, int(lo * self.scale)), max(1, int(hi * self.scale)))
                                   for lo, hi in out.ranges))
        spec = WorkloadSpec(max(4, int(num * self.scale)), LengthSpec.parse(inputs), out, seed)
        return synthesize(spec)

    def img(self, name: str) -> Path:
        return self.img_dir / name


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    """A markdown table; floats with two decimals."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in row) + " |")
    return "\n".join(lines)


def _img_link(ctx: ClaimsContext, path: Path, alt: str) -> str:
    return f"![{alt}](img/{path.name})"


# ---- (a) step time vs batch size ----------------------------------------------------------------

def step_time(ctx: ClaimsContext) -> Section:
    """T(B, ctx) profile and fit; T(32)/T(1); sets the TPOT SLO the later sections use."""
    sizes = steps.powers_of_two(64 if ctx.scale >= 1.0 else 8)
    contexts = [128, 512] if ctx.scale >= 1.0 else [64]
    samples = steps.profile(ctx.factory.runner, sizes, contexts, ctx.factory.config.block_size,
                            reps=3 if ctx.scale >= 1.0 else 1)
    model, r2 = steps.fit(samples)
    ctx.step_model = model
    t1 = {s.context_len: s.step_s for s in samples if s.batch_size == 1}
    if ctx.tpot_slo_ms is None:  # 2 x the B=1 step: room for a batch, but not for every request
        ctx.tpot_slo_ms = round(2000 * t1[min(t1)])
    fit_ms = steps.coefficients_ms(model)
    path = steps.plot(samples, model, str(ctx.img("step_time.png")))
    rows = [[b] + [f"{1000 * s.step_s:.1f} ms / {s.tokens_per_s:.0f} tok/s"
                   for s in samples if s.batch_size == b] for b in sizes]
    ratios = {c: steps.batch_ratio(samples, c) for c in contexts}
    md = "\n\n".join([
        markdown_table(["B"] + [f"ctx {c}: step / tokens/s" for c in contexts], rows),
        f"Fit: T = {fit_ms['constant_ms']:.1f} ms + {fit_ms['per_seq_ms']:.2f} ms·B + "
        f"{fit_ms['per_1k_context_tokens_ms']:.2f} ms per 1k context tokens, R² = {r2:.3f}.",
        "T(32)/T(1): " + ", ".join(f"{r:.2f} at ctx {c}" for c, r in ratios.items()) + ".",
        _img_link(ctx, Path(path), "decode step time vs batch size")])
    return Section("a", "Step time vs batch size", md,
                   {**steps.report(samples, model, r2), "tpot_slo_ms": ctx.tpot_slo_ms})


# ---- (b) continuous vs static at low, high and long-tail output-length variance -------------------

def static_vs_continuous(ctx: ClaimsContext) -> Section:
    """Same engine, same max_num_seqs: static and continuous on a narrow, a wide and a long-tailed output
    spread."""
    max_num_seqs = 16
    workloads = {
        "low variance (outputs 112-144)": ctx.workload(64, "64-256", "112-144", seed=1),
        "high variance (mixed64: outputs 8-32 / 128-256)": ctx.workload(64, "64-256", "8-32,128-256"),
        # Chat-like: most answers short, a few long (3/4 of the outputs 4-8 tokens, 1/4 256-384).
        "long tail (outputs 3/4 4-8, 1/4 256-384)": ctx.workload(64, "64-256", "4-8,4-8,4-8,256-384"),
    }
    rows, data, last = [], [], None
    for name, requests in workloads.items():
        report = compare(ctx.factory, requests, max_num_seqs, label=name.split(" (")[0])
        last = report.pop("_last")
        data.append(report)
        rows.append([name, f"{report['output_len_cv']:.2f}", report["static_tokens_per_s"],
                     report["continuous_tokens_per_s"], f"**{report['ratio']:.2f}x**",
                     f"{100 * report['padding_share_static']:.0f}%"])
    path = timeline.plot_timeline(list(last), ctx.img("timeline.png"))
    md = "\n\n".join([
        f"{len(next(iter(workloads.values())))} requests each, all arriving at once, ignore_eos, "
        f"max_num_seqs={max_num_seqs}, useful (non-padding) generated tokens/s:",
        markdown_table(["workload", "output CV", "static tok/s", "continuous tok/s", "continuous/static",
                "static padding row-steps"], rows),
        "The metro timeline of the long-tail pair (each colour a request, grey = a finished "
        "request kept as padding until its batch's longest member ends):",
        _img_link(ctx, path, "metro timeline static vs continuous")])
    return Section("b", "Continuous vs static batching", md, {"comparisons": data})


# ---- (c) goodput vs max_num_seqs under a TPOT SLO, and the SLO-bounded scheduler -----------------

def _goodput_row(result: RunResult, slo: Slo) -> dict:
    report = summarize_run(result.timings, result.duration_s, slo)
    return {"label": result.label, "max_num_seqs": result.max_num_seqs,
            "tokens_per_s": result.tokens_per_s, "goodput_rps": report["goodput"],
            "good_tokens_per_s": report["good_output_throughput"],
            "good_share": report["good_requests"] / max(1, report["completed"]),
            "tpot_p50_ms": report["tpot_ms"]["p50"], "tpot_p90_ms": report["tpot_ms"]["p90"],
            "mean_running": result.mean_running}


def slo_goodput(ctx: ClaimsContext) -> Section:
    """Sweep max_num_seqs under a TPOT SLO; then tpot_slo_ms with the default max_num_seqs."""
    assert ctx.tpot_slo_ms is not None, "section (a) sets the SLO"
    slo = Slo(tpot_ms=ctx.tpot_slo_ms)
    requests = ctx.workload(48, "32-128", "32-128", seed=2)
    default = ctx.factory.config.max_num_seqs
    fixed = [b for b in (2, 4, 8, 12, 16, 32) if b < default] + [default]
    rows = []
    for b in fixed:
        label = f"max_num_seqs={b}" + (" (default)" if b == default else "")
        rows.append(_goodput_row(run_workload(ctx.factory.make(max_num_seqs=b), requests, label), slo))
    bounded = run_workload(ctx.factory.make(tpot_slo_ms=ctx.tpot_slo_ms), requests,
                           f"tpot_slo_ms={ctx.tpot_slo_ms:g} (max_num_seqs={default})")
    rows.append(_goodput_row(bounded, slo))
    best = max(rows[:-1], key=lambda r: r["goodput_rps"])
    verdict = _slo_verdict(rows[-1], best, rows[len(fixed) - 1])
    path = _plot_goodput(ctx, rows, len(fixed))
    md = "\n\n".join([
        f"{len(requests)} requests at once (prompts 32-128, outputs 32-128), TPOT SLO "
        f"{ctx.tpot_slo_ms:g} ms (2 x the B=1 decode step). Goodput = completed requests meeting "
        "the SLO per second.",
        markdown_table(["configuration", "tok/s", "goodput req/s", "met SLO", "TPOT p50 ms", "TPOT p90 ms",
                "mean running"],
               [[r["label"], r["tokens_per_s"], r["goodput_rps"], f"{100 * r['good_share']:.0f}%",
                 r["tpot_p50_ms"], r["tpot_p90_ms"], r["mean_running"]] for r in rows]),
        verdict, _img_link(ctx, path, "goodput vs max_num_seqs")])
    return Section("c", "Goodput under a TPOT SLO", md,
                   {"tpot_slo_ms": ctx.tpot_slo_ms, "rows": rows, "best_fixed": best["label"]})


def _slo_verdict(bounded: dict, best: dict, default: dict) -> str:
    vs_best = bounded["goodput_rps"] / best["goodput_rps"] if best["goodput_rps"] else float("nan")
    vs_default = (f"**{bounded['goodput_rps'] / default['goodput_rps']:.2f}x the default**"
                  if default["goodput_rps"] else "**above the default's zero**")
    return (f"SLO-bounded goodput = **{vs_best:.2f}x the best fixed** ({best['label']}) and "
            f"{vs_default} max_num_seqs (which meets the SLO for "
            f"{100 * default['good_share']:.0f}% of requests).")


def _plot_goodput(ctx: ClaimsContext, rows: list[dict], num_fixed: int) -> Path:
    fig, (ax_g, ax_t) = plots.new_figure(1, 2, width=11.0)
    xs = [r["max_num_seqs"] for r in rows[:num_fixed]]
    ax_g.plot(xs, [r["goodput_rps"] for r in rows[:num_fixed]], "o-", label="fixed max_num_seqs")
    ax_g.axhline(rows[-1]["goodput_rps"], color="C2", linestyle="--", label="tpot_slo_ms (SLO-bounded)")
    ax_t.plot(xs, [r["tpot_p50_ms"] for r in rows[:num_fixed]], "o-", label="TPOT p50")
    ax_t.plot(xs, [r["tpot_p90_ms"] for r in rows[:num_fixed]], "s-", label="TPOT p90")
    ax_t.axhline(ctx.tpot_slo_ms, color="red", linestyle="--", label="SLO")
    for ax, ylabel in ((ax_g, "goodput (req/s meeting SLO)"), (ax_t, "TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set(xlabel="max_num_seqs", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    return plots.save(fig, ctx.img("slo_goodput.png"))


# ---- (d) paged admission vs reserving max_model_len ------------------------------------------------

def paged_vs_reserved(ctx: ClaimsContext) -> Section:
    """Concurrency at a fixed KV budget: block-accounted admission vs max_model_len reservations."""
    num_blocks = 256
    block_size = ctx.factory.config.block_size
    max_model_len = ctx.factory.runner.max_model_len
    reserved_seats = max(1, num_blocks * block_size // max_model_len)
    requests = ctx.workload(32, "32-96", "32-96", seed=3)
    paged = run_workload(ctx.factory.make(max_num_seqs=64, num_kv_blocks=num_blocks), requests,
                         "paged (blocks on demand)")
    # A reserving allocator admits a request only if max_model_len tokens of KV are free, so at most
    # floor(pool / max_model_len) run at once whatever their real length: that is this max_num_seqs.
    reserved = run_workload(ctx.factory.make(max_num_seqs=reserved_seats, num_kv_blocks=num_blocks),
                            requests, f"reserve max_model_len ({reserved_seats} seats)")
    rows = [[r.label, r.max_running, r.mean_running, r.tokens_per_s, r.num_preemptions,
             f"{100 * max(s.kv_usage for s in r.stats):.0f}%"] for r in (paged, reserved)]
    md = "\n\n".join([
        f"KV budget {num_blocks} blocks x {block_size} tokens = {num_blocks * block_size} tokens; "
        f"max_model_len {max_model_len}; {len(requests)} requests (prompts 32-96, outputs 32-96). "
        "Reservation is simulated honestly by the admission rule it implies: a system that reserves "
        f"max_model_len per request fits floor({num_blocks * block_size}/{max_model_len}) = "
        f"{reserved_seats} requests, so that run uses max_num_seqs={reserved_seats} on the same pool.",
        markdown_table(["admission", "max concurrency", "mean concurrency", "tok/s", "preemptions",
                "peak KV use"], rows),
        f"Paged admission ran **{paged.max_running / max(1, reserved.max_running):.1f}x** the "
        f"concurrency and **{paged.tokens_per_s / reserved.tokens_per_s:.2f}x** the throughput."])
    return Section("d", "Paged admission vs max_model_len reservation", md,
                   {"paged": paged.summary(), "reserved": reserved.summary()})


# ---- (e) memory pressure: recompute vs swap ------------------------------------------------------

def memory_pressure(ctx: ClaimsContext) -> Section:
    """A pool too small for every running request to grow: preemptions, recomputed tokens, tok/s."""
    requests = ctx.workload(16, "32-64", "96-160", seed=4)
    # The smallest pool the engine accepts: one max_model_len sequence (64 blocks at 1024 tokens).
    num_blocks = -(-ctx.factory.runner.max_model_len // ctx.factory.config.block_size)
    runs = [run_workload(ctx.factory.make(max_num_seqs=16), requests, "ample KV (no pressure)")]
    for mode in ("recompute", "swap"):
        engine = ctx.factory.make(max_num_seqs=16, num_kv_blocks=num_blocks, preemption_mode=mode)
        runs.append(run_workload(engine, requests, f"{num_blocks} blocks, {mode}"))
    rows = [[r.label, r.tokens_per_s, r.num_preemptions, r.num_recomputed_tokens, r.num_swaps,
             r.mean_running] for r in runs]
    md = "\n\n".join([
        f"{len(requests)} requests (prompts 32-64, outputs 96-160), max_num_seqs 16; the small pool "
        f"holds {num_blocks * ctx.factory.config.block_size} tokens, about a third of what all "
        "requests reach.",
        markdown_table(["configuration", "tok/s", "preemptions", "recomputed tokens", "swaps",
                "mean running"], rows),
        "Preemption is designed behaviour: every request still finishes with the same tokens; the "
        "price is the recomputed prefill (recompute) or the block copies (swap)."])
    return Section("e", "Memory pressure: recompute vs swap", md,
                   {"runs": [r.summary() for r in runs],
                    "output_len_cv": output_length_cv(requests)})


SECTIONS = {"a": step_time, "b": static_vs_continuous, "c": slo_goodput, "d": paged_vs_reserved,
            "e": memory_pressure}
