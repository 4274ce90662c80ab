"""Hypothesis-driven random runs of scheduler + block manager with the fake runner.

Random arrivals (lengths, n, priorities, max_tokens), aborts at any moment, tiny pools, both
preemption modes, both batching modes, both policies. After every step the invariants hold; at the
end every sequence finished exactly once, with exactly its reference tokens unless aborted, and no
block is left behind.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cobatch.config import SchedulerConfig
from cobatch.engine import Engine
from cobatch.sampling_params import SamplingParams
from tests.fakes import FakeRunner
from tests.test_scheduler import expected, prompt

MAX_MODEL_LEN = 32

configs = st.fixed_dictionaries({
    "block_size": st.sampled_from([2, 4, 8]),
    "extra_blocks": st.integers(0, 4),
    "num_swap_blocks": st.integers(0, 24),
    "max_num_seqs": st.integers(1, 6),
    "max_num_batched_tokens": st.sampled_from([4, 8, 16, 64]),
    "preemption_mode": st.sampled_from(["recompute", "swap", "auto"]),
    "batching": st.sampled_from(["continuous", "static"]),
    "scheduling_policy": st.sampled_from(["fcfs", "priority"]),
    "enable_prefix_caching": st.booleans(),
})

arrival = st.tuples(st.integers(1, 20), st.integers(1, 24), st.integers(1, 3),
                    st.integers(-2, 2), st.integers(0, 3))
events = st.lists(st.one_of(
    st.tuples(st.just("add"), arrival),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("step"), st.integers(1, 4)),
), min_size=1, max_size=40)


def build(cfg: dict) -> Engine:
    blocks = MAX_MODEL_LEN // cfg["block_size"] + cfg["extra_blocks"]
    config = SchedulerConfig(
        num_kv_blocks=blocks, block_size=cfg["block_size"], num_swap_blocks=cfg["num_swap_blocks"],
        max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
        max_model_len=MAX_MODEL_LEN, preemption_mode=cfg["preemption_mode"],
        batching=cfg["batching"], scheduling_policy=cfg["scheduling_policy"],
        enable_prefix_caching=cfg["enable_prefix_caching"])
    return Engine(FakeRunner(blocks, cfg["block_size"], cfg["num_swap_blocks"], MAX_MODEL_LEN),
                  config)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs, script=events)
def test_random_runs_keep_every_invariant(cfg: dict, script: list) -> None:
    engine = build(cfg)
    finishes: dict[str, list[str]] = {}
    tokens: dict[str, list[int]] = {}
    specs: dict[str, tuple[list[int], int, int]] = {}

    def record(deltas) -> None:
        for d in deltas:
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.finished:
                finishes.setdefault(d.request_id, []).append(d.finish_reason)

    def do_step() -> None:
        record(engine.step())
        engine.scheduler.check_invariants()

    for kind, arg in script:
        if kind == "add":
            plen, max_tokens, n, priority, variant = arg
            max_tokens = min(max_tokens, MAX_MODEL_LEN - plen)
            rid = f"r{len(specs)}"
            # Shared leading tokens across requests exercise the prefix cache.
            ids = prompt(variant, plen)
            specs[rid] = (ids, max_tokens, n)
            engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=max_tokens, n=n),
                               priority=priority)
        elif kind == "abort" and specs:
            record(engine.abort_request(f"r{arg % len(specs)}"))
            engine.scheduler.check_invariants()
        else:
            for _ in range(arg):
                do_step()
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            break
        do_step()
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.block_manager.num_used_blocks == 0
    assert not engine.scheduler.block_manager.swap_tables
    assert not engine.scheduler.block_manager.swap_resident
    for rid, (ids, max_tokens, n) in specs.items():
        seq_ids = [rid] if n == 1 else [f"{rid}#{i}" for i in range(n)]
        for seq_id in seq_ids:
            assert len(finishes.get(seq_id, [])) == 1, f"{seq_id} finished {finishes.get(seq_id)}"
            if finishes[seq_id] == ["length"]:
                assert tokens[seq_id] == expected(ids, max_tokens)
            else:
                assert finishes[seq_id] == ["abort"]
                assert tokens.get(seq_id, []) == expected(ids, len(tokens.get(seq_id, [])))
