"""Deadlines in the core (fake runner, tiny pools, a fake clock): expired requests get no prefill,
running ones end at their deadline with finish_reason "deadline", wherever they are; no block leaks."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from cobatch.block_manager import BlockManager
from cobatch.config import SchedulerConfig
from cobatch.cost_model import NO_COEFFICIENTS, StepTimeModel, predict_prefill_s, predict_with
from cobatch.engine import Engine
from cobatch.request import Request
from cobatch.sampling_params import SamplingParams
from cobatch.scheduler_output import RunnerOutput, SchedulerOutput
from tests.fakes import FakeRunner
from tests.test_scheduler import Deltas, expected, prompt, run, step, tokens_of

STEP_S = 0.010  # every fake step takes this long on the fake clock


@dataclass(slots=True)
class Clock:
    """Stands in for the `time` module of the engine and the scheduler."""

    now: float = 100.0

    def monotonic(self) -> float:
        return self.now


class TimedRunner(FakeRunner):
    """A FakeRunner whose every step advances the clock by STEP_S, and that records the rows it ran."""

    def __init__(self, clock: Clock, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.clock = clock
        self.ran: set[str] = set()  # request ids that got any row

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        self.clock.now += STEP_S
        self.ran.update(row.request_id for row in output.rows)
        return super().execute(output)


@pytest.fixture()
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr("cobatch.engine.time", fake)
    monkeypatch.setattr("cobatch.scheduler.time", fake)
    return fake


def make_engine(clock: Clock, num_kv_blocks: int = 64, block_size: int = 4, num_swap_blocks: int = 0,
                max_model_len: int = 64, **kw: object) -> Engine:
    config = SchedulerConfig(num_kv_blocks=num_kv_blocks, block_size=block_size,
                             num_swap_blocks=num_swap_blocks, max_model_len=max_model_len, **kw)
    runner = TimedRunner(clock, num_kv_blocks, block_size, num_swap_blocks, max_model_len)
    return Engine(runner, config)


def params(max_tokens: int, deadline_ms: float | None = None, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, deadline_ms=deadline_ms, **kw)


def ran(engine: Engine) -> set[str]:
    assert isinstance(engine.runner, TimedRunner)
    return engine.runner.ran


# ---- waiting -------------------------------------------------------------------------------------

def test_a_request_expired_on_arrival_is_finished_without_any_prefill(clock: Clock) -> None:
    engine = make_engine(clock)
    engine.add_request("late", prompt(0, 9), params(4, deadline_ms=50), arrival_time=clock.now - 0.2)
    engine.add_request("fine", prompt(1, 5), params(3))
    out = run(engine)
    assert [d.finish_reason for d in out["late"]] == ["deadline"]
    assert out["late"][0].new_token_ids == () and out["late"][0].metrics.first_token_time is None
    assert "late" not in ran(engine)
    assert tokens_of(out["fine"]) == expected(prompt(1, 5), 3)


def test_a_waiting_request_past_its_deadline_never_gets_a_row(clock: Clock) -> None:
    engine = make_engine(clock, max_num_seqs=1)  # "queued" waits for the seat "busy" holds
    engine.add_request("busy", prompt(0, 5), params(10))
    engine.add_request("queued", prompt(1, 5), params(3, deadline_ms=45))
    out = run(engine)
    assert [d.finish_reason for d in out["queued"]] == ["deadline"]
    assert "queued" not in ran(engine)
    finished_at = out["queued"][0].metrics.finished_time
    assert 100.045 <= finished_at < 100.045 + STEP_S  # at the first step that starts past it
    assert tokens_of(out["busy"]) == expected(prompt(0, 5), 10)


# ---- running ------------------------------------------------------------------------------------

def test_a_running_request_ends_at_its_deadline_keeping_the_tokens_made_in_time(clock: Clock) -> None:
    engine = make_engine(clock)
    engine.add_request("r", prompt(0, 5), params(20, deadline_ms=35))
    out = run(engine)
    deltas = out["r"]
    # Steps end at +10, +20, +30, +40 ms: the token of the step that crosses 35 ms is delivered too.
    assert tokens_of(deltas) == expected(prompt(0, 5), 4)
    assert deltas[-1].finish_reason == "deadline" and deltas[-1].new_token_ids
    assert deltas[-1].metrics.finished_time == pytest.approx(100.040)


def test_a_deadline_mid_prefill_ends_the_request_with_no_token(clock: Clock) -> None:
    engine = make_engine(clock, max_num_batched_tokens=4, max_model_len=32)
    engine.add_request("long", prompt(0, 20), params(3, deadline_ms=25))  # 5 chunks of 4 tokens
    out = run(engine)
    assert [d.finish_reason for d in out["long"]] == ["deadline"]
    assert out["long"][0].new_token_ids == ()
    assert sum(s.num_prefill_tokens for s in engine.stats) == 12  # 3 chunks, then no more prefill


def test_all_n_samples_end_at_the_shared_deadline(clock: Clock) -> None:
    engine = make_engine(clock)
    engine.add_request("p", prompt(0, 6), params(30, deadline_ms=55, n=2))
    out = run(engine)
    assert {out[f"p#{i}"][-1].finish_reason for i in range(2)} == {"deadline"}


@pytest.mark.parametrize("where", ["waiting", "running", "swapped", "mid-prefill", "preempted"])
def test_a_deadline_frees_blocks_wherever_the_request_is(clock: Clock, where: str) -> None:
    mode = "recompute" if where == "preempted" else "swap"
    engine = make_engine(clock, num_kv_blocks=8, num_swap_blocks=16, preemption_mode=mode,
                         max_model_len=32, max_num_batched_tokens=8, enable_prefix_caching=False)
    target = "a" if where == "running" else "b"
    long_prompt = where == "mid-prefill"
    deadlines = {target: 10_000.0, ("b" if target == "a" else "a"): 60_000.0}
    engine.add_request("a", prompt(0, 6), params(20, deadline_ms=deadlines["a"]))
    engine.add_request("b", prompt(1, 20 if long_prompt else 6),
                       params(10 if long_prompt else 14, deadline_ms=deadlines["b"]))
    sched = engine.scheduler
    out: Deltas = {}
    for _ in range(200):
        request = sched.requests.get(target)
        assert request is not None, f"{target} finished before reaching state {where}"
        if _is_in_state(sched, request, where):
            break
        step(engine, out)
    else:
        pytest.fail(f"never reached state {where}")
    clock.now = request.deadline_time  # due now: the next step ends it before scheduling
    step(engine, out)
    assert out[target][-1].finish_reason == "deadline"
    assert target not in sched.block_manager.block_tables
    assert target not in sched.block_manager.swap_tables
    run(engine, out)
    other = "b" if target == "a" else "a"
    assert out[other][-1].finish_reason == "length"


def _is_in_state(sched, request: Request, where: str) -> bool:
    if where == "swapped":
        return request in sched.swapped
    if where in ("waiting", "preempted"):
        return request in sched.waiting and (where == "waiting" or request.metrics.num_preemptions > 0)
    if where == "running":
        return request in sched.running
    return request in sched.running and 0 < request.num_computed_tokens < request.num_prompt_tokens


def test_spec_decode_delivers_the_whole_verified_run_of_the_step_that_crosses_the_deadline(
        clock: Clock) -> None:
    engine = make_engine(clock, num_speculative_tokens=4, max_model_len=64)
    repeating = [5, 6, 7, 8] * 3
    engine.runner.script["s"] = [5, 6, 7, 8] * 10  # the "model" goes on repeating: drafts are accepted
    engine.add_request("s", repeating, params(30, deadline_ms=25))
    out = run(engine)
    tokens = tokens_of(out["s"])
    assert out["s"][-1].finish_reason == "deadline" and len(out["s"][-1].new_token_ids) > 1
    assert engine.scheduler.num_accepted_tokens_total > 0
    assert tokens == engine.runner.script["s"][:len(tokens)]


def test_the_deadline_heap_stays_bounded_when_requests_finish_early(clock: Clock) -> None:
    engine = make_engine(clock)
    for i in range(300):
        engine.add_request(f"r{i}", prompt(i, 3), params(1, deadline_ms=1e9))
        run(engine)
    assert len(engine.scheduler._deadlines) <= 2 * 1 + 64 + 1


def test_deadline_ms_must_be_a_positive_finite_number() -> None:
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="^deadline_ms"):
            SamplingParams(deadline_ms=bad)
    assert SamplingParams(deadline_ms=1.5).for_sample(1).deadline_ms == 1.5


# ---- what a replica router reads ----------------------------------------------------------------

def test_stats_count_running_prefill_and_swapped_tokens(clock: Clock) -> None:
    engine = make_engine(clock, max_num_batched_tokens=4, max_model_len=32)
    engine.add_request("long", prompt(0, 20), params(2))
    engine.step()
    stats = engine.scheduler.stats()
    assert stats.num_running == 1 and stats.num_running_prefill_tokens == 16
    run(engine)
    assert engine.scheduler.stats().num_running_prefill_tokens == 0

    engine = make_engine(clock, num_kv_blocks=8, num_swap_blocks=16, preemption_mode="swap",
                         max_model_len=32, enable_prefix_caching=False)
    engine.add_request("a", prompt(0, 6), params(20))
    engine.add_request("b", prompt(1, 6), params(14))
    while not engine.scheduler.swapped:
        engine.step()
    swapped = engine.scheduler.swapped
    assert engine.scheduler.stats().num_swapped_tokens == sum(r.num_tokens for r in swapped) > 0
    run(engine)


def test_block_manager_counts_evicted_cached_blocks_and_keeps_the_latest_hashes() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, watermark=0.0)
    first = Request("first", [3, 4, 5, 6, 7], SamplingParams(), (1,), 4)
    assert bm.allocate_slots(first, 5)
    first.num_computed_tokens = 5
    bm.cache_full_blocks(first)  # two full blocks cached
    cached = first.block_hashes[:2]
    bm.free(first)
    assert bm.num_evictions_total == 0 and bm.recent_evicted_hashes == ()
    other = Request("other", [9] * 8, SamplingParams(), (1,), 4)
    assert bm.allocate_slots(other, 8)  # takes every block: both cached ones are evicted
    assert bm.num_evictions_total == 2
    assert set(bm.recent_evicted_hashes) == set(cached)
    assert bm.recent_evicted_hashes is bm.recent_evicted_hashes  # copied once per change, not per read
    bm.check_invariants()


def test_stats_report_evictions_and_the_mean_output_length(clock: Clock) -> None:
    engine = make_engine(clock, num_kv_blocks=6, block_size=2, max_model_len=12, watermark=0.0)
    for i in range(4):
        engine.add_request(f"r{i}", prompt(i, 7), params(4))
        run(engine)
    stats = engine.scheduler.stats()
    assert stats.num_evictions_total > 0
    assert 0 < len(stats.recent_evicted_hashes) <= stats.num_evictions_total
    assert stats.mean_output_tokens == pytest.approx(4.0)


# ---- the step-time model a router and the front door read ---------------------------------------

def test_fitted_coefficients_are_zero_until_ready_then_match_predict() -> None:
    model = StepTimeModel(decay=1.0)
    assert model.fitted_coefficients == NO_COEFFICIENTS
    for rows in range(1, 12):
        model.observe(rows, rows * 3, rows * 40, 0.005 + 0.001 * rows + 0.0001 * rows * 3)
    c = model.fitted_coefficients
    assert len(c) == 4 and c[0] == pytest.approx(0.005, rel=0.05)
    assert predict_with(c, 7, 21, 280) == pytest.approx(model.predict(7, 21, 280))


def test_predict_prefill_cuts_the_prompt_into_budget_chunks_beside_the_decode_rows() -> None:
    c = (0.010, 0.0, 0.001, 0.0)  # 10 ms a step + 1 ms a batched token
    assert predict_prefill_s(c, 0, 4, 100, 64) == 0.0
    # 4 decode rows leave 60 tokens a step: 130 tokens = 2 full chunks + 10.
    full, rest = 0.010 + 0.001 * 64, 0.010 + 0.001 * 14
    assert predict_prefill_s(c, 130, 4, 100, 64) == pytest.approx(2 * full + rest)
    assert predict_prefill_s(NO_COEFFICIENTS, 130, 4, 100, 64) == 0.0
