"""N-gram speculative decoding: the lookup, the verification, and the scheduler around them (fake runner).

The real model's side (outputs identical with and without drafts, against HF) is in
test_engine_correctness.py.
"""

from __future__ import annotations

import pytest

from cobatch.config import SchedulerConfig
from cobatch.engine import Engine
from cobatch.sampling_params import SamplingParams
from cobatch.spec_decode import NgramIndex, NgramProposer, accepted_tokens, min_acceptance
from tests.fakes import FakeRunner
from tests.test_scheduler import Deltas, expected, params, prompt, run, tokens_of


# ---- lookup and verification ------------------------------------------------------------------------

def test_continuation_follows_the_latest_earlier_occurrence_of_the_longest_tail() -> None:
    tokens = [1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3]
    # tail (1, 2, 3) occurred at 0..2, followed by 9; (2, 3) alone later (followed by 8): longest wins
    assert NgramIndex(2, 3).continuation(tokens, 3) == [9, 2, 3]
    assert NgramIndex(2, 2).continuation(tokens, 3) == [8, 7, 1]  # the latest occurrence of (2, 3)
    assert NgramIndex(2, 3).continuation([5, 6, 7, 6], 3) == []  # the tail never matches itself
    assert NgramIndex(2, 3).continuation([4, 5, 4, 5], 4) == [4, 5]  # a continuation may run into the tail
    assert NgramIndex(2, 4).continuation([1], 2) == []


def test_index_built_step_by_step_equals_one_built_at_once() -> None:
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7]
    grown = NgramIndex(1, 3)
    for end in range(1, len(tokens) + 1):
        got = grown.continuation(tokens[:end], 4)
        assert got == NgramIndex(1, 3).continuation(tokens[:end], 4), end


def test_accepted_tokens_are_the_agreed_drafts_then_the_models_token() -> None:
    assert accepted_tokens((5, 6, 7), [5, 6, 7, 8]) == [5, 6, 7, 8]  # all agreed: a bonus token too
    assert accepted_tokens((5, 6, 7), [5, 9, 7, 8]) == [5, 9]  # first disagreement: the model's token
    assert accepted_tokens((5,), [4, 1]) == [4]


def test_proposer_limits_and_validation() -> None:
    proposer = NgramProposer(2, min_n=1, max_n=2)
    tokens = [1, 2, 3, 1, 2, 3, 1]
    assert proposer.propose(proposer.new_index(), tokens, 10) == (2, 3)  # num_speculative_tokens
    assert proposer.propose(proposer.new_index(), tokens, 1) == (2,)  # the caller's room
    assert proposer.propose(proposer.new_index(), tokens, 0) == ()
    with pytest.raises(ValueError):
        NgramProposer(0)
    with pytest.raises(ValueError, match="ngram_prompt_lookup"):
        SchedulerConfig(num_kv_blocks=8, max_model_len=16, num_speculative_tokens=2, ngram_prompt_lookup_min=3,
                        ngram_prompt_lookup_max=2)


# ---- the scheduler with drafts (fake runner: it checks every KV slot each step) ----------------------

LOOP = [11, 12, 13, 14] * 20  # a scripted output that repeats itself: drafts get accepted


def make_engine(num_kv_blocks: int = 64, block_size: int = 4, max_model_len: int = 96, script=None,
                **kw) -> Engine:
    config = SchedulerConfig(num_kv_blocks=num_kv_blocks, block_size=block_size, max_model_len=max_model_len, **kw)
    runner = FakeRunner(num_kv_blocks, block_size, max_model_len=max_model_len)
    runner.script = dict(script or {})
    return Engine(runner, config)


def outputs(speculative_tokens: int, requests: list[tuple[list[int], int]], script=None,
            **kw) -> tuple[Deltas, Engine]:
    engine = make_engine(num_speculative_tokens=speculative_tokens, script=script, **kw)
    for i, (p, n) in enumerate(requests):
        engine.add_request(f"r{i}", p, params(n))
    return run(engine), engine


def test_drafts_are_verified_and_outputs_stay_identical() -> None:
    requests = [(prompt(i, 3 + 5 * i), 30 + 7 * i) for i in range(4)]
    script = {"r0": LOOP, "r2": LOOP[1:]}  # r1, r3: hash-like outputs (drafts rarely right)
    plain, _ = outputs(0, requests, script)
    spec, spec_engine = outputs(3, requests, script)
    for i in range(4):
        assert tokens_of(spec[f"r{i}"]) == tokens_of(plain[f"r{i}"])
        assert spec[f"r{i}"][-1].finish_reason == "length"
    assert tokens_of(spec["r1"]) == expected(requests[1][0], requests[1][1])
    stats = list(spec_engine.stats)
    drafts, accepted = sum(s.num_draft_tokens for s in stats), sum(s.num_accepted_tokens for s in stats)
    assert accepted > 40 and accepted <= drafts == spec_engine.scheduler.num_draft_tokens_total
    assert sum(s.num_generated_tokens for s in stats) == sum(n for _, n in requests)
    # runs of verified tokens: the looping rows finish in fewer steps
    assert len(spec["r0"]) < len(plain["r0"]) / 2 and len(spec["r2"]) < len(plain["r2"]) / 2


@pytest.mark.parametrize("stop_at", [5, 6, 7])  # inside a verified run, at its end, in the next one
def test_a_stop_inside_a_verified_run_ends_the_request_there(stop_at: int) -> None:
    script = {"r0": LOOP[:stop_at] + [99] + LOOP}
    engine = make_engine(num_speculative_tokens=4, script=script)
    engine.add_request("r0", [11, 12, 13, 14, 11, 12], params(40, stop_token_ids=[99]))
    out = run(engine)
    assert tokens_of(out["r0"]) == LOOP[:stop_at] + [99]
    assert out["r0"][-1].finish_reason == "stop" and out["r0"][-1].stop_reason == 99
    assert any(len(d.new_token_ids) > 1 for d in out["r0"])


@pytest.mark.parametrize("max_tokens", [1, 2, 9])
def test_drafts_never_run_past_max_tokens_or_max_model_len(max_tokens: int) -> None:
    spec, engine = outputs(4, [([11, 12, 13, 14, 11, 12, 13], max_tokens)], {"r0": LOOP[3:]})
    assert tokens_of(spec["r0"]) == LOOP[3:3 + max_tokens]
    # max_model_len: 20 tokens of room in all; the last drafts are cut so no position passes it
    spec, _ = outputs(4, [([11, 12, 13, 14] * 2, 12)], {"r0": LOOP}, max_model_len=20)
    assert tokens_of(spec["r0"]) == LOOP[:12]


def test_drafts_never_preempt_and_pressure_keeps_outputs() -> None:
    requests = [(prompt(i, 6), 24) for i in range(5)]
    script = {f"r{i}": LOOP[i:] for i in range(5)}
    roomy, _ = outputs(0, requests, script)
    tight, engine = outputs(3, requests, script, num_kv_blocks=24)
    assert {k: tokens_of(v) for k, v in tight.items()} == {k: tokens_of(v) for k, v in roomy.items()}
    assert engine.scheduler.num_draft_tokens_total > 0


def test_only_greedy_rows_without_penalties_draft_and_only_continuous() -> None:
    loop_prompt = [11, 12, 13, 14] * 3
    cases = [SamplingParams(temperature=0.7, max_tokens=20), params(20, presence_penalty=0.5),
             params(20, repetition_penalty=1.2), params(20, min_tokens=20)]
    for sampling in cases:
        engine = make_engine(num_speculative_tokens=3, script={"r0": LOOP})
        engine.add_request("r0", loop_prompt, sampling)
        run(engine)
        assert engine.scheduler.num_draft_tokens_total == 0, sampling
    for options in (dict(batching="static"), dict(tpot_slo_ms=1000.0)):
        engine = make_engine(num_speculative_tokens=3, script={"r0": LOOP}, **options)
        engine.add_request("r0", loop_prompt, params(20))
        run(engine)
        assert engine.scheduler.num_draft_tokens_total == 0, options


def test_sequences_whose_drafts_keep_failing_stop_drafting_in_large_batches() -> None:
    """A rejected draft is a row computed in vain: in a large (compute-bound) batch a sequence drafts only
    while most of its drafts verify; alone (bandwidth-bound) it keeps drafting."""
    misleading = [t for k in range(7, 40) for t in (5, 6, k)]  # (5, 6) recurs, followed by a new token

    def drafts_per_request(num_requests: int) -> tuple[float, int]:
        script = {f"r{i}": misleading for i in range(num_requests)}
        engine = make_engine(num_kv_blocks=1024, num_speculative_tokens=3, script=script)
        for i in range(num_requests):
            engine.add_request(f"r{i}", [7, 8], params(60))
        out = run(engine)
        assert all(tokens_of(out[f"r{i}"]) == misleading[:60] for i in range(num_requests))
        scheduler = engine.scheduler
        return scheduler.num_draft_tokens_total / num_requests, scheduler.num_accepted_tokens_total

    alone, _ = drafts_per_request(1)
    crowded, accepted = drafts_per_request(40)
    assert accepted == 0 and alone >= 30 and crowded <= 3
    assert min_acceptance(1) == 0.0 and min_acceptance(64) == 0.75
