"""The bench CLI parses its sub-commands (and only the ones users run); bench results are written as JSON."""

from __future__ import annotations

import argparse

from cobatch.bench.cli import COMMANDS, add_bench_arguments


def test_every_bench_command_parses() -> None:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(["offline", "--compare", "--workload", "chat", "--num-prompts", "4"])
    assert args.bench_command == "offline" and args.compare and args.num_prompts == 4
    args = parser.parse_args(["serve", "--base-url", "http://x", "--goodput", "ttft:500", "tpot:50"])
    assert args.goodput == ["ttft:500", "tpot:50"] and args.request_rate == float("inf")
    args = parser.parse_args(["steps", "--tpot-slo-ms", "50", "--contexts", "128"])
    assert args.tpot_slo_ms == 50.0
    assert parser.parse_args(["timeline"]).bench_command == "timeline"
    assert set(COMMANDS) == {"offline", "serve", "steps", "roofline", "timeline"}  # claims, peers: benchmarks/


def test_offline_writes_its_result_json(tmp_path) -> None:
    """`bench offline --output-json` (a real run on the default model, tiny workload): the file holds the
    options it ran with and the run's figures."""
    import json

    from cobatch.cli import main

    path = tmp_path / "offline.json"
    assert main(["bench", "offline", "--num-prompts", "2", "--input-len", "8", "--output-len", "3",
                 "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "1024",
                 "--output-json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["config"]["num_prompts"] == 2 and "func" not in data["config"]
    assert data["result"]["num_requests"] == 2 and data["result"]["num_output_tokens"] == 6
