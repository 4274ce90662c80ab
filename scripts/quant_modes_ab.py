"""gemm_quant.c's speed modes off and on, offline, alternating in one process: tok/s.

    .venv/bin/python scripts/quant_modes_ab.py MODEL [--mode single-stream|single-prefetch|wide-tiles|amx]
        [--quantization q4_0] [--batch N] [--rounds 4] [--tokens 48]

MODEL: a quantized GGUF file, or a dense folder / file with --quantization (quantized at load). The
runner has already chosen each mode at load (kernels/quant_linear.py, tune_single_stream and
tune_wide_tiles: logged at INFO); this times `--batch` requests (default: 1 for single-stream mode and
its prefetch, 16 for wide tiles and AMX; 32 prompt tokens each, greedy, ignore EOS) with the mode off, then on,
per round, and prints the best of the rounds of each and their ratio (docs/BENCHMARKS.md, Quantized
weights). single-prefetch: single-stream mode on, its software prefetch off, then on. amx: the 16-row groups
of the K-quants, Q4_0, Q5_0 and IQ4_NL on the VNNI tiles, then on AMX-INT8 (gemm_quant_set_amx). One thread.
"""
from __future__ import annotations

import argparse
import itertools
import logging
import time

from cobatch import LLM, SamplingParams
from cobatch.kernels.quant_linear import SINGLE_STREAM_ROWS, WIDE_TILE_ROWS, native_quant_gemm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--mode", choices=["single-stream", "single-prefetch", "wide-tiles", "amx"],
                        default="single-stream")
    parser.add_argument("--quantization", choices=["q8_0", "q4_0"])
    parser.add_argument("--batch", type=int)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    llm = LLM(args.model, quantization=args.quantization, num_threads=1, thread_policy="fixed",
              max_model_len=4096)
    kernel = native_quant_gemm()
    if kernel is None:
        raise SystemExit("the quantized kernel cannot be built here")
    set_mode, on = {"single-stream": (kernel.set_single_stream, SINGLE_STREAM_ROWS),
                    "single-prefetch": (kernel.set_single_prefetch, 1),
                    "wide-tiles": (kernel.set_wide_tiles, 1),
                    "amx": (kernel.set_amx, 1)}[args.mode]
    if args.mode == "amx" and not kernel.set_amx(True):
        raise SystemExit("no AMX-INT8 tile unit here")
    if args.mode == "single-prefetch":
        kernel.set_single_stream(SINGLE_STREAM_ROWS)
    batch = args.batch or (WIDE_TILE_ROWS if args.mode in ("wide-tiles", "amx") else 1)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    calls = itertools.count()

    def seconds() -> float:
        first = 100 + 997 * next(calls)  # prompts new to the prefix cache
        prompts = [{"prompt_token_ids": [(first + 32 * i + t) % 40000 + 100 for t in range(32)]}
                   for i in range(batch)]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    seconds()  # warm-up
    best = {0: float("inf"), on: float("inf")}
    for _ in range(args.rounds):
        for mode in best:
            set_mode(mode)
            best[mode] = min(best[mode], seconds())
    off_tok_s, on_tok_s = (batch * args.tokens / best[mode] for mode in best)
    print(f"{args.model} {args.quantization or ''} {args.mode}, {batch} at once: {off_tok_s:.1f} tok/s off, "
          f"{on_tok_s:.1f} tok/s on, {on_tok_s / off_tok_s:.2f}x")


if __name__ == "__main__":
    main()
