"""The C layer loop against the Python one on the same model, alternating in one process: decode step ms.

    .venv/bin/python scripts/layer_loop_ab.py MODEL [--batch-sizes 1,16] [--context 64] [--rounds 3]
    .venv/bin/python scripts/layer_loop_ab.py MODEL --unpacked   # against F.linear on unpacked weights
    ... --prefill-tokens 512                                      # also a prefill step of one prompt
    .venv/bin/python scripts/layer_loop_ab.py BF16_MODEL --fp32-copies  # bf16 weights kept vs fp32 copies

Each round times `bench steps`' decode step (best of 5) with `ModelRunner.native_decoder` on, then off;
the best of the rounds is printed per batch size (docs/BENCHMARKS.md, Quantized weights). With
--unpacked the Python loop runs on a second runner whose weights were never packed (F.linear, as before
the fp32 GEMM: docs/BENCHMARKS.md, Native linear kernels). With --fp32-copies (a bf16 checkpoint on an
fp32 CPU) both sides run the C loop: on the weights kept bf16 (weight-only bf16) and on a second runner
whose loader converted them to fp32. One thread unless --num-threads says otherwise.
"""
from __future__ import annotations

import argparse
from functools import partial
from unittest import mock

from cobatch.bench.steps import decode_step, prefill_step, time_step
from cobatch.config import EngineConfig
from cobatch.models.llama import LlamaForCausalLM
from cobatch.models.loader import load_model
from cobatch.runner.model_runner import ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--unpacked", action="store_true", help="the Python loop on never-packed weights")
    parser.add_argument("--prefill-tokens", type=int, default=0, help="also one prompt of this many tokens")
    parser.add_argument("--fp32-copies", action="store_true", help="the C loop on fp32 copies of bf16 weights")
    args = parser.parse_args()
    config = EngineConfig(model=args.model, num_kv_blocks=256, max_model_len=1024, num_threads=args.num_threads,
                          thread_policy="fixed")
    runner = ModelRunner.load(config)
    native = runner.native_decoder
    if native is None:
        raise SystemExit("the C layer loop cannot run this model here (unpacked weights, or no kernels)")
    python_runner = runner
    if args.unpacked:
        with mock.patch.object(LlamaForCausalLM, "pack_linear_weights", return_value=0):
            python_runner = ModelRunner.load(config)
    if args.fp32_copies:
        with mock.patch("cobatch.runner.model_runner.load_model", partial(load_model, weight_only_bf16=False)):
            python_runner = ModelRunner.load(config)
    python = "Python loop on unpacked weights" if args.unpacked else "Python loop"
    python = "C loop on fp32 copies" if args.fp32_copies else python
    steps = [(f"B={b}", decode_step(b, args.context, runner.block_size, runner.num_kv_blocks))
             for b in map(int, args.batch_sizes.split(","))]
    if args.prefill_tokens:
        steps.append((f"prefill {args.prefill_tokens}", prefill_step(1, args.prefill_tokens, runner.block_size)))
    for label, step in steps:
        best = {"C": float("inf"), "Python": float("inf")}
        for _ in range(args.rounds):
            for name in best:
                runner.native_decoder = native if name == "C" or args.fp32_copies else None
                timed = runner if name == "C" else python_runner
                best[name] = min(best[name], time_step(timed, step, 5))
        print(f"{label}: C loop {best['C'] * 1e3:.1f} ms, {python} {best['Python'] * 1e3:.1f} ms, "
              f"{best['Python'] / best['C']:.2f}x")

if __name__ == "__main__":
    main()
