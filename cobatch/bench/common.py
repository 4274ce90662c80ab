"""Workload flags and result files shared by the benchmarks; no engine import (`bench serve` uses them).

The engine flags come from `cobatch.config_cli`, derived from EngineConfig's fields.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from cobatch.bench.datasets import BenchRequest, load_jsonl, preset, synthesize


def add_workload_arguments(parser: argparse.ArgumentParser, default: str = "mixed64") -> None:
    """Workload flags: a preset, overridden by explicit lengths/counts, or a JSONL file."""
    group = parser.add_argument_group("workload")
    group.add_argument("--workload", default=default, help="preset: chat, classify, mixed64")
    group.add_argument("--dataset", default=None,
                       help="JSONL of {prompt | prompt_token_ids, max_tokens} (overrides --workload)")
    group.add_argument("--num-prompts", type=int, default=None)
    group.add_argument("--input-len", default=None, help="e.g. 128, 64-256 or 8-32,128-256")
    group.add_argument("--output-len", default=None, help="e.g. 128, 16-384 or 8-32,128-256")
    group.add_argument("--workload-seed", type=int, default=0)


def workload_from_args(args: argparse.Namespace, as_text: bool = False) -> list[BenchRequest]:
    """The requests the workload flags describe."""
    if args.dataset:
        requests = load_jsonl(args.dataset)
        return requests[:args.num_prompts] if args.num_prompts else requests
    spec = preset(args.workload).with_overrides(args.num_prompts, args.input_len, args.output_len,
                                                args.workload_seed)
    return synthesize(spec, as_text=as_text)


def settings(args: argparse.Namespace) -> dict[str, object]:
    """The command line's options for a result file: the subcommand's handler (`func`) left out."""
    return {name: value for name, value in vars(args).items() if not callable(value)}


def write_json(path: str | Path, data: object) -> Path:
    """Pretty JSON; NaN written as null so every JSON reader accepts it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_nan_to_none(data), indent=2) + "\n")
    return path


def _nan_to_none(value: object) -> object:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nan_to_none(v) for v in value]
    return value
