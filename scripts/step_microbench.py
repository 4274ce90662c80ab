"""Step microbench for kernel work: median ms of a 12x170-token prefill step and of decode steps at B=1,8,32,64
(ctx 256; BS=1,8,16 picks others), bf16, NT threads (default 2); --profile adds the per-part split. Not a benchmark of record
(see `cobatch bench`): a quick A/B tool while changing kernels."""
import sys, time, statistics, os
import torch
from cobatch.config import EngineConfig
from cobatch.runner.model_runner import ModelRunner
from cobatch.bench.steps import decode_step, prefill_step
prof = "--profile" in sys.argv
eager_ops = "--eager-ops" in sys.argv  # the torch path of norm/rope/SiLU instead of the fused kernels
torch.set_num_threads(int(os.environ.get("NT", "2")))
r = ModelRunner.load(EngineConfig(dtype="bfloat16", num_kv_blocks=2400, max_model_len=1024))
if eager_ops:
    from cobatch.kernels.fused_ops import EAGER
    r.model.ops = EAGER
cases = [("prefill12x170", prefill_step(12, 170, 16))] + [(f"decode B={b}", decode_step(b, 256, 16, 2400)) for b in [int(v) for v in os.environ.get("BS", "1,8,32,64").split(",")]]
for name, out in cases:
    r.execute(out)
    ts = []
    for _ in range(5 if "decode" in name else 3):
        t = time.perf_counter(); r.execute(out); ts.append(time.perf_counter() - t)
    line = f"{name:>15}: {1000*statistics.median(ts):8.1f} ms (min {1000*min(ts):.1f})"
    if prof:
        parts = r.profile_step(out)
        line += "  | " + " ".join(f"{k}={1000*v:.1f}" for k, v in parts.items())
    print(line, flush=True)
