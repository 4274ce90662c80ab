"""`bench roofline --workload ... --plot`: a run step by step against the ceiling's rates.

Top: cumulative seconds of the run's steps, measured and at the ceiling's rates (step_ideal_s), with the
prefill-carrying steps shaded: the gap between the two lines is the run's lost time and its slope shows
where it grows. Bottom: each step's rows (the batch) and its measured time over its ideal time.
"""

from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING, Sequence

from cobatch.bench import plots
from cobatch.bench.roofline import Machine, ModelCost, step_ideal_s

if TYPE_CHECKING:
    from cobatch.engine import StepStats


def plot_run_against_ceiling(path: str, stats: Sequence[StepStats], cost: ModelCost, machine: Machine,
                             title: str) -> str:
    ideal = [step_ideal_s(cost, machine, s.num_prefill_tokens, s.num_decode_tokens, s.num_generated_tokens)
             for s in stats]
    steps = list(range(len(stats)))
    fig, (ax_sum, ax_step) = plots.new_figure(2, 1, width=10.0, height=7.0, sharex=True)
    ax_sum.plot(steps, list(accumulate(s.duration_s for s in stats)), label="measured")
    ax_sum.plot(steps, list(accumulate(ideal)), label="at the ceiling's rates")
    for i, s in enumerate(stats):
        if s.num_prefill_tokens:
            ax_sum.axvspan(i - 0.5, i + 0.5, color="grey", alpha=0.2, lw=0)
    ax_sum.set(title=title, ylabel="cumulative seconds (grey: steps with prompt tokens)")
    ax_sum.legend()
    ax_sum.grid(alpha=0.3)
    ax_step.plot(steps, [s.num_rows - s.num_padding_rows for s in stats], color="C2", label="rows (batch)")
    ax_step.set(xlabel="step", ylabel="rows")
    ratio = ax_step.twinx()
    ratio.plot(steps, [s.duration_s / t if t > 0 else float("nan") for s, t in zip(stats, ideal)], color="C3",
               lw=0.8, label="measured / ideal step time")
    ratio.set(ylabel="measured / ideal")
    ratio.set_ylim(bottom=0)
    ax_step.legend(loc="upper left")
    ratio.legend(loc="upper right")
    ax_step.grid(alpha=0.3)
    return str(plots.save(fig, path))
