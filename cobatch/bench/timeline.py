"""The "metro" timeline: who sits in each batch row at each step, from StepStats telemetry.

Each request takes the lowest free seat when it first gets a row and keeps it until it stops getting
rows, so a seat is a metro seat: under continuous batching a new rider sits down the step after the
last one got off; under static batching finished riders stay seated (padding, shaded) until the
batch's longest member ends.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cobatch.bench import plots
from cobatch.bench.runs import RunResult


@dataclass(frozen=True, slots=True)
class Span:
    """A request on one seat for consecutive steps, in seconds since the run started."""

    seat: int
    request_id: str
    start_s: float
    end_s: float
    is_padding: bool


def seat_spans(result: RunResult) -> list[Span]:
    """Assign seats step by step and merge each seat's consecutive steps into spans."""
    if not result.stats:
        return []
    t0 = result.stats[0].start_time
    seats: dict[str, int] = {}
    open_spans: dict[int, list] = {}  # seat -> [request_id, start, end, is_padding]
    spans: list[Span] = []
    for stat in result.stats:
        present = set(stat.row_request_ids)
        for request_id in [r for r in seats if r not in present]:
            seat = seats.pop(request_id)
            spans.append(Span(seat, *open_spans.pop(seat)))
        for request_id in stat.row_request_ids:
            padding = result.finished_step.get(request_id, stat.step) < stat.step
            end = stat.start_time - t0 + stat.duration_s
            if request_id not in seats:
                seats[request_id] = min(set(range(len(seats) + 1)) - set(seats.values()))
            seat = seats[request_id]
            current = open_spans.get(seat)
            if current is not None and current[3] != padding:  # a rider became padding: new span
                spans.append(Span(seat, *current))
                current = None
            if current is None:
                open_spans[seat] = [request_id, stat.start_time - t0, end, padding]
            else:
                current[2] = end
    spans.extend(Span(seat, *span) for seat, span in open_spans.items())
    return spans


def padding_share(result: RunResult) -> float:
    """Share of row-steps spent on padding (finished requests kept in the batch)."""
    rows = sum(s.num_rows for s in result.stats)
    return sum(s.num_padding_rows for s in result.stats) / rows if rows else 0.0


def _draw_metro(ax: object, result: RunResult, x_max: float) -> None:
    order = {rid: i for i, rid in enumerate(sorted(result.finished_step, key=lambda r: int(r[1:])
                                                     if r[1:].isdigit() else 0))}
    for span in seat_spans(result):
        color = "lightgrey" if span.is_padding else f"C{order.get(span.request_id, 0) % 10}"
        ax.broken_barh([(span.start_s, span.end_s - span.start_s)], (span.seat - 0.4, 0.8),
                       facecolors=color, edgecolors="none", hatch="///" if span.is_padding else None)
    ax.set_xlim(0, x_max)
    ax.set_ylabel("batch row")
    ax.set_title(f"{result.label}: {result.tokens_per_s:.1f} useful tok/s, "
                 f"{100 * padding_share(result):.0f}% padding row-steps (grey)")


def plot_timeline(results: list[RunResult], path: str | Path) -> Path:
    """One metro panel per run, plus KV usage and queue depth over time, on a shared time axis."""
    x_max = max(r.duration_s for r in results)
    fig, axes = plots.new_figure(len(results) + 1, 1, width=10.0, height=2.6 * (len(results) + 1),
                                 sharex=True)
    for ax, result in zip(axes, results):
        _draw_metro(ax, result, x_max)
    ax_kv = axes[-1]
    ax_queue = ax_kv.twinx()
    for i, result in enumerate(results):
        t0 = result.stats[0].start_time if result.stats else 0.0
        times = [s.start_time - t0 for s in result.stats]
        ax_kv.plot(times, [100 * s.kv_usage for s in result.stats], color=f"C{i}",
                   label=f"{result.label} KV %")
        ax_queue.plot(times, [s.num_waiting for s in result.stats], color=f"C{i}", linestyle=":",
                      label=f"{result.label} waiting")
    ax_kv.set(xlabel="seconds", ylabel="KV blocks used (%)")
    ax_queue.set_ylabel("queue depth (dotted)")
    ax_kv.legend(loc="upper right", fontsize="small")
    return plots.save(fig, path)
