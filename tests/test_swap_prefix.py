"""Swap with a shared prefix: shared blocks stay on the device, swap-in takes cached blocks back by hash."""

from __future__ import annotations

import pytest

from cobatch.block_manager import BlockManager
from cobatch.engine import Engine
from cobatch.request import Request
from cobatch.sampling_params import SamplingParams
from tests.test_scheduler import Deltas, expected, make_engine, params, prompt, step, tokens_of

PREFIX = prompt(0, 12)  # 3 full blocks of 4, common to every request


def shared_prompt(i: int) -> list[int]:
    return PREFIX + prompt(i + 1, 2)


def shared_workload(mode: str, out: Deltas, num_requests: int = 4, num_kv_blocks: int = 14) -> Engine:
    """Requests sharing a 3-block prefix whose outputs outgrow the pool: the newest are preempted."""
    engine = make_engine(num_kv_blocks=num_kv_blocks, num_swap_blocks=32, max_model_len=32,
                         max_num_seqs=num_requests, watermark=0.0, preemption_mode=mode)
    for i in range(num_requests):
        engine.add_request(f"r{i}", shared_prompt(i), params(14), arrival_time=float(i))
        if i == 0:  # its prefill registers the prefix: the others find it cached
            step(engine, out)
    return engine


def assert_prefix_held_once(engine: Engine, num_prefix_tokens: int = len(PREFIX)) -> None:
    """Every running sequence past the prefix reads it from the same device blocks."""
    bm = engine.scheduler.block_manager
    for i in range(num_prefix_tokens // bm.block_size):
        blocks = {bm.block_tables[r.request_id][i] for r in engine.scheduler.running
                  if r.num_computed_tokens >= num_prefix_tokens}
        assert len(blocks) <= 1, f"prefix block {i} held in copies {blocks}"


def run_checked(engine: Engine, out: Deltas) -> int:
    """Run to the end with every check after each step; the most prefix blocks left resident by a swap."""
    max_resident = 0
    while engine.has_unfinished_requests():
        step(engine, out)
        assert_prefix_held_once(engine)
        max_resident = max([max_resident, *engine.scheduler.block_manager.swap_resident.values()])
    assert engine.scheduler.block_manager.num_used_blocks == 0, "blocks leaked"
    assert not engine.scheduler.block_manager.swap_tables, "host blocks leaked"
    return max_resident


def test_swap_leaves_the_shared_prefix_resident_and_shares_it_again() -> None:
    out: Deltas = {}
    engine = shared_workload("swap", out)
    max_resident = run_checked(engine, out)
    assert max_resident == 3, "a victim's shared prefix was copied out"
    for i in range(4):
        assert tokens_of(out[f"r{i}"]) == expected(shared_prompt(i), 14)
    assert sum(d.metrics.num_swaps for ds in out.values() for d in ds if d.finished) > 0


def test_a_swapped_back_sequence_keeps_its_seat_beside_the_others() -> None:
    """Swapped back with its prefix shared, it runs beside as many as after a recompute."""
    num_steps = {}
    for mode in ("recompute", "swap"):
        engine = shared_workload(mode, {}, num_requests=6, num_kv_blocks=18)
        run_checked(engine, {})
        assert engine.scheduler.num_preemptions_total > 0
        num_steps[mode] = len(engine.stats)
    assert num_steps["swap"] <= num_steps["recompute"]


def test_a_resident_prefix_evicted_while_out_is_recomputed() -> None:
    out: Deltas = {}
    engine = shared_workload("swap", out, num_requests=2, num_kv_blocks=9)
    sched, bm = engine.scheduler, engine.scheduler.block_manager
    while not sched.swapped:
        step(engine, out)
    victim = sched.swapped[0]
    assert bm.swap_resident[victim.request_id] == 3
    holder = next(r for r in sched.running)
    out.setdefault(holder.request_id, []).append(engine.abort_request(holder.request_id)[0])
    evict_all_cached(bm)
    assert not bm.is_swap_prefix_resident(victim)
    step(engine, out)
    assert victim in sched.running and victim.metrics.num_recomputed_tokens > 0
    while engine.has_unfinished_requests():
        step(engine, out)
    assert tokens_of(out[victim.request_id]) == expected(shared_prompt(int(victim.request_id[1:])), 14)
    assert bm.num_used_blocks == 0 and not bm.swap_tables and not bm.swap_resident


def evict_all_cached(bm: BlockManager) -> None:
    """Take every free block (evicting what it caches) and give them back."""
    filler = Request("filler", [0], SamplingParams(), (), 1)
    assert bm.allocate_slots(filler, bm.num_free_blocks * bm.block_size)
    bm.free(filler)
    assert not bm.cached_blocks


def computed_request(bm: BlockManager, token_ids: list[int], request_id: str = "a") -> Request:
    """A request whose KV for all of `token_ids` is computed and registered, as after its steps."""
    request = Request(request_id, token_ids, SamplingParams(), (), 8)
    assert bm.allocate_slots(request, len(token_ids))
    request.num_computed_tokens = len(token_ids)
    bm.cache_full_blocks(request)
    return request


@pytest.mark.parametrize("evicted", [False, True])
def test_swap_in_copies_only_what_the_device_no_longer_caches(evicted: bool) -> None:
    bm = BlockManager(num_blocks=8, block_size=4, num_swap_blocks=8)
    request = computed_request(bm, prompt(0, 10))  # 2 full blocks and a partial one
    table = list(bm.block_tables["a"])
    assert len(bm.swap_out(request)) == 3  # nothing shared: every block copied out
    if evicted:
        evict_all_cached(bm)
    copies = bm.swap_in(request)
    bm.check_invariants()
    if evicted:
        assert len(copies) == 3
    else:  # the full blocks were still cached where they were: only the partial one is copied
        assert bm.block_tables["a"][:2] == table[:2] and len(copies) == 1
    assert len(bm.free_swap_blocks) == 8


def test_shared_blocks_are_not_copied_nor_counted_against_the_host_pool() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, num_swap_blocks=1)
    holder = computed_request(bm, prompt(0, 12), "holder")
    victim = Request("victim", prompt(0, 12) + [5], SamplingParams(), (), 8)
    cached = bm.find_cached_prefix(victim)
    victim.num_computed_tokens = 12  # as admission does: the cached tokens count as computed
    assert len(cached) == 3 and bm.allocate_slots(victim, 1, cached)
    victim.num_computed_tokens = 13
    assert bm.num_shared_prefix_blocks(victim) == 3
    assert bm.can_swap_out(victim)  # one host block for its one unshared block
    unshared = bm.block_tables["victim"][3]
    assert bm.swap_out(victim) == [(unshared, 0)]
    assert bm.num_blocks_to_swap_in(victim) == 1  # the prefix is live in holder's table
    bm.swap_in(victim)
    assert bm.block_tables["victim"][:3] == bm.block_tables["holder"]
    bm.check_invariants()
    bm.free(holder)
    bm.free(victim)
    assert bm.num_used_blocks == 0
