"""gemm_bf16.c's AMX tile against its AVX512-BF16 tile on a bf16 model, offline, alternating in one process.

    .venv/bin/python scripts/amx_ab.py MODEL [--rounds 3] [--tokens 48] [--batch 16] [--prompt-len 512]

MODEL: a bf16 folder (benchmarks/shapes.py writes named real shapes). Per round, each tile in turn: one
stream (32 prompt tokens, `--tokens` out, greedy, ignore EOS), a batch of `--batch` such requests, and one
prefill of `--prompt-len` tokens (1 output token); prints the best of the rounds of each, tok/s, and the
AMX / AVX512 ratios (docs/BENCHMARKS.md, "bf16 on AMX"). One thread. Needs a CPU with AMX-BF16.
"""
from __future__ import annotations

import argparse
import time

from cobatch import LLM, SamplingParams
from cobatch.kernels.bindings import load_kernels

TILES = {"avx512": 0, "amx": 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512)
    args = parser.parse_args()
    lib = load_kernels()
    if lib is None or not lib.gemm_bf16_set_amx(1):
        raise SystemExit("no AMX-BF16 tile here (CPU, kernel permission or native build)")
    llm = LLM(args.model, dtype="bfloat16", num_threads=1, thread_policy="fixed",
              max_model_len=max(4096, args.prompt_len + 16))
    decode = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    prefill = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    short = [{"prompt_token_ids": list(range(100 + i, 132 + i))} for i in range(args.batch)]
    long = [{"prompt_token_ids": [100 + i % 1000 for i in range(args.prompt_len)]}]
    loads = {"one stream": (short[:1], decode, args.tokens), f"batch {args.batch}": (short, decode,
             args.tokens * args.batch), f"prefill {args.prompt_len}": (long, prefill, args.prompt_len)}

    def tok_s(prompts: list, params: SamplingParams, tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, params)
        return tokens / (time.perf_counter() - start)

    best = {(load, tile): 0.0 for load in loads for tile in TILES}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for tile, on in TILES.items():
            lib.gemm_bf16_set_amx(on)
            for load, spec in loads.items():
                speed = tok_s(*spec)
                if round_ > 0:
                    best[load, tile] = max(best[load, tile], speed)
    lib.gemm_bf16_set_amx(1)
    for load in loads:
        avx, amx = best[load, "avx512"], best[load, "amx"]
        print(f"{load:12s} avx512 {avx:8.1f} tok/s  amx {amx:8.1f} tok/s  {amx / avx:.2f}x")


if __name__ == "__main__":
    main()
