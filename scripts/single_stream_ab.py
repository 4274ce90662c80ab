"""gemm_quant.c's single-stream mode off and on, one stream offline, alternating in one process: tok/s.

    .venv/bin/python scripts/single_stream_ab.py MODEL [--quantization q4_0] [--rounds 4] [--tokens 48]

MODEL: a quantized GGUF file, or a dense folder / file with --quantization (quantized at load). The
runner has already chosen a mode at load (kernels/quant_linear.py, tune_single_stream: logged at INFO);
this times one request (32 prompt tokens, greedy, ignore EOS) with the mode off, then on, per round, and
prints the best of the rounds of each and their ratio (docs/BENCHMARKS.md, Quantized weights). One thread.
"""
from __future__ import annotations

import argparse
import logging
import time

from cobatch import LLM, SamplingParams
from cobatch.kernels.quant_linear import SINGLE_STREAM_ROWS, native_quant_gemm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--quantization", choices=["q8_0", "q4_0"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    llm = LLM(args.model, quantization=args.quantization, num_threads=1, thread_policy="fixed",
              max_model_len=4096)
    kernel = native_quant_gemm()
    if kernel is None:
        raise SystemExit("the quantized kernel cannot be built here")
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 132))}

    def seconds() -> float:
        start = time.perf_counter()
        llm.generate([prompt], params)
        return time.perf_counter() - start

    seconds()  # warm-up
    best = {0: float("inf"), SINGLE_STREAM_ROWS: float("inf")}
    for _ in range(args.rounds):
        for mode in best:
            kernel.set_single_stream(mode)
            best[mode] = min(best[mode], seconds())
    off, on = (args.tokens / best[mode] for mode in best)
    print(f"{args.model} {args.quantization or ''}: one stream {off:.1f} tok/s off, {on:.1f} tok/s on, "
          f"{on / off:.2f}x")


if __name__ == "__main__":
    main()
