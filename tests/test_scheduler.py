"""Scheduler + block manager + engine loop with the fake runner: tiny numbers, invariants every step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cobatch.config import SchedulerConfig
from cobatch.engine import Engine
from cobatch.outputs import RequestDelta
from cobatch.sampling_params import SamplingParams
from cobatch.slo import SLO_HEADROOM
from cobatch.testing.faults import FaultInjectingRunner
from tests.fakes import FakeRunner, next_token


def make_engine(num_kv_blocks: int = 64, block_size: int = 4, num_swap_blocks: int = 0,
                max_model_len: int = 64, **kw) -> Engine:
    config = SchedulerConfig(num_kv_blocks=num_kv_blocks, block_size=block_size,
                             num_swap_blocks=num_swap_blocks, max_model_len=max_model_len, **kw)
    runner = FakeRunner(num_kv_blocks, block_size, num_swap_blocks, max_model_len)
    return Engine(runner, config)


Deltas = dict[str, list[RequestDelta]]


def step(engine: Engine, out: Deltas) -> None:
    """One step; its deltas are added to `out` by sequence id; invariants checked."""
    for delta in engine.step():
        out.setdefault(delta.request_id, []).append(delta)
    engine.scheduler.check_invariants()


def run(engine: Engine, out: Deltas | None = None, max_steps: int = 10_000) -> Deltas:
    """Step until idle, checking invariants after every step; deltas grouped by sequence id."""
    out = {} if out is None else out
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        step(engine, out)
    assert not engine.has_unfinished_requests(), "engine did not drain"
    assert engine.scheduler.block_manager.num_used_blocks == 0, "blocks leaked"
    return out


def tokens_of(deltas: list[RequestDelta]) -> list[int]:
    assert sum(d.finished for d in deltas) == 1 and deltas[-1].finished, "finished exactly once, last"
    return [t for d in deltas for t in d.new_token_ids]


def expected(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def prompt(i: int, length: int) -> list[int]:
    return [(i * 7 + j) % 90 + 3 for j in range(length)]


def params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_requests_generate_the_reference_tokens() -> None:
    engine = make_engine()
    for i, (plen, n) in enumerate([(5, 7), (9, 3), (1, 12)]):
        engine.add_request(f"r{i}", prompt(i, plen), params(n))
    out = run(engine)
    for i, (plen, n) in enumerate([(5, 7), (9, 3), (1, 12)]):
        assert tokens_of(out[f"r{i}"]) == expected(prompt(i, plen), n)
        assert out[f"r{i}"][-1].finish_reason == "length"


def test_chunked_prefill_splits_a_long_prompt_within_the_budget() -> None:
    engine = make_engine(max_num_batched_tokens=8, max_model_len=32)
    engine.add_request("long", prompt(0, 20), params(3))
    out = run(engine)
    rows = [s.num_prefill_tokens for s in engine.stats]
    assert rows[:3] == [8, 8, 4]
    assert tokens_of(out["long"]) == expected(prompt(0, 20), 3)


def test_prefill_chunks_and_decode_rows_share_a_step() -> None:
    engine = make_engine(max_num_batched_tokens=8, max_model_len=32)
    engine.add_request("a", prompt(0, 3), params(10))
    engine.step()  # a: prefill
    engine.add_request("b", prompt(1, 20), params(2))
    engine.step()
    last = engine.stats[-1]
    assert last.num_decode_tokens == 1 and last.num_prefill_tokens == 7
    out = run(engine)
    assert tokens_of(out["b"]) == expected(prompt(1, 20), 2)


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    engine = make_engine(max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False)
    engine.add_request("a", prompt(0, 10), params(2))
    engine.add_request("b", prompt(1, 30), params(2))
    engine.step()
    assert engine.stats[-1].num_prefill_tokens == 10  # b's 30 tokens do not fit beside a's 10
    run(engine)


def test_max_num_seqs_bounds_the_running_set() -> None:
    engine = make_engine(max_num_seqs=2)
    for i in range(5):
        engine.add_request(f"r{i}", prompt(i, 3), params(4))
    while engine.has_unfinished_requests():
        engine.step()
        assert len(engine.scheduler.running) <= 2


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_memory_pressure_keeps_outputs_identical(mode: str) -> None:
    specs = [(6, 20), (5, 18), (7, 16), (4, 22)]

    def outputs(num_blocks: int) -> tuple[dict, Engine]:
        engine = make_engine(num_kv_blocks=num_blocks, num_swap_blocks=32,
                             preemption_mode=mode, max_model_len=32, enable_prefix_caching=False)
        for i, (plen, n) in enumerate(specs):
            engine.add_request(f"r{i}", prompt(i, plen), params(n))
        return run(engine), engine

    roomy, _ = outputs(64)
    tight, engine = outputs(12)
    assert engine.scheduler.num_preemptions_total > 0
    for i, (plen, n) in enumerate(specs):
        assert tokens_of(tight[f"r{i}"]) == tokens_of(roomy[f"r{i}"]) == expected(prompt(i, plen), n)
    metrics = [d.metrics for ds in tight.values() for d in ds if d.finished]
    if mode == "swap":
        assert sum(m.num_swaps for m in metrics) > 0
    else:
        assert sum(m.num_recomputed_tokens for m in metrics) > 0


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full() -> None:
    engine = make_engine(num_kv_blocks=12, num_swap_blocks=1, preemption_mode="swap",
                         max_model_len=32, enable_prefix_caching=False)
    for i in range(4):
        engine.add_request(f"r{i}", prompt(i, 6), params(20))
    out = run(engine)
    assert engine.scheduler.num_preemptions_total > 0
    assert all(tokens_of(out[f"r{i}"]) == expected(prompt(i, 6), 20) for i in range(4))


def test_victim_is_the_latest_arrival_and_no_admission_in_a_preempting_step() -> None:
    engine = make_engine(num_kv_blocks=8, max_model_len=32, enable_prefix_caching=False,
                         watermark=0.0)
    engine.add_request("old", prompt(0, 8), params(20), arrival_time=1.0)
    engine.add_request("new", prompt(1, 8), params(20), arrival_time=2.0)
    engine.add_request("later", prompt(2, 2), params(2), arrival_time=3.0)
    preempted_steps = []
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.check_invariants()
        if engine.stats[-1].num_preempted:
            preempted_steps.append(engine.stats[-1])
            assert engine.scheduler.waiting[0].request_id == "new"
    assert preempted_steps and all(s.num_prefill_tokens == 0 for s in preempted_steps)


def test_priority_policy_admits_lower_priority_value_first() -> None:
    engine = make_engine(max_num_seqs=1, scheduling_policy="priority")
    engine.add_request("low", prompt(0, 3), params(2), priority=5, arrival_time=1.0)
    engine.add_request("high", prompt(1, 3), params(2), priority=-1, arrival_time=2.0)
    engine.step()
    assert engine.stats[-1].row_request_ids == ("high",)
    run(engine)


def test_static_batching_admits_only_when_the_batch_has_left_and_pads_finished_rows() -> None:
    engine = make_engine(batching="static", max_num_seqs=3)
    engine.add_request("short", prompt(0, 3), params(2))
    engine.add_request("long", prompt(1, 3), params(8))
    out: Deltas = {}
    step(engine, out)
    engine.add_request("next", prompt(2, 3), params(2))
    run(engine, out)
    first_next = next(s.step for s in engine.stats if "next" in s.row_request_ids)
    last_long = max(s.step for s in engine.stats if "long" in s.row_request_ids)
    assert first_next > last_long, "static batching admitted into a running batch"
    padded = [s for s in engine.stats if s.num_padding_rows]
    assert len(padded) == 6  # short finished after 2 tokens, rides along for long's remaining 6
    assert tokens_of(out["short"]) == expected(prompt(0, 3), 2)
    assert tokens_of(out["long"]) == expected(prompt(1, 3), 8)


def test_continuous_batching_admits_into_a_running_batch() -> None:
    engine = make_engine(max_num_seqs=3)
    engine.add_request("long", prompt(1, 3), params(8))
    engine.step()
    engine.add_request("next", prompt(2, 3), params(2))
    engine.step()
    assert set(engine.stats[-1].row_request_ids) == {"long", "next"}
    run(engine)


@pytest.mark.parametrize("where", ["waiting", "running", "swapped", "mid-prefill"])
def test_abort_frees_blocks_at_once(where: str) -> None:
    engine = make_engine(num_kv_blocks=8, num_swap_blocks=16, preemption_mode="swap",
                         max_model_len=32, max_num_batched_tokens=8, enable_prefix_caching=False)
    engine.add_request("a", prompt(0, 6), params(20))
    long_prompt = where == "mid-prefill"
    engine.add_request("b", prompt(1, 20 if long_prompt else 6), params(10 if long_prompt else 14))
    sched = engine.scheduler
    target = {"waiting": "b", "running": "a", "mid-prefill": "b", "swapped": None}[where]
    for _ in range(200):
        if where == "swapped" and sched.swapped:
            target = sched.swapped[0].request_id
            break
        if where == "waiting" and any(r.request_id == "b" for r in sched.waiting):
            break
        if where == "running" and "a" in sched.block_manager.block_tables:
            break
        if where == "mid-prefill" and 0 < sched.requests["b"].num_computed_tokens < 20:
            break
        engine.step()
    assert target is not None, f"never reached state {where}"
    deltas = engine.abort_request(target)
    assert [d.finish_reason for d in deltas] == ["abort"]
    assert target not in sched.block_manager.block_tables
    assert target not in sched.block_manager.swap_tables
    sched.check_invariants()
    run(engine)


def test_prefix_cache_shares_full_prompt_blocks_and_keeps_outputs() -> None:
    engine = make_engine(block_size=4)
    shared = prompt(0, 13)
    engine.add_request("first", shared, params(3))
    run(engine)
    engine.add_request("second", shared, params(3))
    out: Deltas = {}
    step(engine, out)
    assert engine.stats[-1].num_prefill_tokens == 1  # 12 of 13 tokens served from 3 cached blocks
    run(engine, out)
    assert tokens_of(out["second"]) == expected(shared, 3)
    assert engine.scheduler.block_manager.prefix_cache_hit_rate > 0


def test_a_prompt_found_whole_in_the_cache_computes_only_its_last_token() -> None:
    engine = make_engine(block_size=4)
    shared = prompt(0, 12)  # three full blocks
    engine.add_request("first", shared, params(3))
    run(engine)
    bm = engine.scheduler.block_manager
    out: Deltas = {}
    engine.add_request("second", shared, params(3))
    step(engine, out)
    assert engine.stats[-1].num_prefill_tokens == 1  # 11 tokens from the cache, the last one computed
    engine.add_request("third", shared, params(3))
    step(engine, out)
    assert engine.stats[-1].num_prefill_tokens == 1
    second, third = bm.block_tables["second"], bm.block_tables["third"]
    assert second[:2] == third[:2] and second[2] != third[2]  # the first two shared, the last each its own
    (src1, dst1), (src2, dst2) = engine.runner.copies
    assert src1 == src2 and (dst1, dst2) == (second[2], third[2]) and src1 not in (dst1, dst2)
    run(engine, out)  # the fake runner checked every position's KV, the copies' included
    assert tokens_of(out["second"]) == tokens_of(out["third"]) == expected(shared, 3)


def test_a_prompt_that_ends_inside_a_block_copies_that_block_too() -> None:
    engine = make_engine(block_size=4)
    shared = prompt(0, 14)  # three full blocks and a tail of two
    engine.add_request("first", shared, params(6))  # its tail block then holds 4 of its own tokens after it
    run(engine)
    bm = engine.scheduler.block_manager
    assert len(bm.cached_tails) == 1
    out: Deltas = {}
    engine.add_request("other tail", shared[:13] + [99], params(2))  # same full blocks, another tail
    step(engine, out)
    assert engine.stats[-1].num_prefill_tokens == 2 and engine.runner.copies == []
    engine.add_request("second", shared, params(3))
    step(engine, out)
    assert engine.stats[-1].num_prefill_tokens == 1  # 13 tokens from the cache, the last one computed
    (src, dst), = engine.runner.copies
    assert src in bm.tail_hashes_of and dst == bm.block_tables["second"][3] != src
    run(engine, out)  # the fake runner checked every position's KV, the copied tail's included
    assert tokens_of(out["second"]) == expected(shared, 3)
    assert tokens_of(out["other tail"]) == expected(shared[:13] + [99], 2)


def test_a_prompt_tail_leaves_the_cache_with_its_block() -> None:
    engine = make_engine(num_kv_blocks=8, block_size=4, max_model_len=32)
    engine.add_request("first", prompt(0, 6), params(1))
    run(engine)
    bm = engine.scheduler.block_manager
    (first_tail,) = bm.cached_tails
    engine.add_request("big", prompt(5, 29), params(1))  # takes every block: the tail's is reused
    run(engine)
    assert first_tail not in bm.cached_tails and len(bm.cached_tails) == 1  # big's own tail only
    out: Deltas = {}
    engine.add_request("again", prompt(0, 6), params(2))
    step(engine, out)
    assert engine.stats[-1].num_prefill_tokens == 6 and engine.runner.copies == []
    run(engine, out)
    assert tokens_of(out["again"]) == expected(prompt(0, 6), 2)


def test_the_cached_last_block_may_be_its_own_copy() -> None:
    """With the pool full but for the cached blocks, the one fresh block is the source itself (the free
    list's oldest): a copy onto itself, the KV kept."""
    engine = make_engine(num_kv_blocks=4, block_size=4, max_model_len=16)
    shared = prompt(1, 12)
    engine.add_request("first", shared, params(1))
    run(engine)  # blocks 0, 1, 2 freed last to first: the free list is 3, 2, 1, 0
    out: Deltas = {}
    engine.add_request("filler", prompt(2, 2), params(2))
    step(engine, out)  # takes block 3
    engine.add_request("second", shared, params(1))
    step(engine, out)  # 0, 1 shared again; its fresh block is 2, the cached last block
    assert engine.stats[-1].num_prefill_tokens == 1  # its last token (filler's is a decode row)
    assert engine.runner.copies == [(2, 2)]
    run(engine, out)
    assert tokens_of(out["second"]) == expected(shared, 1)


def test_n_samples_share_the_prompt_blocks() -> None:
    engine = make_engine(block_size=4)
    engine.add_request("multi", prompt(0, 13), params(4, n=3))
    out: Deltas = {}
    step(engine, out)
    assert engine.stats[-1].num_prefill_tokens == 13  # only the first sample prefills
    step(engine, out)
    tables = engine.scheduler.block_manager.block_tables
    assert tables["multi#1"][:3] == tables["multi#0"][:3]  # the full prompt blocks are shared
    run(engine, out)
    assert all(tokens_of(out[k]) == expected(prompt(0, 13), 4) for k in out)  # fake model: greedy
    assert sorted(out) == ["multi#0", "multi#1", "multi#2"]
    assert {d.parent_id for ds in out.values() for d in ds} == {"multi"}


def test_slo_cap_keeps_the_predicted_step_under_the_slo() -> None:
    config = SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=32, tpot_slo_ms=35.0)
    engine = Engine(FakeRunner(64, 4), config)
    engine.scheduler.step_time_predictor = lambda rows, tokens, ctx: 0.010 + 0.005 * rows
    for i in range(10):
        engine.add_request(f"r{i}", prompt(i, 2), params(5))
    while engine.has_unfinished_requests():
        engine.step()
        assert 0.010 + 0.005 * engine.stats[-1].num_rows <= 0.035 * SLO_HEADROOM + 1e-9
    assert max(s.num_rows for s in engine.stats) == 4  # 10 + 5 * 4 <= 35 * 0.9 < 10 + 5 * 5


def test_validation_refuses_what_can_never_fit() -> None:
    engine = make_engine(max_model_len=16)
    with pytest.raises(ValueError, match="maximum context length"):
        engine.add_request("x", prompt(0, 10), params(10))
    with pytest.raises(ValueError, match="no room"):
        engine.add_request("y", prompt(0, 16), params(1))
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request("z", [], params(1))
    engine.add_request("ok", prompt(0, 10), replace(params(1), max_tokens=None))
    out = run(engine)
    assert len(tokens_of(out["ok"])) == 6


def test_config_refuses_a_pool_smaller_than_one_sequence() -> None:
    with pytest.raises(ValueError, match="fewer than one sequence"):
        SchedulerConfig(num_kv_blocks=3, block_size=4, max_model_len=16)


def test_a_failed_step_fails_only_its_requests() -> None:
    runner = FaultInjectingRunner(FakeRunner(num_kv_blocks=64, block_size=4))
    engine = Engine(runner, SchedulerConfig(num_kv_blocks=64, block_size=4, max_model_len=64))
    engine.add_request("a", prompt(0, 3), params(5))
    out: Deltas = {}
    step(engine, out)
    runner.inject("step_error")  # the next step raises in the runner
    deltas = engine.step()
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("a", "error")]
    engine.add_request("b", prompt(1, 3), params(2))
    run(engine, out)
    assert tokens_of(out["b"]) == expected(prompt(1, 3), 2)


def test_decode_steps_are_predicted_by_the_decode_only_model() -> None:
    engine = make_engine()
    for rows in range(1, 12):  # decode: 10 ms + 2 ms per row; prefill: 1 ms + 0.1 ms per token
        engine.decode_time_model.observe(rows, rows, 100 * rows, 0.010 + 0.002 * rows)
        engine.step_time_model.observe(rows, rows, 100 * rows, 0.010 + 0.002 * rows)
        engine.step_time_model.observe(1, 100 * rows, 100 * rows, 0.001 + 0.0001 * 100 * rows)
    assert engine.predict_step_s(8, 8, 800) == pytest.approx(0.026, rel=0.02)
    assert engine.predict_step_s(1, 500, 500) == engine.step_time_model.predict(1, 500, 500)
