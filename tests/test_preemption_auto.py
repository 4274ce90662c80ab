"""preemption_mode auto: per victim, swap or recompute by predicted cost; the choice and both predictions kept."""

from __future__ import annotations

import pytest

from cobatch.cost_model import CopyTimeEstimate, predict_recompute_s
from cobatch.engine import Engine
from cobatch.scheduler_output import RunnerOutput, SchedulerOutput
from cobatch.wait_reasons import CHEAPER, CONFIGURED, SWAP_POOL_FULL, UNMEASURED, PreemptionChoice
from tests.fakes import FakeRunner
from tests.test_scheduler import Deltas, expected, make_engine, params, prompt, run, step, tokens_of

COEFFICIENTS = (0.010, 0.001, 0.0002, 0.00001)  # c0 (not counted), per row, per token, per context token


def test_recompute_is_priced_per_chunk_without_the_constant_or_the_cached_prefix() -> None:
    # 20 tokens past a cached 4, in chunks of 8: [4, 12), [12, 20), [20, 24)
    expected_s = sum(0.001 + 0.0002 * (end - start) + 0.00001 * end
                     for start, end in ((4, 12), (12, 20), (20, 24)))
    assert predict_recompute_s(COEFFICIENTS, 24, 4, 8) == pytest.approx(expected_s)
    assert predict_recompute_s(COEFFICIENTS, 4, 4, 8) == 0.0


def test_the_copy_time_is_a_moving_mean_per_block() -> None:
    estimate = CopyTimeEstimate(weight=0.5)
    assert estimate.predict_s(10) is None
    estimate.observe(0, 1.0)  # a step without copies says nothing
    estimate.observe(4, 0.004)
    estimate.observe(2, 0.004)
    assert estimate.seconds_per_block == pytest.approx(0.0015)
    assert estimate.predict_s(10) == pytest.approx(0.015)


def pressured(mode: str, num_swap_blocks: int = 16) -> Engine:
    """Two long requests in an 8-block pool: the newer one is preempted."""
    engine = make_engine(num_kv_blocks=8, max_model_len=32, max_num_seqs=2, watermark=0.0,
                         num_swap_blocks=num_swap_blocks, preemption_mode=mode)
    engine.add_request("old", prompt(0, 8), params(14))
    engine.add_request("new", prompt(1, 8), params(14))
    return engine


def first_preemption(engine: Engine, out: Deltas | None = None) -> PreemptionChoice:
    """Step (deltas into `out`, invariants checked) until a step preempts; its first choice."""
    for _ in range(100):
        step(engine, {} if out is None else out)
        if engine.stats[-1].waits.preemptions:
            return engine.stats[-1].waits.preemptions[0]
    raise AssertionError("no preemption")


def predicting(engine: Engine, recompute_s: float | None, swap_s: float | None) -> Engine:
    calls = []

    def predictor(num_tokens: int, num_cached: int, num_blocks: int) -> tuple[float | None, float | None]:
        calls.append((num_tokens, num_cached, num_blocks))
        return recompute_s, swap_s

    engine.scheduler.preemption_cost_predictor = predictor
    engine.calls = calls  # type: ignore[attr-defined]
    return engine


@pytest.mark.parametrize(("recompute_s", "swap_s", "mode", "why"), [
    (0.050, 0.002, "swap", CHEAPER),
    (0.001, 0.002, "recompute", CHEAPER),
    (0.001, None, "swap", UNMEASURED),  # no copy timed yet: swap, so that one is
    (None, 0.002, "swap", UNMEASURED),  # no fitted step-time model yet
])
def test_auto_takes_the_cheaper_mode_and_records_both_predictions(
        recompute_s: float | None, swap_s: float | None, mode: str, why: str) -> None:
    engine, out = predicting(pressured("auto"), recompute_s, swap_s), {}
    choice = first_preemption(engine, out)
    assert (choice.request_id, choice.mode, choice.why) == ("new", mode, why)
    assert (choice.recompute_s, choice.swap_s) == (recompute_s, swap_s)
    num_tokens, num_cached, num_blocks = engine.calls[0]  # type: ignore[attr-defined]
    assert num_tokens == choice.num_computed_tokens and num_cached == 0
    assert num_blocks * 4 >= num_tokens
    sched = engine.scheduler
    assert (sched.requests["new"] in sched.swapped) == (mode == "swap")
    run(engine, out)
    assert tokens_of(out["new"]) == expected(prompt(1, 8), 14)
    assert out["new"][-1].metrics.preemptions[0] == choice


def test_auto_recomputes_when_the_swap_pool_is_full() -> None:
    engine = predicting(pressured("auto", num_swap_blocks=1), 1.0, 0.001)
    choice = first_preemption(engine)
    assert (choice.mode, choice.why) == ("recompute", SWAP_POOL_FULL)


@pytest.mark.parametrize(("mode", "pool", "taken", "why"), [
    ("recompute", 16, "recompute", CONFIGURED), ("swap", 16, "swap", CONFIGURED),
    ("swap", 1, "recompute", SWAP_POOL_FULL)])
def test_fixed_modes_record_their_choice_without_predictions(mode: str, pool: int, taken: str,
                                                             why: str) -> None:
    choice = first_preemption(pressured(mode, num_swap_blocks=pool))
    assert (choice.mode, choice.why, choice.recompute_s, choice.swap_s) == (taken, why, None, None)


class TimedCopies(FakeRunner):
    """The fake runner, reporting 1 ms per block copied (as ModelRunner reports its measured copies)."""

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        result = super().execute(output)
        num_blocks = len(output.blocks_to_swap_out) + len(output.blocks_to_swap_in)
        return RunnerOutput(result.sampled_token_ids, result.logprobs, num_copied_blocks=num_blocks,
                            copy_s=0.001 * num_blocks)


def test_the_engine_feeds_the_measured_copy_time_to_the_prediction() -> None:
    engine = pressured("auto")
    engine.runner = TimedCopies(8, 4, 16, 32)
    first = first_preemption(engine)  # nothing measured: swap
    assert (first.mode, first.why, first.swap_s) == ("swap", UNMEASURED, None)
    run(engine)
    assert engine.copy_time.seconds_per_block == pytest.approx(0.001)
    recompute_s, swap_s = engine.predict_preemption_s(20, 0, 5)
    assert swap_s == pytest.approx(0.010)  # 5 blocks out and back in
    assert recompute_s == pytest.approx(predict_recompute_s(engine.step_time_model.fitted_coefficients,
                                                            20, 0, engine.config.max_num_batched_tokens))


def test_shared_prefix_blocks_are_priced_neither_as_recomputed_nor_as_copied() -> None:
    engine = make_engine(num_kv_blocks=16, max_model_len=32, max_num_seqs=3, watermark=0.0,
                         num_swap_blocks=16, preemption_mode="auto")
    engine.add_request("a", prompt(0, 12), params(10))
    engine.step()
    engine.add_request("b", prompt(0, 12) + [5, 6], params(2))  # shares a's 3 full prompt blocks
    engine.step()
    predicting(engine, 1.0, 0.1)
    sched = engine.scheduler
    assert sched.block_manager.num_shared_prefix_blocks(sched.requests["b"]) == 3
    assert sched._predict_preemption(sched.requests["b"]) == (1.0, 0.1)
    num_tokens, num_cached, num_blocks = engine.calls[0]  # type: ignore[attr-defined]
    assert num_cached == 12 and num_tokens == sched.requests["b"].num_computed_tokens
    # A swap leaves the shared blocks on the device: only b's own blocks are priced as copies.
    assert num_blocks == len(sched.block_manager.block_tables["b"]) - 3


def test_the_model_runner_times_its_swap_copies() -> None:
    from tests.runner_helpers import runner_for, tiny_hf_model  # torch only here

    runner = runner_for(tiny_hf_model("llama"), num_swap_blocks=4)
    out = runner.execute(SchedulerOutput(rows=(), blocks_to_swap_out=((0, 0), (1, 1)),
                                         blocks_to_swap_in=((2, 2),)))
    assert out.num_copied_blocks == 3 and out.copy_s > 0.0
    assert runner.execute(SchedulerOutput(rows=())).copy_s == 0.0
