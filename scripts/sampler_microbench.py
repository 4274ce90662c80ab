"""The sampler alone over a large vocabulary: ms per call for 1 and 16 rows of temperature, top-k, top-p.

Rows look like a trained model's (a few hundred plausible tokens over a flat tail), one torch thread,
best of REPS calls. --baseline OLD.py times another version of cobatch/runner/sampler.py side by side
in the same process (alternating), e.g. the one before top-k / top-p on candidates:

    git show b3d1ece~1:cobatch/runner/sampler.py > /tmp/old_sampler.py
    .venv/bin/python scripts/sampler_microbench.py --baseline /tmp/old_sampler.py [--vocab 151936]
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from typing import Callable

import torch

from cobatch.runner.sampler import Sampler
from cobatch.sampling_params import SamplingParams
from cobatch.scheduler_output import ScheduledRow

CASES = {"temperature 0.8": SamplingParams(temperature=0.8),
         "top_k 40": SamplingParams(temperature=0.8, top_k=40),
         "top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
         "top_k 50 + top_p 0.9": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
         "seeded top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9, seed=1)}


def best_ms(call: Callable[[], object], reps: int) -> float:
    call()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def load_baseline(path: str) -> type:
    spec = importlib.util.spec_from_file_location("baseline_sampler", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.Sampler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--baseline", default=None, help="another sampler.py to time side by side")
    args = parser.parse_args()
    torch.set_num_threads(1)
    baseline = load_baseline(args.baseline) if args.baseline else None
    gen = torch.Generator().manual_seed(0)
    print("| rows | sampling | baseline ms | ms | speed-up |\n|---|---|---|---|---|")
    for num_rows in (1, 16):
        logits = torch.randn(num_rows, args.vocab, generator=gen)
        logits[:, :300] += 15 * torch.rand(num_rows, 300, generator=gen)
        for name, params in CASES.items():
            rows = [ScheduledRow(str(i), [1, 2], 1, 1, 1, [0], params, True) for i in range(num_rows)]
            new = Sampler(0)
            old_ms = best_ms(lambda: baseline(0)(logits, rows), args.reps) if baseline else float("nan")
            new_ms = best_ms(lambda: new(logits, rows), args.reps)
            print(f"| {num_rows} | {name} | {old_ms:.1f} | {new_ms:.2f} | {old_ms / new_ms:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
