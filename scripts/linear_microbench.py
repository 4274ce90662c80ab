"""Packed-weight bf16 GEMM (cobatch.kernels.linear) vs F.linear with the weights NOT in cache, as in a step.

A fake step runs the SmolLM2-135M linears of 30 layers (qkv [960,576], o [576,576], gate_up [3072,576],
down [576,1536]: ~212 MB of distinct weights, well over the 32 MB L3) and lm_head [49152,576]; each call is
timed. Kernel and F.linear steps alternate in one process (the machine is shared and noisy); the table
gives medians over REPS steps of each shape's median call: us, weight GB/s, GFLOP/s, speedup.

    NT=2,1 MS=1,2,4,8,16,32,64 REPS=7 .venv/bin/python scripts/linear_microbench.py
    MS=256,1024 ... prefill sizes.
Not a benchmark of record: a tool for kernel work. Run it alone: 2-thread timings on a 2-core machine
collapse when anything else runs.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from cobatch.kernels.linear import linear, native_gemm, pack_weight

Linear = Callable[[torch.Tensor, str, int], torch.Tensor]  # (x, shape name, layer)
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
LAYERS = 30


def env_ints(name: str, default: str) -> list[int]:
    return [int(v) for v in os.environ.get(name, default).split(",")]


def make_weights() -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    copies = {name: 1 if name == "lm_head" else LAYERS for name in SHAPES}
    return {name: [(torch.randn(n, k, generator=g) * 0.05).bfloat16() for _ in range(copies[name])]
            for name, (n, k) in SHAPES.items()}


def fake_step(fn: Linear, xs: dict[int, torch.Tensor]) -> dict[str, float]:
    """One pass in model order (layer by layer, then lm_head) -> median ns per call of each shape."""
    times: dict[str, list[int]] = {name: [] for name in SHAPES}
    order = [(name, i) for i in range(LAYERS) for name in ("qkv", "o", "gate_up", "down")] + [("lm_head", 0)]
    for name, i in order:
        x = xs[SHAPES[name][1]]
        start = time.perf_counter_ns()
        fn(x, name, i)
        times[name].append(time.perf_counter_ns() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def measure(fns: dict[str, Linear], m: int, reps: int) -> dict[str, dict[str, float]]:
    xs = {k: torch.randn(m, k).bfloat16() for k in {k for _, k in SHAPES.values()}}
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in fns}
    for rep in range(reps + 1):  # rep 0 warms up; the order alternates so neither side always goes first
        for label in (list(fns) if rep % 2 else list(fns)[::-1]):
            result = fake_step(fns[label], xs)
            if rep:
                runs[label].append(result)
    return {label: {name: statistics.median(r[name] for r in rs) for name in SHAPES} for label, rs in runs.items()}


def report(m: int, medians: dict[str, dict[str, float]]) -> None:
    kernel, torch_ = medians["kernel"], medians["torch"]
    for name, (n, k) in SHAPES.items():
        nbytes, flops = n * k * 2, 2 * m * n * k
        cells = [f"{t / 1e3:9.1f} {nbytes / t:5.1f} {flops / t:6.1f}" for t in (kernel[name], torch_[name])]
        print(f"{name:>8} {m:>4} | {cells[0]} | {cells[1]} | {torch_[name] / kernel[name]:5.2f}x")
    step = {label: sum(med[name] * (1 if name == "lm_head" else LAYERS) for name in SHAPES) / 1e6
            for label, med in medians.items()}
    print(f"{'step ms':>8} {m:>4} | {step['kernel']:9.2f} {'':>12} | {step['torch']:9.2f} {'':>12} | "
          f"{step['torch'] / step['kernel']:5.2f}x", flush=True)


def main() -> None:
    if native_gemm() is None:
        raise SystemExit("native GEMM kernel not available here")
    weights = make_weights()
    packed = {name: [pack_weight(w) for w in ws] for name, ws in weights.items()}
    fns: dict[str, Linear] = {"kernel": lambda x, name, i: linear(x, packed[name][i]),
                              "torch": lambda x, name, i: F.linear(x, weights[name][i])}
    reps = int(os.environ.get("REPS", "7"))
    for threads in env_ints("NT", "2,1"):
        torch.set_num_threads(threads)
        print(f"== {threads} thread(s); per call: us, weight GB/s, GFLOP/s")
        print(f"{'shape':>8} {'M':>4} | {'kernel':^22} | {'F.linear':^22} | speedup")
        for m in env_ints("MS", "1,2,4,8,16,32,64"):
            report(m, measure(fns, m, reps))


if __name__ == "__main__":
    main()
