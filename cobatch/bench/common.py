"""Command-line pieces shared by the engine-driving benchmarks (offline, steps, timeline, claims)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from cobatch.bench.datasets import BenchRequest, load_jsonl, preset, synthesize
from cobatch.config import EngineConfig


def add_engine_arguments(parser: argparse.ArgumentParser, max_num_seqs: int = 16,
                         max_model_len: int = 1024) -> None:
    """Model and engine flags (vLLM's names)."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None, help="HF folder or GGUF file (default: SmolLM2-135M)")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    group.add_argument("--device", default="auto")
    group.add_argument("--max-num-seqs", type=int, default=max_num_seqs)
    group.add_argument("--max-model-len", type=int, default=max_model_len)
    group.add_argument("--num-kv-blocks", type=int, default=None,
                       help="KV pool size in blocks (default: the runner's memory-based size)")
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--max-num-batched-tokens", type=int, default=None)
    group.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    group.add_argument("--swap-space", type=float, default=0.5, help="GiB of host memory for swap")
    group.add_argument("--num-threads", type=int, default=None)
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--num-speculative-tokens", type=int, default=0,
                       help="n-gram speculative decoding: draft tokens per greedy row (0: off)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the flags describe."""
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        preemption_mode=args.preemption_mode, swap_space=args.swap_space,
        num_threads=args.num_threads, seed=args.seed, num_speculative_tokens=args.num_speculative_tokens)


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
