"""The claims report keeps hand-written text around its generated block; the bench CLI parses; bench
results are written as JSON."""

from __future__ import annotations

import argparse

from cobatch.bench.claims import BEGIN, END, render, write_markdown
from cobatch.bench.claims_sections import Section
from cobatch.bench.cli import add_bench_arguments


def test_generated_block_is_replaced_and_hand_written_text_survives(tmp_path) -> None:
    path = tmp_path / "BENCHMARKS.md"
    write_markdown(path, render([Section("a", "First", "| x |")], "cobatch bench claims", "run 1"))
    text = path.read_text()
    assert text.startswith("# Benchmarks") and BEGIN in text and "run 1" in text
    path.write_text("# Benchmarks\n\nHand-written intro.\n\n" + text.split("# Benchmarks\n\n", 1)[1]
                    + "\nHand-written outro.\n")
    write_markdown(path, render([Section("a", "First", "| y |")], "cobatch bench claims", "run 2"))
    text = path.read_text()
    assert "Hand-written intro." in text and "Hand-written outro." in text
    assert "run 2" in text and "run 1" not in text and "| y |" in text
    assert text.count(BEGIN) == 1 and text.count(END) == 1


def test_every_bench_command_parses() -> None:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(["offline", "--compare", "--workload", "chat", "--num-prompts", "4"])
    assert args.bench_command == "offline" and args.compare and args.num_prompts == 4
    args = parser.parse_args(["serve", "--base-url", "http://x", "--goodput", "ttft:500", "tpot:50"])
    assert args.goodput == ["ttft:500", "tpot:50"] and args.request_rate == float("inf")
    args = parser.parse_args(["steps", "--tpot-slo-ms", "50", "--contexts", "128"])
    assert args.tpot_slo_ms == 50.0
    for command in ("timeline", "claims", "peers"):
        assert parser.parse_args([command]).bench_command == command


def test_offline_writes_its_result_json(tmp_path) -> None:
    """`bench offline --output-json` (a real run on the default model, tiny workload): the file holds the
    options it ran with and the run's figures."""
    import json

    from cobatch.cli import main

    path = tmp_path / "offline.json"
    assert main(["bench", "offline", "--num-prompts", "2", "--input-len", "8", "--output-len", "3",
                 "--dtype", "float32", "--num-kv-blocks", "64", "--output-json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["config"]["num_prompts"] == 2 and "func" not in data["config"]
    assert data["result"]["num_requests"] == 2 and data["result"]["num_output_tokens"] == 6
