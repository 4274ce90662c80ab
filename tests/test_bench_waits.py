"""The wait and preemption summaries of `bench offline` (from the engine's StepStats) and `bench serve`
(from a cobatch server's /metrics, scraped before and after; nothing for another server)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cobatch.bench import serve
from cobatch.bench.datasets import BenchRequest
from cobatch.bench.offline import print_wait_summary, wait_summary
from cobatch.bench.runs import EngineFactory, run_workload
from cobatch.config import EngineConfig
from tests.fakes import FakeRunner

EXPOSITION = """# HELP cobatch:request_wait_steps_total Steps a live sequence spent without a row, by reason.
# TYPE cobatch:request_wait_steps_total counter
cobatch:request_wait_steps_total{model_name="m",replica="a",reason="kv_blocks"} 30.0
cobatch:request_wait_steps_total{model_name="m",replica="b",reason="kv_blocks"} 12.0
cobatch:request_wait_steps_total{model_name="m",replica="a",reason="max_num_seqs"} 5.0
cobatch:num_preemptions_by_mode_total{model_name="m",replica="a",mode="swap"} 2.0
"""


def test_offline_summary_counts_the_runs_waits_and_preemptions(capsys: pytest.CaptureFixture[str]) -> None:
    runner = FakeRunner(num_kv_blocks=8, block_size=4, num_swap_blocks=8, max_model_len=32)
    factory = EngineFactory(runner, EngineConfig(block_size=4, max_num_seqs=3, preemption_mode="auto"))
    requests = [BenchRequest(14 + i, prompt_token_ids=tuple(range(3 + i, 11 + 2 * i))) for i in range(4)]
    engine = factory.make()
    result = run_workload(engine, requests)
    summary = wait_summary(result)
    assert sum(summary["preemptions_by_mode"].values()) == result.num_preemptions > 0
    assert summary["wait_steps"] and all(n > 0 for n in summary["wait_steps"].values())
    print_wait_summary(result)
    out = capsys.readouterr().out
    assert "waits (sequence-steps without a row)" in out and "preemptions by mode" in out


def scraped(monkeypatch: pytest.MonkeyPatch, text: str) -> dict | None:
    monkeypatch.setattr(serve.httpx, "get", lambda url, timeout: SimpleNamespace(text=text))
    return serve.scrape_counters("http://server")


def test_serve_reads_a_cobatch_servers_counters_summed_over_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    after = scraped(monkeypatch, EXPOSITION)
    assert after == {"waits": {"kv_blocks": 42.0, "max_num_seqs": 5.0}, "preemptions_by_mode": {"swap": 2.0}}
    before = {"waits": {"kv_blocks": 40.0, "max_num_seqs": 5.0}, "preemptions_by_mode": {}}
    during = serve.counters_during(before, after)
    assert during == {"waits": {"kv_blocks": 2.0}, "preemptions_by_mode": {"swap": 2.0}}
    lines = serve.format_server_counters(during)
    assert lines[0].endswith("kv_blocks 2 (100%)") and lines[1].endswith("swap 2")


def test_serve_prints_nothing_for_another_server(monkeypatch: pytest.MonkeyPatch) -> None:
    assert scraped(monkeypatch, "# vllm:num_requests_running 0\n") is None
    assert serve.counters_during(None, None) is None
