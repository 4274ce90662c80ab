"""Packed-weight GEMM (cobatch.kernels.linear: gemm_bf16.c or gemm_f32.c) vs F.linear with the weights NOT
in cache, as in a step.

A fake step runs one model's linears (cobatch's fused shapes: qkv, o, gate_up, down) over enough copies
of each weight that a pass reads well over the L3 (at least COPY_MB of each shape), then lm_head; each
call is timed. Kernel and F.linear steps alternate in one process (the machine is shared and noisy); the
table gives medians over REPS steps of each shape's median call: us, weight GB/s, GFLOP/s, speedup; the
step line weighs each shape by its count in the model. lm_head runs only at M <= 64 (a step computes
logits for its sampled rows alone).

    DTYPE=bf16 MODEL=smollm2 NT=2,1 MS=1,2,4,8,16,32,64 REPS=7 .venv/bin/python scripts/linear_microbench.py
    DTYPE=fp32 MODEL=llama1b MS=1,2,4,8,16,32,64,256 REPS=3 ...  the fp32 kernel on Llama-3.2-1B's shapes
Not a benchmark of record: a tool for kernel work. Run it alone: 2-thread timings on a 2-core machine
collapse when anything else runs.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from cobatch.kernels.linear import linear, native_gemm, pack_weight

Linear = Callable[[torch.Tensor, str, int], torch.Tensor]  # (x, shape name, copy)
# name -> (layers, {shape: (N, K)}): the fused projections cobatch runs (qkv = q | k | v, gate_up = gate | up)
MODELS = {
    "smollm2": (30, {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                     "lm_head": (49152, 576)}),
    "llama1b": (16, {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
                     "lm_head": (128256, 2048)}),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LM_HEAD_MAX_M = 64


def env_ints(name: str, default: str) -> list[int]:
    return [int(v) for v in os.environ.get(name, default).split(",")]


def num_copies(shape: tuple[int, int], dtype: torch.dtype) -> int:
    """Enough copies of a weight that one pass over them reads COPY_MB (well over the L3); lm_head: one."""
    nbytes = shape[0] * shape[1] * dtype.itemsize
    return max(1, math.ceil(int(os.environ.get("COPY_MB", "128")) * 2 ** 20 / nbytes))


def make_weights(shapes: dict[str, tuple[int, int]], dtype: torch.dtype) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return {name: [(torch.randn(n, k, generator=g) * 0.05).to(dtype)
                   for _ in range(1 if name == "lm_head" else num_copies((n, k), dtype))]
            for name, (n, k) in shapes.items()}


def fake_step(fn: Linear, xs: dict[int, torch.Tensor], shapes: dict[str, tuple[int, int]],
              copies: dict[str, int]) -> dict[str, float]:
    """One pass in model order (copy by copy, then lm_head) -> median ns per call of each shape."""
    times: dict[str, list[int]] = {name: [] for name in shapes}
    layer_shapes = [name for name in shapes if name != "lm_head"]
    order = [(name, i) for i in range(max(copies.values())) for name in layer_shapes if i < copies[name]]
    if xs[shapes["lm_head"][1]].shape[0] <= LM_HEAD_MAX_M:
        order.append(("lm_head", 0))
    for name, i in order:
        x = xs[shapes[name][1]]
        start = time.perf_counter_ns()
        fn(x, name, i)
        times[name].append(time.perf_counter_ns() - start)
    return {name: statistics.median(ts) if ts else math.nan for name, ts in times.items()}


def measure(fns: dict[str, Linear], m: int, reps: int, shapes: dict[str, tuple[int, int]],
            copies: dict[str, int], dtype: torch.dtype) -> dict[str, dict[str, float]]:
    xs = {k: torch.randn(m, k).to(dtype) for k in {k for _, k in shapes.values()}}
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in fns}
    for rep in range(reps + 1):  # rep 0 warms up; the order alternates so neither side always goes first
        for label in (list(fns) if rep % 2 else list(fns)[::-1]):
            result = fake_step(fns[label], xs, shapes, copies)
            if rep:
                runs[label].append(result)
    return {label: {name: statistics.median(r[name] for r in rs) for name in shapes} for label, rs in runs.items()}


def report(m: int, medians: dict[str, dict[str, float]], shapes: dict[str, tuple[int, int]], layers: int,
           dtype: torch.dtype) -> None:
    kernel, torch_ = medians["kernel"], medians["torch"]
    for name, (n, k) in shapes.items():
        if math.isnan(kernel[name]):
            continue
        nbytes, flops = n * k * dtype.itemsize, 2 * m * n * k
        cells = [f"{t / 1e3:9.1f} {nbytes / t:5.1f} {flops / t:6.1f}" for t in (kernel[name], torch_[name])]
        print(f"{name:>8} {m:>4} | {cells[0]} | {cells[1]} | {torch_[name] / kernel[name]:5.2f}x")
    step = {label: sum(med[name] * (1 if name == "lm_head" else layers) for name in shapes
                       if not math.isnan(med[name])) / 1e6 for label, med in medians.items()}
    print(f"{'step ms':>8} {m:>4} | {step['kernel']:9.2f} {'':>12} | {step['torch']:9.2f} {'':>12} | "
          f"{step['torch'] / step['kernel']:5.2f}x", flush=True)


def main() -> None:
    dtype = DTYPES[os.environ.get("DTYPE", "bf16")]
    layers, shapes = MODELS[os.environ.get("MODEL", "smollm2")]
    if native_gemm(dtype) is None:
        raise SystemExit(f"native {dtype} GEMM kernel not available here")
    weights = make_weights(shapes, dtype)
    copies = {name: len(ws) for name, ws in weights.items()}
    packed = {name: [pack_weight(w) for w in ws] for name, ws in weights.items()}
    fns: dict[str, Linear] = {"kernel": lambda x, name, i: linear(x, packed[name][i]),
                              "torch": lambda x, name, i: F.linear(x, weights[name][i])}
    reps = int(os.environ.get("REPS", "7"))
    for threads in env_ints("NT", "2,1"):
        torch.set_num_threads(threads)
        print(f"== {dtype}, {threads} thread(s), copies {copies}; per call: us, weight GB/s, GFLOP/s")
        print(f"{'shape':>8} {'M':>4} | {'kernel':^22} | {'F.linear':^22} | speedup")
        for m in env_ints("MS", "1,2,4,8,16,32,64"):
            report(m, measure(fns, m, reps, shapes, copies, dtype), shapes, layers, dtype)


if __name__ == "__main__":
    main()
