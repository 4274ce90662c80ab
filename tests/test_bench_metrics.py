"""Benchmark metric math on hand-made timings, workloads, and the offline driver on the fake runner."""

from __future__ import annotations

import math

import pytest

from cobatch.bench.datasets import (BenchRequest, LengthSpec, load_jsonl, output_length_cv, preset,
                                    synthesize, write_jsonl)
from cobatch.bench.metrics import (RequestTiming, Slo, itl, meets_slo, parse_slo, percentile,
                                   summarize_run, tpot)
from cobatch.bench.runs import EngineFactory, run_workload
from cobatch.bench.timeline import padding_share, seat_spans
from cobatch.config import EngineConfig
from tests.fakes import FakeRunner


def timing(start: float, times: list[float], n: int | None = None) -> RequestTiming:
    return RequestTiming(start, list(times), num_output_tokens=len(times) if n is None else n)


def test_percentile_interpolates_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_ttft_tpot_itl_e2e_on_a_hand_made_request() -> None:
    t = timing(10.0, [10.5, 10.6, 10.8, 11.1])  # 4 tokens
    assert t.ttft_s == pytest.approx(0.5)
    assert t.e2e_s == pytest.approx(1.1)
    assert t.tpot_s == pytest.approx((1.1 - 0.5) / 3)
    assert t.itl_s == pytest.approx([0.1, 0.2, 0.3])


def test_tpot_counts_tokens_not_chunks() -> None:
    # Two SSE chunks carrying 5 tokens: TPOT divides by tokens - 1, ITL has one gap.
    t = timing(0.0, [1.0, 2.0], n=5)
    assert t.tpot_s == pytest.approx(0.25)
    assert itl(t.token_times_s) == [1.0]


def test_tpot_is_undefined_for_one_token() -> None:
    assert tpot(1.0, 1.0, 1) is None
    assert timing(0.0, [0.3]).tpot_s is None


def test_goodput_counts_only_requests_meeting_every_slo() -> None:
    fast = timing(0.0, [0.1, 0.15, 0.2])  # ttft 100 ms, tpot 50 ms
    slow_first = timing(0.0, [0.9, 0.95, 1.0])  # ttft 900 ms
    slow_tokens = timing(0.0, [0.1, 0.5, 0.9])  # tpot 400 ms
    failed = RequestTiming(0.0, success=False, error="boom")
    slo = parse_slo(["ttft:500", "tpot:100"])
    assert slo == Slo(ttft_ms=500.0, tpot_ms=100.0)
    assert [meets_slo(t, slo) for t in (fast, slow_first, slow_tokens, failed)] == [True, False, False, False]
    report = summarize_run([fast, slow_first, slow_tokens, failed], duration_s=2.0, slo=slo)
    assert report["completed"] == 3 and report["failed"] == 1
    assert report["good_requests"] == 1 and report["goodput"] == 0.5
    assert report["output_throughput"] == 4.5
    assert report["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert report["e2el_ms"]["mean"] == pytest.approx((200 + 1000 + 900) / 3)


def test_parse_slo_rejects_nonsense() -> None:
    for bad in (["ttft"], ["latency:5"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_length_specs_split_evenly_between_ranges() -> None:
    spec = LengthSpec.parse("8-32,128-256")
    import random

    lengths = spec.sample(64, random.Random(0))
    assert sum(1 for x in lengths if 8 <= x <= 32) == 32
    assert sum(1 for x in lengths if 128 <= x <= 256) == 32
    assert str(spec) == "8-32,128-256" and LengthSpec.parse("7").ranges == ((7, 7),)
    with pytest.raises(ValueError):
        LengthSpec.parse("9-3")


def test_workloads_are_seeded_and_variance_ordered(tmp_path) -> None:
    mixed = synthesize(preset("mixed64"))
    assert mixed == synthesize(preset("mixed64"))
    assert len(mixed) == 64 and all(64 <= r.num_prompt_tokens <= 256 for r in mixed)
    assert output_length_cv(mixed) > output_length_cv(synthesize(preset("classify")))
    text = synthesize(preset("chat").with_overrides(num_requests=3, input_len="10"), as_text=True)
    assert all(r.prompt and r.num_prompt_tokens == 10 for r in text)
    path = tmp_path / "w.jsonl"
    write_jsonl(mixed[:3] + text, path)
    assert load_jsonl(path) == mixed[:3] + text


def test_offline_run_on_the_fake_runner_counts_useful_tokens_and_padding() -> None:
    runner = FakeRunner(64, 4, max_model_len=64)
    factory = EngineFactory(runner, EngineConfig(block_size=4, max_num_seqs=4, max_model_len=64))
    requests = [BenchRequest(n, prompt_token_ids=tuple(range(3, 8))) for n in (2, 2, 2, 20)]
    static = run_workload(factory.make(batching="static"), requests)
    continuous = run_workload(factory.make(batching="continuous"), requests)
    for result in (static, continuous):
        assert result.num_output_tokens == 26 and all(t.success for t in result.timings)
    assert padding_share(static) > 0.5 and padding_share(continuous) == 0.0
    padded = [s for s in seat_spans(static) if s.is_padding]
    assert {s.request_id for s in padded} == {"r0", "r1", "r2"}
    assert {s.seat for s in seat_spans(static)} == {0, 1, 2, 3}
