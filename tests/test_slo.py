"""The TPOT-SLO-bounded batch: a fake cost model, the fake runner, invariants after every step."""

from __future__ import annotations

from cobatch.config import SchedulerConfig
from cobatch.engine import Engine, StepStats
from cobatch.sampling_params import SamplingParams
from cobatch.slo import SLO_HEADROOM
from tests.fakes import FakeRunner
from tests.test_scheduler import expected, prompt, run, tokens_of


def linear_cost(rows: int, tokens: int, context: int) -> float:
    """A fake step-time model: 10 ms + 4 ms a row + 0.5 ms a token + 0.01 ms a context token."""
    return 0.010 + 0.004 * rows + 0.0005 * tokens + 0.00001 * context


def slo_engine(tpot_slo_ms: float, predictor=linear_cost, **kw: object) -> Engine:
    config = SchedulerConfig(num_kv_blocks=256, block_size=4, max_model_len=128,
                             tpot_slo_ms=tpot_slo_ms, **kw)
    engine = Engine(FakeRunner(256, 4, max_model_len=128), config)
    engine.scheduler.step_time_predictor = predictor
    return engine


def shape(stat: StepStats) -> tuple[int, int, int]:
    tokens = stat.num_prefill_tokens + stat.num_decode_tokens + stat.num_padding_rows
    return stat.num_rows, tokens, stat.num_context_tokens


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_every_step_with_decode_rows_stays_under_the_slo_and_outputs_are_exact() -> None:
    slo_ms = 60.0
    engine = slo_engine(slo_ms)
    specs = [(40 + 7 * i % 30, 5 + 11 * i % 40) for i in range(20)]  # long prompts: chunking matters
    for i, (plen, n) in enumerate(specs):
        engine.add_request(f"r{i}", prompt(i, plen), params(n))
    out = run(engine)
    for i, (plen, n) in enumerate(specs):
        assert tokens_of(out[f"r{i}"]) == expected(prompt(i, plen), n)
    decode_steps = [s for s in engine.stats if s.num_decode_tokens > 0]
    assert decode_steps, "the workload decodes"
    for stat in decode_steps:
        assert linear_cost(*shape(stat)) <= slo_ms / 1000 * SLO_HEADROOM + 1e-12, stat
    # The cap is not trivially small: the batch grows to what the SLO allows.
    assert max(s.num_decode_tokens for s in engine.stats) >= 5


def test_prefill_is_chunked_into_the_slack_instead_of_stalling_decodes() -> None:
    engine = slo_engine(40.0)
    engine.add_request("a", prompt(0, 8), params(30))
    for _ in range(3):
        engine.step()  # a is decoding now
    engine.add_request("b", prompt(1, 100), params(2))
    engine.step()
    stat = engine.stats[-1]
    # Slack: 36 ms - (10 + 4*2 + 0.5*1 + ctx) leaves room for ~30 prefill tokens, not 100.
    assert stat.num_decode_tokens == 1 and 0 < stat.num_prefill_tokens < 100
    assert linear_cost(*shape(stat)) <= 0.040 * SLO_HEADROOM
    run(engine)


def test_admission_checks_the_all_decoding_batch_not_just_this_step() -> None:
    engine = slo_engine(50.0, predictor=lambda rows, tokens, ctx: 0.010 + 0.008 * rows)
    for i in range(10):
        engine.add_request(f"r{i}", prompt(i, 3), params(6))
    run(engine)
    # 10 + 8 * 4 = 42 <= 45 < 50 = 10 + 8 * 5: four seats, whatever the prefill shapes were.
    assert max(s.num_rows for s in engine.stats) == 4


def test_slow_start_admits_one_request_a_step_until_the_model_predicts() -> None:
    engine = slo_engine(50.0, predictor=lambda rows, tokens, ctx: 0.0)
    for i in range(6):
        engine.add_request(f"r{i}", prompt(i, 3), params(20))
    for expected_running in range(1, 7):
        engine.step()
        assert len(engine.scheduler.running) == expected_running
    run(engine)


def test_an_engine_with_nothing_running_always_admits_its_first_request() -> None:
    engine = slo_engine(1.0)  # every prediction breaks a 1 ms SLO
    for i in range(3):
        engine.add_request(f"r{i}", prompt(i, 5), params(4))
    out = run(engine)
    assert sorted(out) == ["r0", "r1", "r2"]
    assert max(s.num_rows for s in engine.stats) == 1  # one at a time, but everyone finishes


def test_without_chunked_prefill_a_prompt_waits_for_room_for_all_of_it() -> None:
    engine = slo_engine(40.0, enable_chunked_prefill=False, max_num_batched_tokens=128)
    engine.add_request("a", prompt(0, 8), params(30))
    for _ in range(3):
        engine.step()
    engine.add_request("b", prompt(1, 100), params(2))
    engine.step()
    assert engine.stats[-1].num_prefill_tokens == 0  # 100 tokens do not fit the slack: b waits
    out = run(engine)
    assert tokens_of(out["b"]) == expected(prompt(1, 100), 2)


def test_without_an_slo_nothing_is_capped() -> None:
    config = SchedulerConfig(num_kv_blocks=256, block_size=4, max_model_len=128)
    engine = Engine(FakeRunner(256, 4, max_model_len=128), config)
    for i in range(10):
        engine.add_request(f"r{i}", prompt(i, 30), params(5))
    engine.step()
    assert len(engine.scheduler.running) == 10
    assert engine.scheduler.num_slo_capped_steps == 0
    run(engine)
