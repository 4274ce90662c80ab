"""`cobatch bench roofline`: decode throughput against this machine's roofline for the model's weights.

A decode step at batch B must read every weight once (bandwidth bound: weight bytes / read bandwidth)
and do 2 FLOPs per weight per row (compute bound: B x FLOPs per token / GEMM peak). The roofline
throughput is B / max(the two times); a measured step is reported as a share of it. Both machine figures
are measured here, in this process, with the same thread count as the steps:

- GEMM peak: the best rate of the model's own linear shapes at a large M (weights hot in cache), the
  better of torch's F.linear (oneDNN) and the engine's own packed kernel where the weights are packed;
- read bandwidth: a reduction over a tensor far larger than the last-level cache, on huge pages (where
  the engine keeps its weights and KV pool).

Attention is not in the roofline (it reads the KV cache, which grows with context); steps are measured
at the given contexts, so a long context shows as a lower share.

With `--workload`, the same figures give the ceiling of a whole offline run (issue 5's "ideal
schedule"): every prompt token at the GEMM peak (lm_head only for the last one), then one decode step per
output position with the true shrinking batch (requests still generating), each at its roofline time.
The engine then runs that workload and its useful tokens/s is reported as a share of the ceiling, and
the best run's steps are set against the same rates by step kind (gap_by_step_kind): where the run
loses its time, prefill or decode at which batch size.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from cobatch.bench.common import add_workload_arguments, workload_from_args, write_json
from cobatch.bench.steps import decode_step, time_step
from cobatch.config_cli import add_engine_args, engine_config_from_args

if TYPE_CHECKING:
    from cobatch.engine import StepStats


@dataclass(frozen=True, slots=True)
class Machine:
    """Measured machine figures for one dtype and thread count."""

    gemm_flops_per_s: float
    read_bytes_per_s: float


@dataclass(frozen=True, slots=True)
class ModelCost:
    """What one decode token costs in weights: bytes read per step (once for the batch), FLOPs per row."""

    weight_bytes: int
    flops_per_token: int
    lm_head_flops: int  # part of flops_per_token: a prefill token that samples nothing skips it


def roofline_tokens_per_s(cost: ModelCost, machine: Machine, batch_size: int) -> float:
    """B / max(bandwidth-bound step time, compute-bound step time)."""
    bandwidth_s = cost.weight_bytes / machine.read_bytes_per_s
    compute_s = batch_size * cost.flops_per_token / machine.gemm_flops_per_s
    return batch_size / max(bandwidth_s, compute_s)


def model_cost(model: object) -> ModelCost:
    """Bytes and FLOPs of the matmul weights a decode step reads (every layer's projections + lm_head).

    The embedding table is read one row per token; when lm_head is tied to it, it is counted once as
    lm_head. Norm weights are negligible.
    """
    from cobatch.kernels.quant_linear import is_quantized, quantized_shape

    def weights(p: object) -> int:  # a quantized tensor's elements are its bytes
        n, k = quantized_shape(p) if is_quantized(p) else (p.numel(), 1)  # type: ignore[attr-defined, arg-type]
        return n * k

    lm_head, embed = model.lm_head, model.embed_tokens  # type: ignore[attr-defined]
    matmul = [p for p in model.parameters()  # type: ignore[attr-defined]  (tied weights come once)
              if p.dim() >= 2 and (p is lm_head or p is not embed)]  # packed: 4-D, gate/up 5-D, quantized 3-D
    return ModelCost(weight_bytes=sum(p.numel() * p.element_size() for p in matmul),
                     flops_per_token=2 * sum(map(weights, matmul)), lm_head_flops=2 * weights(lm_head))


def ideal_schedule_s(cost: ModelCost, machine: Machine, prompt_lens: list[int], output_lens: list[int]) -> float:
    """Seconds an ideal engine needs for an offline workload (all requests at once): prefill at the GEMM
    peak, then decode step s with every request that still has more than s tokens to produce, each step
    at its roofline time. The first output token comes with the prefill."""
    prefill_flops = sum(prompt_lens) * (cost.flops_per_token - cost.lm_head_flops) \
        + len(prompt_lens) * cost.lm_head_flops
    seconds = prefill_flops / machine.gemm_flops_per_s
    for step in range(1, max(output_lens, default=0)):
        batch_size = sum(1 for n in output_lens if n > step)
        seconds += batch_size / roofline_tokens_per_s(cost, machine, batch_size)
    return seconds


# Decode-only steps grouped by batch size (rows): below ~8 rows a step is bandwidth-bound at the roofline.
_DECODE_KINDS = ((8, "decode B 1-8"), (16, "decode B 9-16"), (32, "decode B 17-32"), (64, "decode B 33-64"))


def step_kind(num_prefill_tokens: int, num_rows: int) -> str:
    """The step-kind label of gap_by_step_kind: "prefill" for any step carrying prompt tokens (its
    decode rows ride along), else the decode batch's size class."""
    if num_prefill_tokens:
        return "prefill"
    return next((label for top, label in _DECODE_KINDS if num_rows <= top), f"decode B > {_DECODE_KINDS[-1][0]}")


def step_ideal_s(cost: ModelCost, machine: Machine, num_prefill_tokens: int, num_decode_tokens: int,
                 num_sampled: int) -> float:
    """One step's time at the ceiling's rates: a step with prompt tokens runs all its tokens at the GEMM
    peak (lm_head only for the rows that sample), as the ideal schedule prefills; a decode step is a
    roofline step of its batch (drafts count as rows: they go through the weights too)."""
    if num_prefill_tokens:
        body = cost.flops_per_token - cost.lm_head_flops
        flops = (num_prefill_tokens + num_decode_tokens) * body + num_sampled * cost.lm_head_flops
        return flops / machine.gemm_flops_per_s
    if num_decode_tokens == 0:
        return 0.0
    return num_decode_tokens / roofline_tokens_per_s(cost, machine, num_decode_tokens)


def gap_by_step_kind(stats: Sequence[StepStats], cost: ModelCost, machine: Machine) -> list[dict]:
    """Where a run loses against the ceiling: per step kind, its steps' measured seconds beside the same
    steps at the ceiling's rates (step_ideal_s), largest gap first. Each step's useful tokens stand for
    the rows that sampled (a prompt's last chunk and each decode row: one each)."""
    kinds: dict[str, dict] = {}
    for s in stats:
        kind = kinds.setdefault(step_kind(s.num_prefill_tokens, s.num_rows - s.num_padding_rows),
                                {"steps": 0, "seconds": 0.0, "ideal_s": 0.0})
        kind["steps"] += 1
        kind["seconds"] += s.duration_s
        kind["ideal_s"] += step_ideal_s(cost, machine, s.num_prefill_tokens, s.num_decode_tokens,
                                        s.num_generated_tokens)
    total = sum(k["seconds"] for k in kinds.values()) or 1.0
    rows = [{"kind": name, **k, "gap_s": k["seconds"] - k["ideal_s"],
             "gap_share_of_run": (k["seconds"] - k["ideal_s"]) / total} for name, k in kinds.items()]
    return sorted(rows, key=lambda r: -r["gap_s"])


def print_gap(rows: list[dict]) -> None:
    print("where the best run's steps spend time beyond the ceiling's rates:")
    for r in rows:
        print(f"  {r['kind']:>16}: {r['steps']:4d} steps {r['seconds']:7.2f} s, at the ceiling's rates "
              f"{r['ideal_s']:6.2f} s: {r['gap_s']:+6.2f} s ({100 * r['gap_share_of_run']:+5.1f}% of the run)")


def _best_rate(work: float, fn: Callable[[], object], reps: int) -> float:
    """work / the fastest of `reps` runs (after one warm-up): the peak, not the typical, rate."""
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return work / best


def measure_machine(model: object, reps: int = 10, m: int = 1024, bandwidth_bytes: int = 1 << 29) -> Machine:
    """GEMM peak over the model's own weight shapes at M=m (F.linear, and the packed kernel where the
    weights are packed), and the read bandwidth of a large sum."""
    import torch
    import torch.nn.functional as F

    from cobatch.kernels.hugepages import huge_page_zeros
    from cobatch.kernels.linear import is_gate_up_packed, is_packed, linear, packed_shape, unpack_weight
    from cobatch.kernels.quant_linear import is_quantized, quantized_shape

    peak = 0.0
    seen: set[tuple[int, int]] = set()
    for weight in model.parameters():  # type: ignore[attr-defined]
        if weight.dim() < 2:
            continue
        if is_gate_up_packed(weight):  # the GEMM alone, without the fused activation: its packed layout
            weight = weight.flatten(0, 1)  # is pack_weight's of the gate/up rows interleaved in blocks
        quantized = is_quantized(weight)
        n, k = quantized_shape(weight) if quantized else packed_shape(weight) if is_packed(weight) else weight.shape
        if n > 8192 or (n, k) in seen:  # lm_head / embeddings: too big for cache, not a peak probe
            continue
        seen.add((n, k))
        if quantized:  # the kernel the engine runs, on the model's activations (its norm's dtype)
            x = torch.randn(m, k, dtype=model.norm.dtype)  # type: ignore[attr-defined]
            peak = max(peak, _best_rate(2.0 * m * n * k, lambda: linear(x, weight), reps))
            continue
        x = torch.randn(m, k, dtype=model.norm.dtype)  # type: ignore[attr-defined]  # (weight-only bf16: fp32)
        plain = (unpack_weight(weight) if is_packed(weight) else weight).to(x.dtype)  # a contiguous copy
        peak = max(peak, _best_rate(2.0 * m * n * k, lambda: F.linear(x, plain), reps))
        if is_packed(weight):
            peak = max(peak, _best_rate(2.0 * m * n * k, lambda: linear(x, weight), reps))
    # On huge pages, as the engine keeps its weights and KV pool: the sum reads faster there (1.1-1.4x in
    # same-process comparisons here), and the roofline must not flatter the engine with a slow figure.
    big = huge_page_zeros((bandwidth_bytes // 4,), torch.float32).fill_(1.0)
    bandwidth = _best_rate(float(bandwidth_bytes), big.sum, reps)
    return Machine(gemm_flops_per_s=peak, read_bytes_per_s=bandwidth)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--contexts", default="64,256", help="context lengths of the measured steps")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--output-json", default=None)
    add_workload_arguments(parser, default="")
    parser.add_argument("--skip-run", action="store_true", help="with --workload: the ceiling only")
    parser.add_argument("--plot", default=None,
                        help="with --workload: PNG of the best run's steps against the ceiling's rates")
    parser.add_argument("--runs", type=int, default=1,
                        help="with --workload: engine runs of it, each printed; the share is the best run's "
                             "(as each machine figure is its best probe), the median's printed too")


def main(args: argparse.Namespace) -> int:
    from cobatch.runner.model_runner import ModelRunner

    config = engine_config_from_args(args)
    runner = ModelRunner.load(config)
    cost = model_cost(runner.model)
    machine = measure_machine(runner.model)
    print(f"machine ({runner.dtype}, {_threads()} threads): GEMM peak {machine.gemm_flops_per_s / 1e9:.0f} "
          f"GFLOP/s, read bandwidth {machine.read_bytes_per_s / 1e9:.1f} GB/s")
    print(f"model: {cost.weight_bytes / 2**20:.0f} MiB of matmul weights, "
          f"{cost.flops_per_token / 1e6:.0f} MFLOP per token")
    rows = []
    for context_len in (int(c) for c in args.contexts.split(",")):
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            step = decode_step(batch_size, context_len, config.block_size, runner.num_kv_blocks)
            step_s = time_step(runner, step, args.reps)
            ceiling = roofline_tokens_per_s(cost, machine, batch_size)
            rows.append({"batch_size": batch_size, "context_len": context_len, "step_ms": 1000 * step_s,
                         "tokens_per_s": batch_size / step_s, "roofline_tokens_per_s": ceiling,
                         "share_of_roofline": batch_size / step_s / ceiling})
            r = rows[-1]
            print(f"  B={batch_size:>3} ctx={context_len:>5}: {r['step_ms']:7.1f} ms  "
                  f"{r['tokens_per_s']:7.1f} tok/s  roofline {ceiling:7.1f} tok/s  "
                  f"= {100 * r['share_of_roofline']:5.1f}%", flush=True)
    result = {"machine": {"gemm_gflops": machine.gemm_flops_per_s / 1e9,
                          "read_gb_per_s": machine.read_bytes_per_s / 1e9, "threads": _threads()},
              "model": {"weight_bytes": cost.weight_bytes, "flops_per_token": cost.flops_per_token},
              "steps": rows, "median_share": statistics.median(r["share_of_roofline"] for r in rows)}
    if args.workload or args.dataset:
        result["workload"] = run_against_ceiling(args, runner, cost, machine)
    if args.output_json:
        print(f"wrote {write_json(args.output_json, result)}")
    return 0


def run_against_ceiling(args: argparse.Namespace, runner: object, cost: ModelCost, machine: Machine) -> dict:
    """The workload's ideal-schedule ceiling, and (unless --skip-run) the engine's runs as shares of it.

    With --num-speculative-tokens, plain and speculative runs alternate against the same ceiling (the
    ceiling assumes one decode step per output token; speculative decoding can beat that premise, so
    the two are reported apart: "speculative" in the JSON)."""
    from dataclasses import replace

    from cobatch.bench.runs import EngineFactory, warm_up

    requests = workload_from_args(args)
    prompt_lens = [r.num_prompt_tokens for r in requests]
    output_lens = [r.max_tokens for r in requests]
    ideal_s = ideal_schedule_s(cost, machine, prompt_lens, output_lens)
    ceiling = sum(output_lens) / ideal_s
    print(f"workload: {len(requests)} requests, {sum(prompt_lens)} prompt + {sum(output_lens)} output tokens; "
          f"ideal schedule {ideal_s:.2f} s = {ceiling:.1f} useful tok/s")
    out = {"num_requests": len(requests), "ideal_s": ideal_s, "ceiling_tokens_per_s": ceiling}
    if args.skip_run:
        return out
    config = engine_config_from_args(args)
    factories = {"cobatch": EngineFactory(runner, replace(config, num_speculative_tokens=0))}  # type: ignore[arg-type]
    if config.num_speculative_tokens:
        factories[f"cobatch, {config.num_speculative_tokens} speculative tokens"] = \
            EngineFactory(runner, config)  # type: ignore[arg-type]
    warm_up(factories["cobatch"])
    runs = max(1, args.runs)
    rates, best_stats = _alternating_runs(factories, requests, ceiling, runs)
    out["gap_by_step_kind"] = gap_by_step_kind(best_stats, cost, machine)
    print_gap(out["gap_by_step_kind"])
    if args.plot:
        from cobatch.bench.roofline_plot import plot_run_against_ceiling

        title = f"{args.workload or args.dataset}: the best of {runs} runs against the ideal schedule's rates"
        print(f"wrote {plot_run_against_ceiling(args.plot, best_stats, cost, machine, title)}")
    for k, (label, label_rates) in enumerate(rates.items()):
        figures = _run_figures(label, label_rates, ceiling)
        if k == 0:
            out.update(figures)
        else:
            out["speculative"] = {"num_speculative_tokens": config.num_speculative_tokens, **figures}
    return out


def _alternating_runs(factories: dict, requests: list, ceiling: float,
                      runs: int) -> tuple[dict[str, list[float]], list]:
    """Each factory's engine over the workload, alternating, `runs` times: tokens/s per label and the
    steps of the best plain ("cobatch") run."""
    from cobatch.bench.runs import run_workload

    rates: dict[str, list[float]] = {label: [] for label in factories}
    best_stats: list = []
    for i in range(runs):
        for label, factory in factories.items():
            result = run_workload(factory.make(), requests)
            if label == "cobatch" and result.tokens_per_s > max(rates[label], default=0.0):
                best_stats = result.stats
            rates[label].append(result.tokens_per_s)
            print(f"{label}: {result.tokens_per_s:.1f} useful tok/s in {result.duration_s:.2f} s "
                  f"= {100 * result.tokens_per_s / ceiling:.1f}% of the ceiling"
                  + (f" (run {i + 1} of {runs})" if runs > 1 else ""), flush=True)
    return rates, best_stats


def _run_figures(label: str, rates: list[float], ceiling: float) -> dict:
    """Each run, the best (the share: each machine figure is its best probe too) and the median."""
    best, median = max(rates), statistics.median(rates)
    if len(rates) > 1:
        print(f"{label}, best of {len(rates)} runs: {best:.1f} useful tok/s = {100 * best / ceiling:.1f}% "
              f"of the ceiling (median {median:.1f} = {100 * median / ceiling:.1f}%)")
    return {"runs_tokens_per_s": rates, "tokens_per_s": best, "share_of_ceiling": best / ceiling,
            "median_tokens_per_s": median, "median_share_of_ceiling": median / ceiling}


def _threads() -> int:
    import torch

    return torch.get_num_threads()
