"""What recording wait reasons costs the scheduler: 64 running sequences and 1000 waiting, with and without it.

No model: the scheduler's own step (schedule, update with one sampled token per row, stats as the engine
reads them every step) timed over steps, with the WaitLedger and with a no-op one in its place,
alternating. Scenarios: the waiting queue held by max_num_seqs (nobody examined: one shared reason), and
by the KV watermark (a seat is free: the head is examined and held every step, the rest share its reason;
the same path as too few free blocks, without the preemptions a full pool would bring).

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


def _request(i: int, num_prompt: int) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
    return Request(f"r{i}", [(i * 31 + j) % 5000 + 3 for j in range(num_prompt)], params, (), 4000,
                   arrival_time=float(i))


def build(scenario: str, ledger: WaitLedger, num_steps: int) -> Scheduler:
    """64 sequences running (decoding after this warm-up) and 1000 waiting behind them."""
    blocks_per_seq = -(-(100 + num_steps + 2) // BLOCK_SIZE)  # enough to decode every step: no preemption
    num_blocks = 4 * NUM_RUNNING * blocks_per_seq
    is_seats = scenario == "seats"
    config = SchedulerConfig(num_kv_blocks=num_blocks, block_size=BLOCK_SIZE,
                             max_num_seqs=NUM_RUNNING if is_seats else NUM_RUNNING + 1,
                             max_model_len=2048, max_num_batched_tokens=8192,
                             watermark=0.0 if is_seats else 0.8, enable_prefix_caching=False)
    scheduler = Scheduler(config)
    scheduler.waits = ledger
    for i in range(NUM_RUNNING):
        scheduler.add_request(_request(i, 100))
    _step(scheduler)  # their prompts
    for i in range(NUM_RUNNING, NUM_RUNNING + NUM_WAITING):
        scheduler.add_request(_request(i, 2000))
    return scheduler


def _step(scheduler: Scheduler) -> None:
    output = scheduler.schedule()
    sampled = tuple(7 for row in output.rows for _ in range(row.num_samples))
    scheduler.update(output, RunnerOutput(sampled, (None,) * len(sampled)))
    scheduler.stats()  # the engine reads them after every step


def time_steps(make: Callable[[], Scheduler], num_steps: int) -> float:
    """Mean seconds of one scheduler step over `num_steps` (a fresh scheduler each call)."""
    scheduler = make()
    start = time.perf_counter()
    for _ in range(num_steps):
        _step(scheduler)
    return (time.perf_counter() - start) / num_steps


def measure(scenario: str, num_steps: int, repeats: int) -> dict:
    """Alternating runs with and without the ledger: medians and the difference per step."""
    runs: dict[str, list[float]] = {"with": [], "without": []}
    for _ in range(repeats):
        runs["with"].append(time_steps(lambda: build(scenario, WaitLedger(), num_steps), num_steps))
        runs["without"].append(time_steps(lambda: build(scenario, NoLedger(), num_steps), num_steps))
    scheduler = build(scenario, WaitLedger(), num_steps)
    _step(scheduler)
    with_us, without_us = (1e6 * statistics.median(runs[k]) for k in ("with", "without"))
    return {"scenario": scenario, "num_running": NUM_RUNNING, "num_waiting": len(scheduler.waiting),
            "held_per_step": len(scheduler.waits.last.held), "step_us_with": with_us,
            "step_us_without": without_us, "cost_us": with_us - without_us,
            "runs_us": {k: [1e6 * v for v in vs] for k, vs in runs.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    results = [measure(s, args.steps, args.repeats) for s in ("seats", "watermark")]
    for r in results:
        print(f"{r['scenario']:>9}: {r['num_running']} running, {r['num_waiting']} waiting, "
              f"{r['held_per_step']} examined a step: {r['step_us_without']:.0f} us a step without wait "
              f"reasons, {r['step_us_with']:.0f} us with ({r['cost_us']:+.1f} us)")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
