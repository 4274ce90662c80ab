"""A hypothesis state machine over engine + scheduler + block manager with the KV-checking fake runner.

Rules interleave arrivals (some with deadlines, on a fake clock that moves 1 ms a step), aborts
(wherever the request is: waiting, running, swapped, mid-chunk), stop-string finishes of one sequence,
failing steps and plain steps, over random pool sizes and every scheduler mode. After every rule:
blocks conserved and never double-owned, no sequence lost or finished twice, every sequence's tokens a
prefix of its reference; after every step: no row for a request whose deadline had passed. `drain` then demands that all
work finishes within a bounded number of steps (no livelock, no thrash) with nothing left behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cobatch.config import SchedulerConfig
from cobatch.engine import Engine
from cobatch.outputs import RequestDelta
from cobatch.request import RequestStatus
from cobatch.sampling_params import SamplingParams
from cobatch.testing.faults import FaultInjectingRunner
from tests.fakes import FakeRunner
from cobatch.scheduler import _StepPlan
from cobatch.scheduler_output import SchedulerOutput
from tests.test_deadlines import Clock
from tests.test_scheduler import expected, make_engine, params, prompt, run, tokens_of

MAX_DRAIN_STEPS = 3000  # far above any legal run here: hitting it means a livelock
STEP_S = 0.001  # the fake clock's step
CLOCK = Clock()


@pytest.fixture(autouse=True)
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("cobatch.engine.time", CLOCK)
    monkeypatch.setattr("cobatch.scheduler.time", CLOCK)


@dataclass(slots=True)
class _Seq:
    """What the test knows about one sequence: its reference and what it has received."""

    prompt: list[int]
    max_tokens: int
    deadline_time: float | None = None
    tokens: list[int] = field(default_factory=list)
    finishes: list[str] = field(default_factory=list)


def _config(draw: st.DrawFn) -> SchedulerConfig:
    """A random small scheduler config: the pool holds between one and ~2.5 maximal sequences."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.sampled_from([16, 32]))
    chunked = draw(st.booleans())
    budgets = [4, 8, 16, 64] if chunked else [max_model_len, 64]
    return SchedulerConfig(
        num_kv_blocks=max_model_len // block_size + draw(st.integers(0, 40 // block_size)),
        block_size=block_size, max_model_len=max_model_len,
        num_swap_blocks=draw(st.integers(0, 24)), max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.sampled_from(budgets)), enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()),
        batching=draw(st.sampled_from(["continuous", "static"])),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        preemption_mode=draw(st.sampled_from(["recompute", "swap", "auto"])),
        watermark=draw(st.sampled_from([0.0, 0.01, 0.1, 0.25])))


configs = st.composite(_config)()


class CoreMachine(RuleBasedStateMachine):
    """Engine + scheduler + block manager + FakeRunner under random traffic, aborts and faults."""

    def __init__(self) -> None:
        super().__init__()
        self.engine: Engine | None = None
        self.seqs: dict[str, _Seq] = {}
        self.parents: dict[str, list[str]] = {}  # request id -> its sequence ids
        self.num_failed_steps = 0

    @initialize(config=configs)
    def build(self, config: SchedulerConfig) -> None:
        runner = FakeRunner(config.num_kv_blocks, config.block_size, config.num_swap_blocks,
                            config.max_model_len)
        self.faults = FaultInjectingRunner(runner)
        self.engine = Engine(self.faults, config, stats_history=8)

    @property
    def _engine(self) -> Engine:
        assert self.engine is not None
        return self.engine

    # ---- rules ---------------------------------------------------------------------------------

    @rule(prompt_len=st.integers(1, 31), max_tokens=st.integers(1, 24), n=st.integers(1, 3),
          priority=st.integers(-2, 2), variant=st.integers(0, 3),
          deadline_ms=st.one_of(st.none(), st.integers(1, 40)), age_ms=st.sampled_from([0, 0, 50]))
    def add(self, prompt_len: int, max_tokens: int, n: int, priority: int, variant: int,
            deadline_ms: int | None, age_ms: int) -> None:
        max_len = self._engine.max_model_len
        prompt_len = min(prompt_len, max_len - 1)
        max_tokens = min(max_tokens, max_len - prompt_len)
        request_id = f"r{len(self.parents)}"
        ids = prompt(variant, prompt_len)  # few variants: shared prefixes exercise the prefix cache
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n, deadline_ms=deadline_ms)
        arrival = CLOCK.now - age_ms / 1e3  # an old arrival: it may be due before its first step
        seq_ids = self._engine.add_request(request_id, ids, params, priority=priority,
                                           arrival_time=arrival)
        self.parents[request_id] = seq_ids
        deadline_time = None if deadline_ms is None else arrival + deadline_ms / 1e3
        for seq_id in seq_ids:
            self.seqs[seq_id] = _Seq(ids, max_tokens, deadline_time)

    @rule(pick=st.integers(0, 10_000))
    def abort(self, pick: int) -> None:
        # Mostly live requests (the interesting places); a finished one must be a no-op.
        live = sorted(p for p, ids in self.parents.items()
                      if any(not self.seqs[s].finishes for s in ids))
        candidates = live if live and pick % 8 else sorted(self.parents)
        if not candidates:
            return
        request_id = candidates[pick % len(candidates)]
        for seq_id in self.parents[request_id]:
            event(f"abort while {self._where(seq_id)}")
        self._record(self._engine.abort_request(request_id))

    @rule(pick=st.integers(0, 10_000))
    def stop_one_sequence(self, pick: int) -> None:
        """The server found a stop string in one sequence's text: that sequence alone finishes."""
        if not self.seqs:
            return
        seq_id = sorted(self.seqs)[pick % len(self.seqs)]
        delta = self._engine.stop_sequence(seq_id, "</s>")
        if delta is not None:
            assert delta.finish_reason == "stop" and delta.stop_reason == "</s>"
            self._record([delta])

    @rule(num_steps=st.integers(1, 6))
    def step(self, num_steps: int) -> None:
        for _ in range(num_steps):
            self._record(self._step())
            self._engine.scheduler.check_invariants()

    @rule()
    def failing_step(self) -> None:
        """The runner raises in one step: that step's requests fail, nobody else."""
        self.faults.inject("step_error")
        deltas = self._step()
        scheduled = set(self._engine.stats[-1].row_request_ids)
        failed = {d.request_id for d in deltas if d.finish_reason == "error"}
        assert failed == {s for s in scheduled if not self._is_padding(s)}
        assert all(d.error for d in deltas if d.finish_reason == "error")
        self._record(deltas)

    def _step(self) -> list[RequestDelta]:
        """One engine step, 1 ms later: every sequence already due ends with "deadline", rowless."""
        CLOCK.now += STEP_S
        due = {seq_id for seq_id, seq in self.seqs.items() if not seq.finishes
               and seq.deadline_time is not None and seq.deadline_time <= CLOCK.now}
        deltas = self._engine.step()
        assert not due & set(self._engine.stats[-1].row_request_ids), "a row past its deadline"
        ended = {d.request_id for d in deltas if d.finish_reason == "deadline"}
        assert due <= ended, f"due but not ended: {sorted(due - ended)}"
        if ended:
            event("deadline")
        return deltas

    @rule()
    def drain(self) -> None:
        """Everything admitted finishes in bounded steps (no livelock), leaving nothing behind."""
        engine = self._engine
        for _ in range(MAX_DRAIN_STEPS):
            if not engine.has_unfinished_requests():
                break
            self._record(self._step())
            engine.scheduler.check_invariants()
        sched = engine.scheduler
        assert not engine.has_unfinished_requests(), (
            f"no progress: waiting={len(sched.waiting)} running={len(sched.running)} "
            f"swapped={len(sched.swapped)} free={sched.block_manager.num_free_blocks}")
        assert sched.block_manager.num_used_blocks == 0, "blocks leaked"
        assert not sched.block_manager.swap_tables, "host blocks leaked"
        assert not engine._unfinished, "the engine still tracks finished requests"
        for seq_id, seq in self.seqs.items():
            assert len(seq.finishes) == 1, f"{seq_id} finished {seq.finishes}"
            if seq.finishes == ["length"]:
                assert seq.tokens == expected(seq.prompt, seq.max_tokens)

    def teardown(self) -> None:
        """Every run ends drained: the final check that nothing is lost, stuck or leaked."""
        if self.engine is not None:
            self.drain()

    # ---- invariants ----------------------------------------------------------------------------

    @invariant()
    def core_invariants(self) -> None:
        if self.engine is None:
            return
        self.engine.scheduler.check_invariants()
        live = self.engine.scheduler.requests
        for seq_id, seq in self.seqs.items():
            assert len(seq.finishes) <= 1, f"{seq_id} finished twice: {seq.finishes}"
            if not seq.finishes:
                assert seq_id in live, f"{seq_id} was lost"
            assert seq.tokens == expected(seq.prompt, len(seq.tokens)), f"{seq_id} wrong tokens"
            assert len(seq.tokens) <= seq.max_tokens

    # ---- helpers -------------------------------------------------------------------------------

    def _record(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            seq = self.seqs[delta.request_id]
            assert not seq.finishes, f"{delta.request_id} got a delta after finishing"
            seq.tokens.extend(delta.new_token_ids)
            if delta.finished:
                seq.finishes.append(delta.finish_reason or "")

    def _where(self, seq_id: str) -> str:
        request = self._engine.scheduler.requests.get(seq_id)
        if request is None or request.is_finished:
            return "finished"
        if request.status == RequestStatus.RUNNING and 0 < request.num_computed_tokens \
                < request.num_prompt_tokens:
            return "mid-chunked-prefill"
        return request.status.name.lower()

    def _is_padding(self, seq_id: str) -> bool:
        request = self._engine.scheduler.requests.get(seq_id)
        return request is not None and request.is_padding


TestCoreStateMachine = CoreMachine.TestCase
TestCoreStateMachine.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# ---- regressions the machine found ------------------------------------------------------------------

def test_a_request_needing_the_whole_pool_is_admitted_despite_the_watermark() -> None:
    """Found by the machine: the admission watermark starved a prompt that needs the whole pool."""
    engine = make_engine(num_kv_blocks=8, block_size=4, max_model_len=32, watermark=0.25,
                         enable_chunked_prefill=False, max_num_batched_tokens=32)
    engine.add_request("whole", prompt(0, 29), params(3))
    out = run(engine, max_steps=50)
    assert tokens_of(out["whole"]) == expected(prompt(0, 29), 3)


def test_a_swapped_request_needing_the_whole_pool_swaps_back_in() -> None:
    """The same starvation on swap-in, which also blocked all admission behind it."""
    engine = make_engine(num_kv_blocks=8, block_size=4, max_model_len=32, watermark=0.25,
                         preemption_mode="swap", num_swap_blocks=8)
    engine.add_request("big", prompt(0, 28), params(4))
    engine.step()  # the prompt: 7 of the 8 blocks
    sched, big = engine.scheduler, engine.scheduler.requests["big"]
    plan = _StepPlan(budget=0, rows=[], swap_out=[], swap_in=[])
    sched._preempt(plan, big)  # as a step short of memory would
    engine.runner.execute(SchedulerOutput(rows=(), blocks_to_swap_out=tuple(plan.swap_out)))
    assert big in sched.swapped and len(sched.block_manager.swap_tables["big"]) == 7
    out = run(engine, max_steps=50)
    assert [t for d in out["big"] for t in d.new_token_ids] == expected(prompt(0, 28), 4)[1:]
