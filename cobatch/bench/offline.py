"""`cobatch bench offline`: useful generated tokens/s of the engine on a workload, static vs continuous.

Every request arrives at once, uses ignore_eos and its own max_tokens, so the amount of useful work is
fixed by the workload and tokens/s compares policies directly. `--compare` alternates static and
continuous runs in one process (the machine is noisy: side-by-side ratios, not absolute numbers).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

from cobatch.bench import timeline
from cobatch.bench.common import add_workload_arguments, settings, workload_from_args, write_json
from cobatch.bench.datasets import BenchRequest, output_length_cv
from cobatch.bench.runs import EngineFactory, RunResult, run_workload, warm_up
from cobatch.config_cli import add_engine_args, engine_config_from_args
from cobatch.wait_reasons import WAIT_REASONS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)  # --batching and --tpot-slo-ms: the policy of a run without --compare
    add_workload_arguments(parser)
    parser.add_argument("--compare", action="store_true", help="run static and continuous, alternating")
    parser.add_argument("--repeats", type=int, default=1, help="runs per policy (alternating)")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--plot", default=None, help="PNG of the metro timeline (default: none)")
    parser.add_argument("--profile", action="store_true",
                        help="print where step time went: scheduler, input prep, forward, sampling")


def tokenize_text_prompts(requests: list[BenchRequest], model: str | None) -> list[BenchRequest]:
    """Text prompts (JSONL) become token ids with the model's tokenizer."""
    if all(r.prompt_token_ids is not None for r in requests):
        return requests
    from cobatch.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(model)
    return [r if r.prompt_token_ids is not None
            else replace(r, prompt_token_ids=tuple(tokenizer.encode(r.prompt or "")))
            for r in requests]


def compare(factory: EngineFactory, requests: list[BenchRequest], max_num_seqs: int,
            repeats: int = 1, label: str = "") -> dict:
    """Static and continuous alternately, `repeats` each; the ratio of median useful tokens/s."""
    runs: dict[str, list[RunResult]] = {"static": [], "continuous": []}
    for _ in range(repeats):
        for batching in ("static", "continuous"):
            engine = factory.make(batching=batching, max_num_seqs=max_num_seqs)
            runs[batching].append(run_workload(engine, requests, f"{batching} {label}".strip()))
    median = {b: statistics.median(r.tokens_per_s for r in rs) for b, rs in runs.items()}
    return {
        "label": label, "max_num_seqs": max_num_seqs, "num_requests": len(requests),
        "output_len_cv": output_length_cv(requests),
        "static_tokens_per_s": median["static"], "continuous_tokens_per_s": median["continuous"],
        "ratio": median["continuous"] / median["static"] if median["static"] else float("nan"),
        "pair_ratios": [c.tokens_per_s / s.tokens_per_s
                        for s, c in zip(runs["static"], runs["continuous"])],
        "padding_share_static": timeline.padding_share(runs["static"][-1]),
        "runs": [r.summary() for rs in runs.values() for r in rs],
        "_last": (runs["static"][-1], runs["continuous"][-1]),  # for plots; dropped from JSON
    }


def print_run(result: RunResult) -> None:
    print(f"{result.label:>24}: {result.num_output_tokens} tokens in {result.duration_s:.2f} s = "
          f"{result.tokens_per_s:.1f} useful tok/s, {len(result.stats)} steps, "
          f"mean running {result.mean_running:.1f}, preemptions {result.num_preemptions}")


def wait_summary(result: RunResult) -> dict:
    """From the run's StepStats: sequence-steps without a row by reason, preemptions by mode, and the
    mean predicted costs of preemption_mode auto's choices."""
    wait_steps = dict.fromkeys(WAIT_REASONS, 0)
    modes: dict[str, int] = {}
    predicted: dict[str, list[float]] = {"recompute_s": [], "swap_s": []}
    for stats in result.stats:
        for reason, num in stats.waits.counts:
            wait_steps[reason] += num
        for choice in stats.waits.preemptions:
            modes[choice.mode] = modes.get(choice.mode, 0) + 1
            if choice.recompute_s is not None and choice.swap_s is not None:
                predicted["recompute_s"].append(choice.recompute_s)
                predicted["swap_s"].append(choice.swap_s)
    summary: dict = {"wait_steps": {r: n for r, n in wait_steps.items() if n}, "preemptions_by_mode": modes}
    if predicted["swap_s"]:
        summary["mean_predicted_s"] = {k: statistics.fmean(v) for k, v in predicted.items()}
    return summary


def print_wait_summary(result: RunResult) -> None:
    """Why sequences waited, and how they were preempted (nothing when nobody waited)."""
    summary = wait_summary(result)
    total = sum(summary["wait_steps"].values())
    if total:
        shares = ", ".join(f"{reason} {num} ({100 * num / total:.0f}%)"
                           for reason, num in summary["wait_steps"].items())
        print(f"{'':>26}waits (sequence-steps without a row): {shares}")
    if summary["preemptions_by_mode"]:
        modes = ", ".join(f"{mode} {num}" for mode, num in sorted(summary["preemptions_by_mode"].items()))
        mean = summary.get("mean_predicted_s")
        costs = (f" (predicted mean: recompute {1e3 * mean['recompute_s']:.2f} ms, swap "
                 f"{1e3 * mean['swap_s']:.2f} ms)" if mean else "")
        print(f"{'':>26}preemptions by mode: {modes}{costs}")


def step_time_split(result: RunResult) -> dict[str, float]:
    """Seconds of the run's steps spent in the scheduler, the runner's parts, and the rest (update)."""
    total = sum(s.duration_s for s in result.stats)
    split = {"schedule": sum(s.schedule_s for s in result.stats)}
    runner_s = result.extra.get("runner_s", {})
    split.update({part.removesuffix("_s"): seconds for part, seconds in runner_s.items()})
    split["update+other"] = max(0.0, total - sum(split.values()))
    return split


def print_step_time_split(result: RunResult) -> None:
    split = step_time_split(result)
    total = sum(split.values())
    print(f"step time of {result.label}: {total:.2f} s over {len(result.stats)} steps")
    for part, seconds in split.items():
        print(f"  {part:>14} {seconds:7.2f} s  {100 * seconds / total:5.1f}%")
    full = [s for s in result.stats if s.num_rows >= result.max_num_seqs]
    if full:  # the steps at the largest batch: the "share at batch 64"
        share = sum(s.schedule_s for s in full) / sum(s.duration_s for s in full)
        print(f"  scheduler share at batch {result.max_num_seqs}: {100 * share:.1f}% of {len(full)} steps")


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM), 0 where /proc is missing."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def print_memory(factory: EngineFactory, result: RunResult) -> None:
    """Model bytes, KV bytes per token (from the model shape), the KV pool (resident: warm_up prefaults
    it, as the server does), the part of it the run used, and peak RSS."""
    runner = factory.runner
    model_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())  # type: ignore[attr-defined]
    kv_per_token = runner.kv_bytes_per_token  # type: ignore[attr-defined]
    block_size = factory.config.block_size
    peak_blocks = max((s.num_kv_blocks_used for s in result.stats), default=0)
    kv_peak = peak_blocks * block_size * kv_per_token
    kv_pool = runner.num_kv_blocks * block_size * kv_per_token  # type: ignore[attr-defined]
    mib = 1 << 20
    print(f"memory: model {model_bytes / mib:.0f} MiB, KV {kv_per_token} B/token "
          f"({kv_per_token * block_size / 1024:.0f} KiB/block), KV pool {runner.num_kv_blocks} blocks = "  # type: ignore[attr-defined]
          f"{kv_pool / mib:.0f} MiB (peak in use {peak_blocks} blocks = {kv_peak / mib:.0f} MiB), "
          f"peak RSS (VmHWM) {peak_rss_bytes() / mib:.0f} MiB "
          f"= model + KV pool + {(peak_rss_bytes() - model_bytes - kv_pool) / mib:.0f} MiB")


def main(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)
    requests = tokenize_text_prompts(workload_from_args(args), args.model)
    print(f"workload: {len(requests)} requests, output-length CV {output_length_cv(requests):.2f}, "
          f"max_num_seqs={config.max_num_seqs}")
    factory = EngineFactory.load(config)
    warm_up(factory)
    if args.compare:
        report = compare(factory, requests, config.max_num_seqs, args.repeats)
        last = report.pop("_last")
        for result in last:
            print_run(result)
            print_wait_summary(result)
        print(f"continuous / static useful tokens/s: {report['ratio']:.2f}x "
              f"(pairs: {', '.join(f'{r:.2f}' for r in report['pair_ratios'])})"
              + (f"; continuous with {config.num_speculative_tokens} speculative tokens, static never drafts"
                 if config.num_speculative_tokens else ""))
    else:
        engine = factory.make(batching=config.batching, tpot_slo_ms=config.tpot_slo_ms)
        result = run_workload(engine, requests)
        print_run(result)
        print_wait_summary(result)
        if args.profile:
            print_step_time_split(result)
            print_memory(factory, result)
        last, report = (result,), {**result.summary(), "waits": wait_summary(result)}
    if args.output_json:
        print(f"wrote {write_json(args.output_json, {'config': settings(args), 'result': report})}")
    if args.plot:
        print(f"wrote {timeline.plot_timeline(list(last), args.plot)}")
    return 0
