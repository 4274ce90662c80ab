"""What recording wait reasons costs the scheduler: 64 running sequences and 1000 waiting, with and without it.

No model: the scheduler's own step (schedule, update with one sampled token per row, stats as the engine
reads them every step) timed over steps, with the WaitLedger and with a no-op one in its place,
alternating; and the ledger's own time, summed inside its methods (the A/B difference drowns in the
shared host's noise, the direct sum does not). Scenarios: the waiting queue held by max_num_seqs (nobody
examined: one shared reason), and by free KV blocks (a seat is free, the head's prompt does not fit: it is
examined and held every step, the 999 behind it share its reason; the running ones still grow).

    .venv/bin/python -m benchmarks.wait_cost [--steps 300] [--repeats 5] [--output-json docs/bench/wait_cost.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from cobatch.config import SchedulerConfig
from cobatch.request import Request
from cobatch.sampling_params import SamplingParams
from cobatch.scheduler import Scheduler
from cobatch.scheduler_output import RunnerOutput
from cobatch.wait_ledger import WaitLedger, WaitRecord
from cobatch.wait_reasons import StepWaits

NUM_RUNNING, NUM_WAITING, BLOCK_SIZE = 64, 1000, 16


class NoLedger(WaitLedger):
    """The ledger's interface doing nothing: the scheduler as it was without wait reasons."""

    def enter(self, record: WaitRecord, queue: str) -> None:
        record.queue = queue

    def leave(self, record: WaitRecord, queue: str) -> None:
        record.queue = queue

    def hold(self, seq_id: str, record: WaitRecord, reason: str) -> None:
        pass

    def preempted(self, seq_id: str, record: WaitRecord, choice: object, queue: str) -> None:  # type: ignore[override]
        record.queue = queue

    def end_step(self, waiting_reason: str | None, swapped_reason: str | None, num_waiting: int,
                 num_swapped: int) -> StepWaits:
        return self.last


class TimedLedger(WaitLedger):
    """The real ledger, summing the seconds spent in the methods the scheduler calls."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0

    def _timed(self, method: Callable[..., object], *args: object) -> object:
        start = time.perf_counter()
        result = method(*args)
        self.seconds += time.perf_counter() - start
        return result

    def enter(self, record: WaitRecord, queue: str) -> None:
        self._timed(super().enter, record, queue)

    def leave(self, record: WaitRecord, queue: str) -> None:
        self._timed(super().leave, record, queue)

    def hold(self, seq_id: str, record: WaitRecord, reason: str) -> None:
        self._timed(super().hold, seq_id, record, reason)

    def preempted(self, seq_id: str, record: WaitRecord, choice: object, queue: str) -> None:  # type: ignore[override]
        self._timed(super().preempted, seq_id, record, choice, queue)

    def end_step(self, waiting_reason: str | None, swapped_reason: str | None, num_waiting: int,
                 num_swapped: int) -> StepWaits:
        return self._timed(super().end_step, waiting_reason, swapped_reason, num_waiting,  # type: ignore[return-value]
                           num_swapped)


def _request(i: int, num_prompt: int) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
    return Request(f"r{i}", [(i * 31 + j) % 5000 + 3 for j in range(num_prompt)], params, (), 4000,
                   arrival_time=float(i))


def build(scenario: str, ledger: WaitLedger, num_steps: int) -> Scheduler:
    """64 sequences running (decoding after this warm-up) and 1000 waiting behind them."""
    blocks_per_seq = -(-(100 + num_steps + 2) // BLOCK_SIZE)  # enough to decode every step: no preemption
    num_blocks = NUM_RUNNING * blocks_per_seq + 8
    is_seats = scenario == "seats"
    # The head's prompt needs more blocks than are ever free (a pool of it fits, for the config's check).
    head_len = (num_blocks - NUM_RUNNING * 7 + 1) * BLOCK_SIZE
    config = SchedulerConfig(num_kv_blocks=num_blocks, block_size=BLOCK_SIZE,
                             max_num_seqs=NUM_RUNNING if is_seats else NUM_RUNNING + 1,
                             max_model_len=head_len + 16, max_num_batched_tokens=head_len + 2 * NUM_RUNNING,
                             watermark=0.0, enable_prefix_caching=False)
    scheduler = Scheduler(config)
    scheduler.waits = ledger
    for i in range(NUM_RUNNING):
        scheduler.add_request(_request(i, 100))
    _step(scheduler)  # their prompts
    for i in range(NUM_RUNNING, NUM_RUNNING + NUM_WAITING):
        scheduler.add_request(_request(i, 100 if is_seats or i > NUM_RUNNING else head_len))
    if isinstance(ledger, TimedLedger):
        ledger.seconds = 0.0  # only the timed steps count
    return scheduler


def _step(scheduler: Scheduler) -> None:
    output = scheduler.schedule()
    sampled = tuple(7 for row in output.rows for _ in range(row.num_samples))
    scheduler.update(output, RunnerOutput(sampled, (None,) * len(sampled)))
    scheduler.stats()  # the engine reads them after every step


def time_steps(scheduler: Scheduler, num_steps: int) -> float:
    """Mean seconds of one scheduler step over `num_steps`."""
    start = time.perf_counter()
    for _ in range(num_steps):
        _step(scheduler)
    return (time.perf_counter() - start) / num_steps


def measure(scenario: str, num_steps: int, repeats: int) -> dict:
    """Alternating runs with the (timed) ledger and without: step medians, the ledger's own time."""
    runs: dict[str, list[float]] = {"with": [], "without": [], "ledger": []}
    for _ in range(repeats):
        ledger = TimedLedger()
        runs["with"].append(time_steps(build(scenario, ledger, num_steps), num_steps))
        runs["ledger"].append(ledger.seconds / num_steps)
        runs["without"].append(time_steps(build(scenario, NoLedger(), num_steps), num_steps))
    scheduler = build(scenario, WaitLedger(), num_steps)
    _step(scheduler)
    with_us, without_us, ledger_us = (1e6 * statistics.median(runs[k]) for k in ("with", "without", "ledger"))
    return {"scenario": scenario, "num_running": NUM_RUNNING, "num_waiting": len(scheduler.waiting),
            "held_per_step": len(scheduler.waits.last.held), "step_us_with": with_us,
            "step_us_without": without_us, "ledger_us": ledger_us,
            "runs_us": {k: [1e6 * v for v in vs] for k, vs in runs.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    results = [measure(s, args.steps, args.repeats) for s in ("seats", "blocks")]
    for r in results:
        print(f"{r['scenario']:>9}: {r['num_running']} running, {r['num_waiting']} waiting, "
              f"{r['held_per_step']} examined a step: the wait ledger takes {r['ledger_us']:.1f} us a step; "
              f"the step {r['step_us_with']:.0f} us with it, {r['step_us_without']:.0f} us without")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
