"""Where a bf16 step's time goes inside the C layer loop the engine runs: wall time per kernel (input
norm, QKV GEMM, RoPE, K/V write, attention, o_proj, post-attention norm, gate/up GEMM with SiLU, down GEMM),
summed over the layers, from the kernels library built with -DKERNEL_TIMERS (the decode rows' K/V are written
inside the attention call, so "write_kv" holds the other rows' only; "norm" includes the final norm); and
the step's time outside the loop (embedding, lm_head, sampling, input preparation). `cobatch bench steps --profile` labels the same
parts through the torch profiler, which runs the Python layer loop instead of the C one.

    .venv/bin/python scripts/kernel_timers.py        # decode B=1,32,64 at context 256; a 12 x 170 prefill
    .venv/bin/python scripts/kernel_timers.py 32:256 8:1024 prefill:1:2048
    MODEL=/tmp/llama_cpp_shapes/qwen2.5-0.5b-q8_0.gguf DTYPE=auto NT=1 .venv/bin/python scripts/kernel_timers.py 1:64

MODEL: an HF folder or .gguf file (default: the bundled model); DTYPE: bfloat16 (default), float32 or auto;
QUANT: q8_0 or q4_0, the engine's --quantization; NT: compute threads
(default: the engine's).

Arguments: B:CTX (decode rows with CTX cached tokens each) or prefill:N:L (N fresh prompts of L tokens).
Not a benchmark of record: a tool for kernel work (run it alone; the machine is shared).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

from cobatch.bench.steps import decode_step, prefill_step
from cobatch.config import EngineConfig
from cobatch.runner.model_runner import ModelRunner
from cobatch.scheduler_output import SchedulerOutput

REPS = 20


def parse(arg: str, runner: ModelRunner) -> tuple[str, SchedulerOutput]:
    if arg.startswith("prefill:"):
        n, length = (int(v) for v in arg.split(":")[1:])
        return f"prefill {n} x {length}", prefill_step(n, length, runner.block_size)
    batch_size, context = (int(v) for v in arg.split(":"))
    return f"decode B={batch_size} ctx={context}", decode_step(batch_size, context, runner.block_size,
                                                               runner.num_kv_blocks)


def main() -> None:
    args = sys.argv[1:] or ["1:256", "32:256", "64:256", "prefill:12:170"]
    threads = int(os.environ["NT"]) if os.environ.get("NT") else None
    runner = ModelRunner.load(EngineConfig(model=os.environ.get("MODEL"), dtype=os.environ.get("DTYPE", "bfloat16"),
                                           num_threads=threads, thread_policy="fixed", max_num_batched_tokens=8192,
                                           quantization=os.environ.get("QUANT") or None))
    decoder = runner.native_decoder
    timed = decoder.with_timers() if decoder is not None else None
    if timed is None:
        raise SystemExit("the C layer loop is not available here for this model and dtype")
    runner.native_decoder = timed
    for arg in args:
        name, step = parse(arg, runner)
        runner.execute(step)  # warm-up
        timed.take_kernel_seconds()
        reps = REPS if name.startswith("decode") else 3
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            runner.execute(step)
            times.append(time.perf_counter() - start)
        kernels = timed.take_kernel_seconds()
        step_ms, loop_ms = 1000 * sum(times) / reps, 1000 * sum(kernels.values()) / reps
        print(f"{name}: step {step_ms:.2f} ms (median {1000 * statistics.median(times):.2f}), "
              f"layer loop {loop_ms:.2f}, outside it {step_ms - loop_ms:.2f}")
        print("   " + "  ".join(f"{n} {1000 * s / reps:.2f}" for n, s in kernels.items()), flush=True)


if __name__ == "__main__":
    main()
