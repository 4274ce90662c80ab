""""Why is it waiting?": each wait reason forced with tiny pools and limits, and the accounting checked.

Every step here is scheduled by hand so that, between schedule() and update(), the step's StepWaits can
be compared with the truth: every live sequence without a row is counted once, under one reason.
"""

from __future__ import annotations

import logging

import pytest

from cobatch.engine import Engine
from cobatch.wait_reasons import (KV_BLOCKS, MAX_NUM_SEQS, PREEMPTED, PREEMPTING, SIBLING_PROMPT,
                                  STATIC_BATCH, SWAPPED, TOKEN_BUDGET, TPOT_SLO, WAIT_REASONS, WATERMARK,
                                  SequenceWaitStatus, StepWaits)
from tests.test_scheduler import make_engine, params, prompt, run


def tiny(**kw: object) -> Engine:
    """An engine over the fake runner: blocks of 4 tokens, 8 of them unless said otherwise."""
    return make_engine(**{"num_kv_blocks": 8, "max_model_len": 32, **kw})  # type: ignore[arg-type]


def step(engine: Engine) -> StepWaits:
    """One engine step, checking its StepWaits against the queues between schedule and update."""
    sched = engine.scheduler
    output = sched.schedule()
    waits = sched.waits.last
    rows = {r.request_id for r in output.rows if not r.is_padding}
    live = {r.request_id for r in sched.requests.values() if not r.is_finished}
    held = [seq_id for seq_id, _ in waits.held]
    assert len(held) == len(set(held)) and not set(held) & rows, "held once, and never with a row"
    assert set(held) <= live
    assert waits.num_held == len(live - rows), "every live sequence without a row, counted once"
    assert all(reason in WAIT_REASONS for reason, _ in waits.counts)
    sched.update(output, engine.runner.execute(output))
    sched.check_invariants()
    return waits


def status(engine: Engine, seq_id: str) -> SequenceWaitStatus:
    found = engine.scheduler.wait_status(seq_id)
    assert found is not None
    return found


def test_no_free_kv_blocks_and_the_queue_behind_it() -> None:
    engine = tiny(watermark=0.0)
    engine.add_request("big", prompt(0, 28), params(2))  # 7 of the 8 blocks
    engine.add_request("next", prompt(1, 8), params(2))  # 2 blocks: 1 is free
    engine.add_request("last", prompt(2, 4), params(2))  # would fit, but FCFS keeps it behind
    waits = step(engine)
    assert ("next", KV_BLOCKS) in waits.held and waits.waiting_reason == KV_BLOCKS
    head, behind = status(engine, "next"), status(engine, "last")
    assert (head.state, head.reason, head.is_behind, head.queue_position) == ("waiting", KV_BLOCKS, False, 0)
    assert (behind.reason, behind.is_behind, behind.queue_position, behind.queue_length) == \
        (KV_BLOCKS, True, 1, 2)
    assert dict(waits.counts) == {KV_BLOCKS: 2}
    assert status(engine, "big").reason is None and status(engine, "big").state == "running"


def test_the_watermark_holds_back_what_the_free_blocks_would_fit() -> None:
    engine = tiny(watermark=0.25)  # 2 blocks kept free
    engine.add_request("a", prompt(0, 16), params(2))  # 4 blocks (nothing runs: no watermark)
    engine.add_request("b", prompt(1, 12), params(2))  # 3 blocks: 4 are free, 2 above the watermark
    waits = step(engine)
    assert waits.held == (("b", WATERMARK),)


def test_max_num_seqs_holds_the_whole_queue() -> None:
    engine = tiny(max_num_seqs=1)
    engine.add_request("a", prompt(0, 4), params(3))
    engine.add_request("b", prompt(1, 4), params(3))
    waits = step(engine)
    assert waits.held == () and waits.waiting_reason == MAX_NUM_SEQS
    assert (status(engine, "b").reason, status(engine, "b").is_behind) == (MAX_NUM_SEQS, True)


def test_the_token_budget_holds_waiting_and_running_sequences() -> None:
    engine = tiny(num_kv_blocks=16, max_num_batched_tokens=8,
                         scheduling_policy="priority")
    engine.add_request("low", prompt(0, 4), params(8), priority=1)
    step(engine)
    engine.add_request("urgent", prompt(1, 20), params(2), priority=0)
    engine.add_request("later", prompt(2, 4), params(2), priority=2)
    step(engine)  # low decodes, urgent gets the other 7 tokens, later waits for budget
    waits = step(engine)  # urgent (ahead of low now) takes all 8: running low has no row
    assert waits.held == (("low", TOKEN_BUDGET),) and waits.waiting_reason == TOKEN_BUDGET
    assert status(engine, "low").state == "running" and status(engine, "low").reason == TOKEN_BUDGET
    assert status(engine, "later").reason == TOKEN_BUDGET


def test_the_tpot_slo_holds_an_admission() -> None:
    engine = tiny(tpot_slo_ms=10.0)
    engine.scheduler.step_time_predictor = lambda rows, tokens, context: 0.001 * rows * rows
    engine.add_request("a", prompt(0, 4), params(4))
    engine.add_request("b", prompt(1, 4), params(4))
    engine.add_request("c", prompt(2, 4), params(4))
    engine.add_request("d", prompt(3, 4), params(4))
    waits = step(engine)  # a (an empty engine always runs), b and c fit: 3 rows predict 9 ms
    assert waits.held == (("d", TPOT_SLO),)


def test_a_static_batch_admits_nobody_until_it_is_done() -> None:
    engine = tiny(batching="static")
    engine.add_request("a", prompt(0, 4), params(3))
    step(engine)
    engine.add_request("b", prompt(1, 4), params(1))
    waits = step(engine)
    assert waits.waiting_reason == STATIC_BATCH and status(engine, "b").reason == STATIC_BATCH


def test_a_sibling_waits_for_the_first_samples_prompt() -> None:
    engine = tiny(max_num_batched_tokens=16)
    engine.add_request("n", prompt(0, 12), params(2, n=2))
    waits = step(engine)
    assert waits.held == (("n#1", SIBLING_PROMPT),)
    assert status(engine, "n#1").reason == SIBLING_PROMPT and not status(engine, "n#1").is_behind


def _pressure(engine: Engine) -> None:
    """Two requests that grow past the 8-block pool: the newer one is preempted at some step."""
    engine.add_request("old", prompt(0, 8), params(14))
    engine.add_request("new", prompt(1, 8), params(14))
    engine.add_request("queued", prompt(2, 4), params(2))


def test_a_preemption_step_names_the_victim_and_admits_nobody() -> None:
    engine = tiny(max_num_seqs=2, watermark=0.0)
    _pressure(engine)
    for _ in range(40):
        waits = step(engine)
        if waits.preemptions:
            break
    assert ("new", PREEMPTED) in waits.held and waits.waiting_reason == PREEMPTING
    (choice,) = waits.preemptions
    assert (choice.request_id, choice.mode) == ("new", "recompute")
    assert status(engine, "new").preemptions == (choice,)


def test_swapped_sequences_go_back_in_before_any_admission() -> None:
    engine = tiny(max_num_seqs=2, watermark=0.0,
                         num_swap_blocks=8, preemption_mode="swap")
    _pressure(engine)
    while not engine.scheduler.swapped:
        step(engine)
    waits = step(engine)  # "new" is out; the pool is still full of "old"
    assert waits.held == (("new", KV_BLOCKS),) and waits.waiting_reason == SWAPPED
    assert (status(engine, "new").state, status(engine, "queued").reason) == ("swapped", SWAPPED)


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_each_sequences_counts_are_its_steps_without_a_row(mode: str, batching: str) -> None:
    """Under pressure, sequences' finished wait counts add up to the steps they were live and rowless."""
    engine = tiny(max_num_seqs=3, num_swap_blocks=6,
                         preemption_mode=mode, batching=batching, max_num_batched_tokens=8)
    arrived: dict[str, int] = {}
    for i, (plen, n) in enumerate([(8, 14), (6, 12), (10, 9), (3, 20), (5, 6)]):
        arrived[f"r{i}"] = 0
        engine.add_request(f"r{i}", prompt(i, plen), params(n))
    finished: dict[str, tuple[int, dict[str, int]]] = {}
    rows_of: dict[str, int] = {}
    while engine.has_unfinished_requests():
        this_step = len(engine.stats)
        for delta in engine.step():
            if delta.finished and delta.metrics is not None:
                finished[delta.request_id] = (this_step, delta.metrics.wait_steps)
        for seq_id in set(engine.stats[-1].row_request_ids):  # padding rows after its finish: no
            if finished.get(seq_id, (this_step,))[0] == this_step:
                rows_of[seq_id] = rows_of.get(seq_id, 0) + 1
        engine.scheduler.check_invariants()
    assert engine.scheduler.num_preemptions_total > 0, "the pool was meant to force preemption"
    for seq_id, (last_step, wait_steps) in finished.items():
        live_steps = last_step - arrived[seq_id] + 1
        assert sum(wait_steps.values()) == live_steps - rows_of[seq_id], seq_id


def test_a_reason_change_is_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    engine = tiny(max_num_seqs=1)
    engine.add_request("a", prompt(0, 4), params(3))
    engine.add_request("b", prompt(1, 4), params(3))
    with caplog.at_level(logging.DEBUG, logger="cobatch.wait_ledger"):
        step(engine)
        step(engine)
    lines = [r.getMessage() for r in caplog.records if "wait behind" in r.getMessage()]
    assert len(lines) == 1 and MAX_NUM_SEQS in lines[0], "logged on change, not every step"


def test_the_engine_publishes_waits_and_the_finished_counts() -> None:
    engine = tiny(max_num_seqs=1)
    engine.add_request("a", prompt(0, 4), params(3))
    engine.add_request("b", prompt(1, 4), params(3))
    out = run(engine)
    assert engine.stats[0].waits.waiting_reason == MAX_NUM_SEQS
    assert out["b"][-1].metrics.wait_steps == {MAX_NUM_SEQS: 3}
    assert engine.request_status("a") is None  # finished: the engine forgets it
