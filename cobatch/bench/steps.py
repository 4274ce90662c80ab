"""`cobatch bench steps`: decode step time vs batch size and context length, and the T(B, ctx) fit.

The runner executes synthetic decode steps directly: B rows, each with `ctx` tokens already in the KV
cache and one new token. The KV contents are whatever the pool holds (timing does not depend on the
values), so no prefill is needed to profile long contexts. Scheduler/engine overhead (well under a
millisecond a step) is not included; the online model in the engine sees it, this profile does not.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from cobatch.bench import plots
from cobatch.bench.common import write_json
from cobatch.config_cli import add_engine_args, engine_config_from_args
from cobatch.cost_model import StepTimeModel, r_squared
from cobatch.engine import Runner
from cobatch.sampling_params import SamplingParams
from cobatch.scheduler_output import ScheduledRow, SchedulerOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


@dataclass(frozen=True, slots=True)
class StepSample:
    """Median decode step time at one (batch size, context length)."""

    batch_size: int
    context_len: int
    step_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.batch_size / self.step_s

    @property
    def model_inputs(self) -> tuple[int, int, int]:
        """(rows, batched tokens, context tokens) as the engine's step-time model sees a decode step."""
        return self.batch_size, self.batch_size, self.batch_size * (self.context_len + 1)


def decode_step(batch_size: int, context_len: int, block_size: int, num_kv_blocks: int,
                token_id: int = 1000) -> SchedulerOutput:
    """B decode rows of `context_len` cached tokens each (block ids wrap if the pool is small)."""
    blocks_per_row = -(-(context_len + 1) // block_size)
    tokens = [token_id] * (context_len + 1)
    rows = tuple(
        ScheduledRow(request_id=f"s{i}", token_ids=tokens, num_prompt_tokens=context_len,
                     num_computed_tokens=context_len, num_new_tokens=1,
                     block_table=[(i * blocks_per_row + j) % num_kv_blocks for j in range(blocks_per_row)],
                     sampling_params=GREEDY, needs_sample=True)
        for i in range(batch_size))
    return SchedulerOutput(rows=rows)


def prefill_step(num_prompts: int, length: int, block_size: int) -> SchedulerOutput:
    """num_prompts fresh prompts of `length` tokens each, in their own consecutive blocks (kernel tools)."""
    blocks = -(-length // block_size)
    return SchedulerOutput(rows=tuple(
        ScheduledRow(request_id=f"p{i}", token_ids=[1000 + (7 * j + i) % 30000 for j in range(length)],
                     num_prompt_tokens=length, num_computed_tokens=0, num_new_tokens=length,
                     block_table=list(range(i * blocks, (i + 1) * blocks)), sampling_params=GREEDY,
                     needs_sample=True)
        for i in range(num_prompts)))


def time_step(runner: Runner, output: SchedulerOutput, reps: int) -> float:
    """Median seconds of `reps` executions after one warm-up."""
    runner.execute(output)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        runner.execute(output)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile(runner: Runner, batch_sizes: list[int], contexts: list[int], block_size: int,
            reps: int = 5) -> list[StepSample]:
    """Median decode step time at every (B, ctx)."""
    samples = []
    for context_len in contexts:
        for batch_size in batch_sizes:
            step = decode_step(batch_size, context_len, block_size, runner.num_kv_blocks)
            samples.append(StepSample(batch_size, context_len, time_step(runner, step, reps)))
            print(f"  B={batch_size:>3} ctx={context_len:>5}: {1000 * samples[-1].step_s:7.1f} ms  "
                  f"{samples[-1].tokens_per_s:7.1f} tok/s", flush=True)
    return samples


def fit(samples: list[StepSample]) -> tuple[StepTimeModel, float]:
    """Least squares over all samples (no forgetting); returns the model and its R²."""
    model = StepTimeModel(decay=1.0, min_samples=1)
    for s in samples:
        model.observe(*s.model_inputs, s.step_s)
    model.fit()
    return model, r_squared(model, [(*s.model_inputs, s.step_s) for s in samples])


def coefficients_ms(model: StepTimeModel) -> dict[str, float]:
    """The fit in readable units. Decode rows have rows == tokens, so their two terms are one."""
    c0, c_row, c_token, c_ctx = model.coefficients
    return {"constant_ms": 1000 * c0, "per_seq_ms": 1000 * (c_row + c_token),
            "per_1k_context_tokens_ms": 1e6 * c_ctx}


def predict_ms(model: StepTimeModel, batch_size: int, context_len: int) -> float:
    return 1000 * model.predict(batch_size, batch_size, batch_size * (context_len + 1))


def max_batch_for_slo(model: StepTimeModel, slo_ms: float, context_len: int, limit: int) -> int:
    """Largest B <= limit whose predicted decode step (= TPOT) meets the SLO; 0 if even B=1 breaks it."""
    best = 0
    for batch_size in range(1, limit + 1):
        if predict_ms(model, batch_size, context_len) <= slo_ms:
            best = batch_size
    return best


def batch_ratio(samples: list[StepSample], context_len: int, big: int = 32, small: int = 1) -> float:
    """T(big)/T(small) measured at one context length (NaN if not profiled)."""
    by_b = {s.batch_size: s.step_s for s in samples if s.context_len == context_len}
    return by_b[big] / by_b[small] if big in by_b and small in by_b else float("nan")


def plot(samples: list[StepSample], model: StepTimeModel, path: str) -> str:
    """Step ms (measured and fitted) and tokens/s against B, one line per context length."""
    fig, (ax_t, ax_tps) = plots.new_figure(1, 2, width=11.0)
    for i, ctx in enumerate(sorted({s.context_len for s in samples})):
        pts = [s for s in samples if s.context_len == ctx]
        bs = [s.batch_size for s in pts]
        ax_t.plot(bs, [1000 * s.step_s for s in pts], "o", color=f"C{i}", label=f"ctx {ctx}")
        ax_t.plot(bs, [predict_ms(model, b, ctx) for b in bs], "-", color=f"C{i}", alpha=0.6)
        ax_tps.plot(bs, [s.tokens_per_s for s in pts], "o-", color=f"C{i}", label=f"ctx {ctx}")
    for ax, ylabel in ((ax_t, "decode step (ms); lines: fit"), (ax_tps, "tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set(xlabel="batch size B", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    ax_t.set_title("step time: nearly flat at small B?")
    ax_tps.set_title("throughput grows with B")
    return str(plots.save(fig, path))


def powers_of_two(limit: int) -> list[int]:
    sizes, b = [], 1
    while b <= limit:
        sizes.append(b)
        b *= 2
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)  # B = 1, 2, 4, ... up to --max-num-seqs
    parser.add_argument("--contexts", default="128,512", help="context lengths, comma-separated")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--slo-context", type=int, default=None,
                        help="with --tpot-slo-ms: print the largest max_num_seqs meeting it at this "
                             "context length (default: the largest profiled)")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--profile", action="store_true",
                        help="also print where a decode step's time goes (per part, summed over layers) "
                             "at the smallest and largest batch of each context")


def breakdown(runner: Runner, batch_size: int, context_len: int, block_size: int,
              reps: int = 3) -> dict[str, float]:
    """Median seconds per part of one decode step (ModelRunner.profile_step), over `reps` profiled runs."""
    step = decode_step(batch_size, context_len, block_size, runner.num_kv_blocks)
    runner.execute(step)  # warm-up
    runs = [runner.profile_step(step) for _ in range(reps)]  # type: ignore[attr-defined]
    return {part: statistics.median(r[part] for r in runs) for part in runs[0]}


def print_breakdown(batch_size: int, context_len: int, parts: dict[str, float]) -> None:
    total = sum(parts.values())
    how = ("under the torch profiler (the Python layer loop with labels; the profiler's own overhead "
           "inflates many-small-op parts)" if "embed+rope_tables" in parts
           else "with the C layer loop's kernel timers (other: embedding and Python glue)")
    print(f"  B={batch_size} ctx={context_len}: {1000 * total:.1f} ms {how}")
    for part, seconds in parts.items():
        print(f"    {part:>18} {1000 * seconds:8.2f} ms  {100 * seconds / total:5.1f}%")


def profile_breakdowns(runner: Runner, batch_sizes: list[int], contexts: list[int],
                       block_size: int) -> list[dict]:
    """Per-part profiles at the smallest and largest batch of every context."""
    out = []
    print("where a decode step's time goes:")
    for context_len in contexts:
        for batch_size in sorted({min(batch_sizes), max(batch_sizes)}):
            parts = breakdown(runner, batch_size, context_len, block_size)
            print_breakdown(batch_size, context_len, parts)
            out.append({"batch_size": batch_size, "context_len": context_len,
                        "parts_ms": {k: 1000 * v for k, v in parts.items()}})
    return out


def report(samples: list[StepSample], model: StepTimeModel, r2: float) -> dict:
    contexts = sorted({s.context_len for s in samples})
    return {"samples": [{"batch_size": s.batch_size, "context_len": s.context_len,
                         "step_ms": 1000 * s.step_s, "tokens_per_s": s.tokens_per_s} for s in samples],
            "fit": coefficients_ms(model), "r_squared": r2,
            "t32_over_t1": {ctx: batch_ratio(samples, ctx) for ctx in contexts}}


def main(args: argparse.Namespace) -> int:
    from cobatch.runner.model_runner import ModelRunner

    config = engine_config_from_args(args)
    runner = ModelRunner.load(config)
    contexts = [int(c) for c in args.contexts.split(",")]
    samples = profile(runner, powers_of_two(config.max_num_seqs), contexts, config.block_size, args.reps)
    model, r2 = fit(samples)
    result = report(samples, model, r2)
    fit_ms = result["fit"]
    print(f"fit: T = {fit_ms['constant_ms']:.2f} ms + {fit_ms['per_seq_ms']:.3f} ms·B "
          f"+ {fit_ms['per_1k_context_tokens_ms']:.3f} ms per 1k context tokens   R² = {r2:.3f}")
    for ctx, ratio in result["t32_over_t1"].items():
        print(f"T(32)/T(1) at ctx {ctx}: {ratio:.2f}")
    if args.tpot_slo_ms:
        ctx = args.slo_context or max(contexts)
        best = max_batch_for_slo(model, args.tpot_slo_ms, ctx, config.max_num_seqs)
        result["slo"] = {"tpot_slo_ms": args.tpot_slo_ms, "context_len": ctx, "max_num_seqs": best}
        print(f"largest max_num_seqs with predicted TPOT <= {args.tpot_slo_ms} ms at ctx {ctx}: {best}")
    if args.profile:
        result["profile"] = profile_breakdowns(runner, powers_of_two(config.max_num_seqs), contexts,
                                               config.block_size)
    if args.output_json:
        print(f"wrote {write_json(args.output_json, result)}")
    if args.plot:
        print(f"wrote {plot(samples, model, args.plot)}")
    return 0
