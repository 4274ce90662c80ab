"""The Ray router's core as pure functions over fake stats: no Ray, no engine, milliseconds."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from cobatch.block_manager import BlockManager
from cobatch.ray.arrivals import ARRIVALS_WINDOW_S, RecentArrivals
from cobatch.ray.prefix_index import PrefixIndex, max_cached_blocks, prompt_block_hashes
from cobatch.ray.routing_state import RoutingState
from cobatch.ray.scoring import (
    DEADLINE, EXCLUDED_BY_CALLER, FULL, MISSES_DEADLINE, PROMPT_EXCEEDS_KV, QUEUE_FULL, ROUTED,
    ReplicaStats, RouteQuery, RouterConfig,
)
from cobatch.request import Request
from cobatch.sampling_params import SamplingParams

BLOCK_SIZE = 4
NOW = 1_000.0
# 10 ms a step, +1 ms a row, +0.5 ms a token, +1 us a context token.
COEFFICIENTS = (0.01, 0.001, 0.0005, 1e-6)


def fake_stats(replica_id: str, time_s: float = NOW, **fields: object) -> ReplicaStats:
    base = ReplicaStats(replica_id=replica_id, time_s=time_s, block_size=BLOCK_SIZE,
                        num_kv_blocks=1024, num_kv_blocks_free=1024, num_running=0, num_waiting=0,
                        max_num_seqs=16, max_num_batched_tokens=64,
                        step_coefficients=COEFFICIENTS, decode_coefficients=COEFFICIENTS)
    return dataclasses.replace(base, **fields)


def state_with(*stats: ReplicaStats, config: RouterConfig | None = None) -> RoutingState:
    state = RoutingState(BLOCK_SIZE, config)
    for record in stats:
        state.update_stats(record)
    return state


def query(request_id: str, prompt: list[int], **fields: object) -> RouteQuery:
    return RouteQuery(request_id=request_id, prompt_token_ids=tuple(prompt), **fields)


SYSTEM_PROMPT = list(range(100, 160))  # 60 tokens: 15 full blocks


def user_prompt(user: int) -> list[int]:
    return SYSTEM_PROMPT + [1000 + user] * 4


# ---- block hashes: the router's chain is the engine's -----------------------------------------

def make_request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id=request_id, prompt_token_ids=prompt, sampling_params=SamplingParams(),
                   eos_token_ids=(), max_tokens=4)


def test_block_hash_chain_equals_the_engines() -> None:
    prompt = list(range(23))
    request = make_request("a", prompt)
    BlockManager(num_blocks=16, block_size=BLOCK_SIZE).update_block_hashes(request)
    assert request.block_hashes == prompt_block_hashes(prompt, BLOCK_SIZE)
    assert len(request.block_hashes) == 5


def test_index_predicts_the_engines_cache_hits() -> None:
    manager = BlockManager(num_blocks=32, block_size=BLOCK_SIZE)
    first = make_request("a", SYSTEM_PROMPT[:20] + [1, 2, 3])
    assert manager.allocate_slots(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    manager.cache_full_blocks(first)
    index = PrefixIndex(BLOCK_SIZE)
    index.record_routed("r1", prompt_block_hashes(first.prompt_token_ids, BLOCK_SIZE))
    for prompt in (SYSTEM_PROMPT[:20] + [9], SYSTEM_PROMPT[:12], SYSTEM_PROMPT[:20] + [1, 2, 3, 4]):
        second = make_request("b", prompt)
        usable = prompt_block_hashes(prompt, BLOCK_SIZE)[:max_cached_blocks(len(prompt), BLOCK_SIZE)]
        assert index.num_matched_blocks("r1", usable) == len(manager.find_cached_prefix(second))


def test_block_hashes_agree_across_processes() -> None:
    # The router and a replica are different processes: the chain must not depend on one (hash(None)
    # is address-based in Python 3.11).
    code = ("from cobatch.ray.prefix_index import prompt_block_hashes;"
            "print(prompt_block_hashes(list(range(12)), 4))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(prompt_block_hashes(list(range(12)), BLOCK_SIZE))


# ---- the cost --------------------------------------------------------------------------------

def test_prefix_affinity_wins_when_load_is_equal() -> None:
    state = state_with(fake_stats("r1"), fake_stats("r2"))
    state.index.record_routed("r2", prompt_block_hashes(user_prompt(0), BLOCK_SIZE))
    decision = state.decide(query("q", user_prompt(1)), ["r1", "r2"], NOW)
    assert decision.status == ROUTED and decision.chosen == "r2"
    best, other = decision.candidates
    assert best.num_prefix_blocks == 15 and other.num_prefix_blocks == 0
    assert best.ttft_s < other.ttft_s and best.num_prefill_tokens == 4
    assert "r2" in decision.reason and "15 prefix blocks" in decision.reason


def test_hot_prefix_holder_loses_to_an_idle_replica() -> None:
    hot = fake_stats("r1", num_running=12, num_running_tokens=12 * 80, num_waiting=6,
                     num_waiting_requests=6, num_waiting_tokens=6 * 64)
    state = state_with(hot, fake_stats("r2"))
    state.index.record_routed("r1", prompt_block_hashes(user_prompt(0), BLOCK_SIZE))
    decision = state.decide(query("q", user_prompt(1)), ["r1", "r2"], NOW)
    assert decision.chosen == "r2"
    by_id = {c.replica_id: c for c in decision.candidates}
    assert by_id["r1"].num_prefix_blocks == 15 and by_id["r1"].ttft_s > by_id["r2"].ttft_s
    assert by_id["r1"].num_queued_tokens == 6 * 64


def test_concurrent_decisions_do_not_herd() -> None:
    # Ten decisions before any stats record shows them: only the ledger tells them apart.
    state = state_with(fake_stats("r1"), fake_stats("r2"))
    chosen = [state.decide(query(f"q{i}", [7 * i + j for j in range(64)]), ["r1", "r2"], NOW).chosen
              for i in range(10)]
    assert chosen.count("r1") == 5 and chosen.count("r2") == 5
    assert len(state.ledger) == 10


def test_a_shared_prefix_spreads_and_stays_warm() -> None:
    state = state_with(fake_stats("r1"), fake_stats("r2"), fake_stats("r3"))
    decisions = [state.decide(query(f"u{i}", user_prompt(i)), ["r1", "r2", "r3"], NOW)
                 for i in range(10)]
    counts = {r: sum(d.chosen == r for d in decisions) for r in ("r1", "r2", "r3")}
    assert max(counts.values()) <= 5, counts  # no herd onto the first holder
    assert sum(1 for d in decisions if d.candidates[0].num_prefix_blocks == 15) >= 7


def test_a_slower_replica_loses_at_equal_load_when_each_is_priced_by_its_own_model() -> None:
    slow = tuple(4 * c for c in COEFFICIENTS)
    state = state_with(fake_stats("r1", step_coefficients=slow, decode_coefficients=slow),
                       fake_stats("r2"), config=RouterConfig(pool_step_models=False))
    assert state.decide(query("q", list(range(64))), ["r1", "r2"], NOW).chosen == "r2"


def test_pooled_models_let_the_cached_prefix_beat_a_noisy_fit() -> None:
    """By default the replicas' fits are averaged: one that measured itself slower (noise on a busy
    host) does not lose the request whose prefix it caches."""
    noisy = tuple(1.5 * c for c in COEFFICIENTS)
    state = state_with(fake_stats("r1", step_coefficients=noisy, decode_coefficients=noisy),
                       fake_stats("r2"))
    state.index.record_routed("r1", prompt_block_hashes(user_prompt(0), BLOCK_SIZE))
    decision = state.decide(query("q", user_prompt(1), max_tokens=64), ["r1", "r2"], NOW)
    assert decision.chosen == "r1"
    assert {c.tpot_s for c in decision.candidates} == {decision.candidates[0].tpot_s}


def test_an_uncached_prefill_also_costs_the_rows_it_holds_up() -> None:
    busy_stats = dict(num_running=3, num_running_tokens=3 * 70)
    state = state_with(fake_stats("r1", **busy_stats), fake_stats("r2", **busy_stats))
    state.index.record_routed("r1", prompt_block_hashes(user_prompt(0), BLOCK_SIZE))
    decision = state.decide(query("q", user_prompt(1)), ["r1", "r2"], NOW)
    r1, r2 = sorted(decision.candidates, key=lambda c: c.replica_id)
    assert decision.chosen == "r1" and r1.prefill_s < r2.prefill_s
    # Beyond its own TTFT, each of the 3 rows running there waits for the prefill's steps.
    extra = (r2.score_s - r1.score_s) - (r2.ttft_s - r1.ttft_s)
    assert extra == pytest.approx(3 * (r2.prefill_s - r1.prefill_s), rel=0.05)


def test_co_runners_wait_only_for_what_a_prefill_adds_to_their_steps() -> None:
    """A cached prompt's last chunk rides a step the running rows take anyway: its prefill_s is the
    chunk's own share, not the whole step (which once made a cached prefix look barely cheaper)."""
    busy_stats = dict(num_running=3, num_running_tokens=3 * 70)
    state = state_with(fake_stats("r1", **busy_stats), fake_stats("r2", **busy_stats))
    state.index.record_routed("r1", prompt_block_hashes(user_prompt(0), BLOCK_SIZE))
    decision = state.decide(query("q", user_prompt(1)), ["r1", "r2"], NOW)
    r1, r2 = sorted(decision.candidates, key=lambda c: c.replica_id)
    c0, c_row, c_token, c_context = COEFFICIENTS
    num_uncached = len(user_prompt(1)) - r1.num_prefix_blocks * BLOCK_SIZE
    cached_context = r1.num_prefix_blocks * BLOCK_SIZE + num_uncached
    assert r1.prefill_s == pytest.approx(c_row + c_token * num_uncached + c_context * cached_context)
    # Uncached, 64 tokens take two steps beside the 3 rows (a budget of 64 = 3 decode + 61): each adds a row.
    assert r2.prefill_s == pytest.approx(2 * c_row + (c_token + c_context) * len(user_prompt(1)))


def test_a_kv_short_replica_costs_the_wait_for_running_requests_to_free_blocks() -> None:
    full = fake_stats("r1", num_kv_blocks=64, num_kv_blocks_free=2, num_running=8,
                      num_running_tokens=8 * 28, mean_output_tokens=32.0)
    state = state_with(full, fake_stats("r2", num_kv_blocks=64, num_kv_blocks_free=64))
    decision = state.decide(query("q", list(range(64))), ["r1", "r2"], NOW)
    r1 = next(c for c in decision.candidates if c.replica_id == "r1")
    r2 = next(c for c in decision.candidates if c.replica_id == "r2")
    assert decision.chosen == "r2" and not r1.kv_fits and r1.penalty_s == 0.0
    assert r1.ttft_s > r2.ttft_s  # it waits for about two of its eight rows to finish


# ---- exclusions and refusals ---------------------------------------------------------------------

def busy(replica_id: str) -> ReplicaStats:
    return fake_stats(replica_id, num_running=16, num_running_tokens=16 * 200, num_waiting=20,
                      num_waiting_requests=20, num_waiting_tokens=20 * 500)


def test_a_replica_predicted_to_miss_the_deadline_is_skipped() -> None:
    state = state_with(busy("r1"), fake_stats("r2"))
    state.index.record_routed("r1", prompt_block_hashes(user_prompt(0), BLOCK_SIZE))
    decision = state.decide(query("q", user_prompt(1), deadline_s=NOW + 0.5), ["r1", "r2"], NOW)
    assert decision.chosen == "r2"
    assert {c.replica_id: c.excluded for c in decision.candidates} == {"r1": MISSES_DEADLINE, "r2": ""}


def test_a_deadline_no_replica_can_meet_is_refused() -> None:
    state = state_with(busy("r1"), busy("r2"))
    decision = state.decide(query("q", user_prompt(1), deadline_s=NOW + 0.5), ["r1", "r2"], NOW)
    assert decision.status == DEADLINE and decision.chosen is None
    assert "deadline" in decision.reason
    assert len(state.ledger) == 0  # nothing booked for a refused request


def test_kv_full_replica_loses_even_holding_the_prefix() -> None:
    state = state_with(fake_stats("r1", num_kv_blocks_free=1), fake_stats("r2"))
    state.index.record_routed("r1", prompt_block_hashes(user_prompt(0), BLOCK_SIZE))
    decision = state.decide(query("q", user_prompt(1)), ["r1", "r2"], NOW)
    assert decision.chosen == "r2"
    r1 = next(c for c in decision.candidates if c.replica_id == "r1")
    assert not r1.kv_fits and r1.penalty_s > 0 and not r1.excluded
    assert r1.num_prefix_blocks == 15  # its cached prefix leaves 2 blocks to allocate: one is free


def test_when_every_replica_is_kv_full_the_least_bad_is_still_chosen() -> None:
    state = state_with(fake_stats("r1", num_kv_blocks_free=1), fake_stats("r2", num_kv_blocks_free=3))
    decision = state.decide(query("q", list(range(64))), ["r1", "r2"], NOW)
    assert decision.status == ROUTED and not decision.candidates[0].kv_fits


def test_full_queues_exclude_and_then_refuse() -> None:
    full = fake_stats("r1", max_num_waiting_requests=4, num_waiting=4, num_waiting_requests=4)
    state = state_with(full, fake_stats("r2", max_num_waiting_requests=4))
    assert state.decide(query("q", list(range(16))), ["r1", "r2"], NOW).chosen == "r2"
    state.update_stats(dataclasses.replace(full, replica_id="r2", time_s=NOW + 0.1))
    decision = state.decide(query("q2", list(range(16))), ["r1", "r2"], NOW + 0.1)
    assert decision.status == FULL and decision.chosen is None
    assert {c.excluded for c in decision.candidates} == {QUEUE_FULL}


def test_requests_in_flight_fill_free_seats_before_the_queue() -> None:
    stats = fake_stats("r1", max_num_seqs=4, num_running=1, max_num_waiting_requests=2)
    state = state_with(stats)
    # 3 free seats, then a queue of 2: the 5th request routed before a stats record is refused.
    decisions = [state.decide(query(f"q{i}", list(range(8))), ["r1"], NOW) for i in range(6)]
    assert [d.status for d in decisions] == [ROUTED] * 5 + [FULL]


def test_caller_exclusion_and_a_prompt_larger_than_the_cache() -> None:
    state = state_with(fake_stats("r1"), fake_stats("r2", num_kv_blocks=8, num_kv_blocks_free=8))
    decision = state.decide(query("q", list(range(64)), exclude=frozenset({"r1"})), ["r1", "r2"], NOW)
    assert decision.chosen is None
    assert {c.replica_id: c.excluded for c in decision.candidates} == {
        "r1": EXCLUDED_BY_CALLER, "r2": PROMPT_EXCEEDS_KV}


# ---- bookkeeping: stats age, retirements, purge, evictions -----------------------------------------

def test_stats_retire_the_ledger_entries_they_list_as_arrived() -> None:
    state = state_with(fake_stats("r1"))
    state.decide(query("q", list(range(16))), ["r1"], NOW)
    state.decide(query("lost", list(range(16, 32))), ["r1"], NOW)
    # Measured a second later, yet before either arrived (a slow actor call on a busy host).
    state.update_stats(fake_stats("r1", time_s=NOW + 1.0))
    assert state.ledger.load("r1").num_requests == 2
    state.update_stats(fake_stats("r1", time_s=NOW + 1.5, num_waiting=1, num_waiting_tokens=16,
                                  recent_arrivals=("q",)))
    assert state.ledger.load("r1").num_requests == 1
    # Not listed by any record for a whole arrivals window: it never arrived in time.
    state.update_stats(fake_stats("r1", time_s=NOW + ARRIVALS_WINDOW_S, num_waiting=1,
                                  num_waiting_tokens=16))
    assert state.ledger.load("r1").num_requests == 0


def test_a_record_measured_before_a_request_arrived_does_not_send_the_next_one_after_it() -> None:
    state = state_with(fake_stats("r1"), fake_stats("r2"))
    assert state.decide(query("a", SYSTEM_PROMPT), ["r1", "r2"], NOW).chosen == "r1"
    state.update_stats(fake_stats("r1", time_s=NOW + 0.2))  # the call carrying "a" still on its way
    assert state.decide(query("b", list(range(200, 260))), ["r1", "r2"], NOW + 0.3).chosen == "r2"


def test_a_replica_lists_the_arrivals_of_its_last_window() -> None:
    arrivals = RecentArrivals()
    arrivals.add("old", NOW)
    arrivals.add("new", NOW + ARRIVALS_WINDOW_S / 2)
    assert arrivals.listed(NOW + ARRIVALS_WINDOW_S / 2) == ("old", "new")
    assert arrivals.listed(NOW + ARRIVALS_WINDOW_S + 0.1) == ("new",)


def test_a_retry_replaces_its_earlier_booking_and_completion_clears_it() -> None:
    state = state_with(fake_stats("r1"), fake_stats("r2"))
    state.decide(query("q", list(range(16))), ["r1", "r2"], NOW)
    state.decide(query("q", list(range(16))), ["r1", "r2"], NOW)
    assert len(state.ledger) == 1
    state.complete("q", NOW)
    assert len(state.ledger) == 0


def test_a_request_finished_since_the_last_record_no_longer_loads_its_replica() -> None:
    state = state_with(fake_stats("r1"), fake_stats("r2"))
    assert state.decide(query("q", list(range(16))), ["r1", "r2"], NOW).chosen == "r1"
    # The next record shows it running on r1; then it finishes before the record after that.
    state.update_stats(fake_stats("r1", time_s=NOW + 0.5, num_running=1, num_running_tokens=16,
                                  recent_arrivals=("q",)))
    assert state.decide(query("q2", list(range(100, 116))), ["r1", "r2"], NOW + 0.6).chosen == "r2"
    state.complete("q", NOW + 0.7)
    assert state.ledger.finished_load("r1").num_requests == 1
    state.complete("q2", NOW + 0.7)
    assert state.decide(query("q3", list(range(200, 216))), ["r1", "r2"], NOW + 0.8).chosen == "r1"
    state.update_stats(fake_stats("r1", time_s=NOW + 1.0))  # a newer record: nothing to take off
    assert state.ledger.finished_load("r1").num_requests == 0


def test_a_record_taken_mid_prefill_shows_no_queue_once_that_request_finished() -> None:
    state = state_with(fake_stats("r1"), fake_stats("r2"))
    prompt = SYSTEM_PROMPT + [7] * 4
    assert state.decide(query("warm", prompt), ["r1", "r2"], NOW).chosen == "r1"
    # r1's next record is measured while its prefill is under way, then it finishes.
    state.update_stats(fake_stats("r1", time_s=NOW + 0.5, num_running=1, num_running_tokens=64,
                                  num_running_prefill_tokens=40, num_kv_blocks_free=1008,
                                  recent_arrivals=("warm",)))
    state.complete("warm", NOW + 0.6)
    decision = state.decide(query("next", SYSTEM_PROMPT + [8] * 4), ["r1", "r2"], NOW + 0.7)
    by_id = {c.replica_id: c for c in decision.candidates}
    assert decision.chosen == "r1" and by_id["r1"].num_queued_tokens == 0
    assert by_id["r1"].ttft_s < by_id["r2"].ttft_s


def test_a_finished_request_a_record_showed_waiting_takes_its_whole_prompt_off_the_queue() -> None:
    state = state_with(fake_stats("r1"), fake_stats("r2"))
    assert state.decide(query("warm", user_prompt(0)), ["r1", "r2"], NOW).chosen == "r1"
    state.complete("warm", NOW + 0.2)
    state.update_stats(fake_stats("r1", time_s=NOW + 0.3, recent_arrivals=("warm",)))
    assert state.decide(query("u1", user_prompt(1)), ["r1", "r2"], NOW + 0.4).chosen == "r1"
    # Measured while u1 waited there: a waiting request counts with its whole prompt, cached or not.
    state.update_stats(fake_stats("r1", time_s=NOW + 0.5, num_waiting=1, num_waiting_requests=1,
                                  num_waiting_tokens=64, recent_arrivals=("warm", "u1")))
    state.complete("u1", NOW + 0.6)
    decision = state.decide(query("u2", user_prompt(2)), ["r1", "r2"], NOW + 0.7)
    by_id = {c.replica_id: c for c in decision.candidates}
    assert decision.chosen == "r1" and by_id["r1"].num_queued_tokens == 0


def test_a_request_listed_by_a_record_and_finished_after_it_is_taken_off_it() -> None:
    state = state_with(fake_stats("r1"), fake_stats("r2"))
    assert state.decide(query("q", list(range(16))), ["r1", "r2"], NOW).chosen == "r1"
    # Measured just after the decision, and q had arrived: the record counts it, the ledger not...
    state.update_stats(fake_stats("r1", time_s=NOW + 0.01, num_waiting=1,
                                  num_waiting_requests=1, num_waiting_tokens=16,
                                  recent_arrivals=("q",)))
    assert state.ledger.load("r1").num_requests == 0
    # ...and once q finishes nothing of it loads r1.
    state.complete("q", NOW + 0.2)
    assert state.ledger.load("r1").num_requests == 0
    assert state.ledger.finished_load("r1").num_requests == 1
    decision = state.decide(query("q2", list(range(100, 116))), ["r1", "r2"], NOW + 0.3)
    assert {c.replica_id: c.num_queued_tokens for c in decision.candidates} == {"r1": 0, "r2": 0}


def test_a_record_measured_before_a_finish_but_arriving_after_it_is_corrected() -> None:
    state = state_with(fake_stats("r1"), fake_stats("r2"))
    assert state.decide(query("q", list(range(16))), ["r1", "r2"], NOW).chosen == "r1"
    state.complete("q", NOW + 0.3)  # done before any record showed it...
    # ...and then the record measured mid-prefill (through Serve's controller, late) arrives.
    state.update_stats(fake_stats("r1", time_s=NOW + 0.1, num_running=1, num_running_tokens=16,
                                  num_running_prefill_tokens=12, recent_arrivals=("q",)))
    decision = state.decide(query("q2", list(range(100, 116))), ["r1", "r2"], NOW + 0.4)
    by_id = {c.replica_id: c for c in decision.candidates}
    assert by_id["r1"].num_queued_tokens == 0 and by_id["r1"].ttft_s == by_id["r2"].ttft_s
    state.update_stats(fake_stats("r1", time_s=NOW + 0.5))  # measured after the finish: nothing off
    assert state.ledger.finished_load("r1").num_requests == 0


def test_stale_stats_are_marked_penalised_and_keep_local_bookkeeping() -> None:
    state = state_with(fake_stats("r1", time_s=NOW - 3.0), fake_stats("r2", time_s=NOW - 3.0))
    for i in range(4):
        state.decide(query(f"q{i}", [i] * 16), ["r1", "r2"], NOW)
    state.update_stats(fake_stats("r2", time_s=NOW + 0.5, recent_arrivals=("q1", "q3")))  # r1 silent
    decision = state.decide(query("q", list(range(16))), ["r1", "r2"], NOW + 0.5)
    by_id = {c.replica_id: c for c in decision.candidates}
    assert by_id["r1"].is_stale and by_id["r1"].penalty_s == pytest.approx(2.5)
    assert by_id["r1"].num_inflight == 2 and by_id["r2"].num_inflight == 0
    assert decision.chosen == "r2" and "stale" not in decision.reason.split(";")[0]


def test_a_controller_late_with_every_record_lets_the_cached_prefix_decide() -> None:
    """Both records stale (a busy host delays the controller), the prefix holder's 0.4 s more: both are
    marked, neither pays for being late beside the other, and the cached prefix wins."""
    state = state_with(fake_stats("r1", time_s=NOW - 1.2), fake_stats("r2", time_s=NOW - 1.6))
    state.index.record_routed("r2", prompt_block_hashes(user_prompt(0), BLOCK_SIZE))
    decision = state.decide(query("q", user_prompt(1)), ["r1", "r2"], NOW)
    assert all(c.is_stale and c.penalty_s == 0.0 for c in decision.candidates)
    assert decision.chosen == "r2"
    later = state.decide(query("q2", user_prompt(2)), ["r1", "r2"], NOW + 1.0)  # both later, 0.4 s apart
    assert {c.replica_id: c.penalty_s for c in later.candidates} == {"r1": 0.0, "r2": pytest.approx(0.0)}
    state.update_stats(fake_stats("r1", time_s=NOW + 1.0))
    fresh = state.decide(query("q3", user_prompt(3)), ["r1", "r2"], NOW + 1.0)  # r2 2.6 s behind r1
    assert {c.replica_id: c.penalty_s for c in fresh.candidates} == {"r1": 0.0, "r2": pytest.approx(1.6)}
    with_new = state.decide(query("q4", user_prompt(4)), ["r1", "r2", "new"], NOW + 1.5)  # "new": no stats
    assert {c.replica_id: c.penalty_s for c in with_new.candidates} == {
        "r1": 0.0, "r2": pytest.approx(2.1), "new": 0.0}


def test_a_replica_without_stats_is_scored_as_idle_like_the_others() -> None:
    state = state_with(fake_stats("r1", num_running=8, num_running_tokens=800))
    decision = state.decide(query("q", list(range(32))), ["r1", "new"], NOW)
    assert decision.chosen == "new"
    assert decision.candidates[0].stats_age_s is None and "no stats yet" in decision.reason


def test_a_dead_replicas_state_is_purged() -> None:
    state = state_with(fake_stats("r1"), fake_stats("r2"))
    for i in range(4):
        state.decide(query(f"u{i}", user_prompt(i)), ["r1", "r2"], NOW)
    state.sync_replicas(["r2"])
    assert "r1" not in state.stats and "r1" not in state.ledger.replica_ids
    assert "r1" not in state.index.replica_ids and state.index.num_blocks("r2") > 0
    assert state.ledger.load("r1").num_requests == 0


def test_reported_evictions_remove_affinity() -> None:
    state = state_with(fake_stats("r1"), fake_stats("r2"))
    hashes = prompt_block_hashes(user_prompt(0), BLOCK_SIZE)
    state.index.record_routed("r1", hashes)
    state.update_stats(fake_stats("r1", time_s=NOW + 1, num_evictions_total=3,
                                  recent_evicted_hashes=(12345, hashes[2], hashes[1])))
    assert state.index.num_matched_blocks("r1", hashes) == 1


def test_missed_eviction_reports_forget_the_replica() -> None:
    index = PrefixIndex(BLOCK_SIZE)
    hashes = prompt_block_hashes(user_prompt(0), BLOCK_SIZE)
    index.record_routed("r1", hashes)
    assert index.apply_eviction_report("r1", 2, (111, 222))
    assert index.num_matched_blocks("r1", hashes) == len(hashes)
    assert not index.apply_eviction_report("r1", 10, (333, 444))  # 8 new, 2 listed: some missed
    assert index.num_matched_blocks("r1", hashes) == 0


def test_the_index_is_lru_bounded_dropping_deep_blocks_first() -> None:
    index = PrefixIndex(BLOCK_SIZE, max_blocks_per_replica=6)
    first, second = prompt_block_hashes(list(range(16)), 4), prompt_block_hashes(list(range(50, 66)), 4)
    index.record_routed("r1", first)
    index.record_routed("r1", second)
    assert index.num_blocks("r1") == 6
    assert index.num_matched_blocks("r1", second) == 4 and index.num_matched_blocks("r1", first) == 2
    index.set_capacity("r1", 3)
    assert index.num_blocks("r1") == 3 and index.num_matched_blocks("r1", second) == 3


# ---- records ----------------------------------------------------------------------------------------

def test_stats_round_trip_through_a_routing_stats_dict() -> None:
    stats = fake_stats("r1", recent_evicted_hashes=(1, 2), max_num_waiting_requests=8)
    wire = json.loads(json.dumps(stats.to_dict()))  # tuples become lists on the way
    assert ReplicaStats.from_dict({**wire, "unknown_field": 1}) == stats


def test_a_decision_record_is_plain_data() -> None:
    state = state_with(fake_stats("r1"), fake_stats("r2"))
    decision = state.decide(query("q", user_prompt(0)), ["r1", "r2"], NOW)
    record = json.loads(json.dumps(decision.to_dict()))
    assert record["chosen"] == decision.chosen and len(record["candidates"]) == 2
    assert {"ttft_s", "tpot_s", "num_prefix_blocks", "score_s"} <= set(record["candidates"][0])
    assert list(state.decisions) == [decision]
