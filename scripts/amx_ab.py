"""gemm_bf16.c's AMX tile against its AVX512-BF16 tile on a bf16 model, offline, alternating in one process.

    .venv/bin/python scripts/amx_ab.py [MODEL] [--rounds 3] [--tokens 48] [--batch 16] [--prompt-len 512]
        [--mixed64] [--threads 1]

MODEL: a bf16 folder (benchmarks/shapes.py writes named real shapes); default: the default model. Per
round, each tile in turn: one stream (32 prompt tokens, `--tokens` out, greedy, ignore EOS), a batch of
`--batch` such requests, one prefill of `--prompt-len` tokens (1 output token) and with --mixed64 the
mixed64 workload (64 requests, issue 5's); every prompt new to the prefix cache. Prints the best of the
rounds of each, output tok/s (prefill: prompt tok/s), and the AMX / AVX512 ratios (docs/BENCHMARKS.md,
"bf16 on AMX"). Needs a CPU with AMX-BF16.
"""
from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Callable

from cobatch import LLM, SamplingParams
from cobatch.bench.datasets import preset, synthesize
from cobatch.kernels.bindings import load_kernels

TILES = {"avx512": 0, "amx": 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="default: the default model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--mixed64", action="store_true", help="also the mixed64 workload")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    lib = load_kernels()
    if lib is None or not lib.gemm_bf16_set_amx(1):
        raise SystemExit("no AMX-BF16 tile here (CPU, kernel permission or native build)")
    llm = LLM(args.model, dtype="bfloat16", num_threads=args.threads, thread_policy="fixed",
              max_model_len=max(4096, args.prompt_len + 16))
    loads = _loads(llm, args)
    best = {(load, tile): 0.0 for load in loads for tile in TILES}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for tile, on in TILES.items():
            lib.gemm_bf16_set_amx(on)
            for load, run in loads.items():
                speed = run()
                if round_ > 0:
                    best[load, tile] = max(best[load, tile], speed)
    lib.gemm_bf16_set_amx(1)
    for load in loads:
        avx, amx = best[load, "avx512"], best[load, "amx"]
        print(f"{load:12s} avx512 {avx:8.1f} tok/s  amx {amx:8.1f} tok/s  {amx / avx:.2f}x")


def _loads(llm: LLM, args: argparse.Namespace) -> dict[str, Callable[[], float]]:
    """Each load as a call that runs it once and returns its tok/s."""
    calls = itertools.count()

    def fresh(num: int, length: int) -> list[dict]:
        first = 100 + 997 * next(calls)  # prompts never seen before: no prefix-cache hits
        return [{"prompt_token_ids": [(first + i * length + t) % 40000 + 100 for t in range(length)]}
                for i in range(num)]

    def timed(prompts: list, params: SamplingParams | list[SamplingParams], tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return tokens / (time.perf_counter() - start)

    decode = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    prefill = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    loads = {"one stream": lambda: timed(fresh(1, 32), decode, args.tokens),
             f"batch {args.batch}": lambda: timed(fresh(args.batch, 32), decode, args.tokens * args.batch),
             f"prefill {args.prompt_len}": lambda: timed(fresh(1, args.prompt_len), prefill, args.prompt_len)}
    if args.mixed64:
        loads["mixed64"] = lambda: _mixed64(timed, next(calls))
    return loads


def _mixed64(timed: Callable[..., float], call: int) -> float:
    """mixed64 once: its lengths, its prompts' ids shifted per call (new to the prefix cache)."""
    requests = synthesize(preset("mixed64"))
    prompts = [{"prompt_token_ids": [(t + 7919 * call) % 29000 + 1000 for t in r.prompt_token_ids or ()]}
               for r in requests]
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in requests]
    return timed(prompts, params, sum(r.max_tokens for r in requests))


if __name__ == "__main__":
    main()
