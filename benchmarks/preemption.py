"""preemption_mode recompute vs swap vs auto under memory pressure: short, long and shared-prefix contexts.

One loaded model, a fresh engine per run (fresh step-time model and copy-time estimate: auto learns both
during the run), the three modes alternating in rotated order (the host is noisy: compare side by side).
Useful tokens/s (ignore EOS, fixed output lengths), preemptions, what each mode paid (recomputed
tokens, swaps), auto's choices with its mean predicted costs, and the measured copy time per block.

    .venv/bin/python -m benchmarks.preemption [--repeats 2] [--num-threads 1] [--workloads short,long,shared]
        [--output-json docs/bench/preemption.json] [--plot docs/img/preemption.png]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
from dataclasses import replace

from cobatch.bench import plots
from cobatch.bench.common import write_json
from cobatch.bench.datasets import BenchRequest, LengthSpec, WorkloadSpec, synthesize
from cobatch.bench.offline import wait_summary
from cobatch.bench.runs import EngineFactory, run_workload, warm_up
from cobatch.config import EngineConfig

MODES = ("recompute", "swap", "auto")
MAX_MODEL_LEN = 384  # the pool must hold one such sequence: a small pool stays legal
MAX_NUM_SEQS = 16
# name -> (requests, prompt tokens, output tokens, KV blocks of 16 tokens, tokens of a prompt prefix
# every request starts with). Admission sees only the prompts: the admitted sequences then outgrow the
# pool, and the newest is preempted.
WORKLOADS = {
    "short": (16, "8-16", "40-56", 24, 0),  # ~60 tokens each; 16 seats, the pool holds 384 tokens
    "long": (5, "192-224", "96-128", 48, 0),  # ~320 tokens each; 3 admitted, the pool holds 768
    # A 160-token system prompt (10 blocks, held once through the prefix cache) + a short unique suffix:
    # where a swap that copied the shared blocks brought back private copies of them.
    "shared": (16, "8-16", "40-56", 32, 160),
}


def run_mode(factory: EngineFactory, requests: list[BenchRequest], num_kv_blocks: int, mode: str) -> dict:
    """One run of `requests` under preemption `mode` in a pool of `num_kv_blocks`."""
    engine = factory.make(max_num_seqs=MAX_NUM_SEQS, num_kv_blocks=num_kv_blocks, preemption_mode=mode)
    result = run_workload(engine, requests, mode)
    waits = wait_summary(result)
    return {"mode": mode, "tokens_per_s": result.tokens_per_s, "duration_s": result.duration_s,
            "num_steps": len(result.stats), "num_preemptions": result.num_preemptions,
            "num_recomputed_tokens": result.num_recomputed_tokens, "num_swaps": result.num_swaps,
            "preemptions_by_mode": waits["preemptions_by_mode"],
            "mean_predicted_s": waits.get("mean_predicted_s"),
            "copy_s_per_block": engine.copy_time.seconds_per_block, "wait_steps": waits["wait_steps"]}


def workload_requests(name: str) -> list[BenchRequest]:
    """The seeded requests of a WORKLOADS entry, its common prefix (if any) in front of each prompt."""
    num, inputs, outputs, _, prefix_len = WORKLOADS[name]
    spec = WorkloadSpec(num, LengthSpec.parse(inputs), LengthSpec.parse(outputs), seed=7)
    rng = random.Random(spec.seed)
    prefix = tuple(rng.randrange(*spec.token_id_range) for _ in range(prefix_len))
    return [replace(r, prompt_token_ids=prefix + (r.prompt_token_ids or ())) for r in synthesize(spec)]


def compare_modes(factory: EngineFactory, name: str, repeats: int) -> dict:
    """Every mode `repeats` times on one workload, rotating which goes first."""
    num, inputs, outputs, num_kv_blocks, prefix_len = WORKLOADS[name]
    requests = workload_requests(name)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for repeat in range(repeats):
        for mode in MODES[repeat % 3:] + MODES[:repeat % 3]:
            run = run_mode(factory, requests, num_kv_blocks, mode)
            runs[mode].append(run)
            predicted = run["mean_predicted_s"]
            costs = (f", predicted recompute {1e3 * predicted['recompute_s']:.1f} ms vs swap "
                     f"{1e3 * predicted['swap_s']:.2f} ms" if predicted else "")
            print(f"{name:>6} {mode:>9}: {run['tokens_per_s']:7.1f} tok/s, {run['num_preemptions']:3d} "
                  f"preemptions {run['preemptions_by_mode']}, {run['num_recomputed_tokens']} recomputed "
                  f"tokens, {run['num_swaps']} swaps{costs}", flush=True)
    median = {mode: statistics.median(r["tokens_per_s"] for r in rs) for mode, rs in runs.items()}
    best_fixed = max(median["recompute"], median["swap"])
    return {"workload": name, "num_requests": num, "input_len": inputs, "output_len": outputs,
            "shared_prefix_len": prefix_len, "num_kv_blocks": num_kv_blocks, "pool_tokens": num_kv_blocks * factory.config.block_size,
            "median_tokens_per_s": median, "auto_vs_best_fixed": median["auto"] / best_fixed,
            "runs": runs}


def plot(results: list[dict], path: str) -> str:
    """One panel per workload: median tok/s per mode, preemptions and the modes auto took above the bars."""
    fig, axes = plots.new_figure(1, len(results), width=5.0 * len(results), height=4.2)
    for ax, result in zip(axes, results):
        medians = result["median_tokens_per_s"]
        bars = ax.bar(list(medians), list(medians.values()), color=["C0", "C1", "C2"])
        labels = []
        for mode in medians:
            last = result["runs"][mode][-1]
            taken = ", ".join(f"{n} {m}" for m, n in sorted(last["preemptions_by_mode"].items()))
            labels.append(f"{medians[mode]:.0f}\n{taken or 'no preemption'}")
        ax.bar_label(bars, labels=labels, fontsize="small")
        shared = f"{result['shared_prefix_len']} shared + " if result.get("shared_prefix_len") else ""
        ax.set(title=f"{result['workload']} contexts ({shared}{result['input_len']} + {result['output_len']} "
                     f"tokens, pool {result['pool_tokens']})", ylabel="useful tokens/s")
        ax.set_ylim(0, 1.25 * max(medians.values()))
        ax.grid(axis="y", alpha=0.3)
    return str(plots.save(fig, path))


def machine(factory: EngineFactory) -> dict:
    """Where and how the figures were measured."""
    import torch

    runner = factory.runner
    bytes_per_block = runner.kv_bytes_per_token * factory.config.block_size  # type: ignore[attr-defined]
    return {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "machine": platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "dtype": str(runner.dtype).removeprefix("torch."),  # type: ignore[attr-defined]
            "kv_bytes_per_block": bytes_per_block, "num_swap_blocks": runner.num_swap_blocks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    parser.add_argument("--output-json", default="docs/bench/preemption.json")
    parser.add_argument("--plot", default="docs/img/preemption.png")
    args = parser.parse_args()
    # One thread: on a shared 2-core host a 2-thread step collapses whenever anything else runs.
    factory = EngineFactory.load(EngineConfig(max_model_len=MAX_MODEL_LEN, swap_space=0.25,
                                              num_threads=args.num_threads))
    warm_up(factory)
    names = [name for name in args.workloads.split(",") if name]
    if unknown := set(names) - WORKLOADS.keys():
        parser.error(f"unknown workloads {sorted(unknown)}; known: {', '.join(WORKLOADS)}")
    results = [compare_modes(factory, name, args.repeats) for name in names]
    for result in results:
        m = result["median_tokens_per_s"]
        print(f"{result['workload']}: recompute {m['recompute']:.1f}, swap {m['swap']:.1f}, auto "
              f"{m['auto']:.1f} tok/s; auto / best fixed {result['auto_vs_best_fixed']:.2f}")
    report = {"machine": machine(factory), "results": results}
    print(f"wrote {write_json(args.output_json, report)}")
    print(f"wrote {plot(results, args.plot)}")


if __name__ == "__main__":
    main()
