"""`python -m benchmarks.claims`: measure every claim of the seed in one run; update docs/BENCHMARKS.md + plots."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.claims_report import PROG, base_command, merged_json, render_section, rerun_command, write_markdown
from benchmarks.claims_sections import SECTIONS, ClaimsContext, Section
from cobatch.bench.common import write_json
from cobatch.bench.runs import EngineFactory, warm_up
from cobatch.config import EngineConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The generator's flags."""
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M (GGUF)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--only", default="abcde", help="sections to run, e.g. 'ab' (a always runs "
                        "first when c runs without --tpot-slo-ms: it sets the SLO)")
    parser.add_argument("--tpot-slo-ms", type=float, default=None, help="default: 2 x T(B=1)")
    parser.add_argument("--quick", action="store_true", help="tiny workloads: a smoke run, not a result")
    parser.add_argument("--peers", action="store_true", help="also HF transformers baselines (slow)")
    parser.add_argument("--output-md", default="docs/BENCHMARKS.md")
    parser.add_argument("--img-dir", default="docs/img")
    parser.add_argument("--output-json", default="docs/bench/claims.json")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """One runner for every section."""
    # 2200 blocks x 16 tokens: room for the B=64 x ctx=512 step profile; smaller pools are carved
    # out of it per run (EngineFactory.make(num_kv_blocks=...)).
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, num_kv_blocks=2200,
                        max_model_len=1024, swap_space=0.25, num_threads=args.num_threads)


def run_sections(ctx: ClaimsContext, keys: str, peers: bool) -> list[Section]:
    """Run the chosen sections in order (a first: it sets the SLO the others use)."""
    if "c" in keys and ctx.tpot_slo_ms is None and "a" not in keys:
        keys = "a" + keys
    sections = []
    for key in sorted(set(keys)):
        start = time.monotonic()
        print(f"=== ({key}) {SECTIONS[key].__doc__}", flush=True)
        sections.append(SECTIONS[key](ctx))
        print(sections[-1].markdown, f"\n[{time.monotonic() - start:.0f} s]\n", flush=True)
    if peers:
        from benchmarks.peers import peers_section

        sections.append(peers_section(ctx))
    return sections


def measured_on(factory: EngineFactory, quick: bool) -> str:
    """When and where: date, machine, threads, torch, dtype."""
    import torch

    dtype = getattr(factory.runner, "dtype", "?")
    return (f"{time.strftime('%Y-%m-%d %H:%M')} on {platform.machine()}, {os.cpu_count()} CPU cores "
            f"({torch.get_num_threads()} torch threads), torch {torch.__version__}, model dtype {dtype}"
            + (" (**quick smoke run: tiny workloads, not a result**)" if quick else ""))


def main(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    """Run the chosen sections; rewrite their part of the generated block, the JSON and the plots."""
    start = time.monotonic()
    factory = EngineFactory.load(engine_config(args))
    warm_up(factory)
    ctx = ClaimsContext(factory, Path(args.img_dir), scale=0.15 if args.quick else 1.0,
                        tpot_slo_ms=args.tpot_slo_ms)
    ctx.img_dir.mkdir(parents=True, exist_ok=True)
    sections = run_sections(ctx, args.only, args.peers)
    measured, base = measured_on(factory, args.quick), base_command(argv)
    write_markdown(Path(args.output_md), {
        s.key: render_section(s.key, s.title, s.markdown, measured, rerun_command(base, s.key))
        for s in sections})
    write_json(args.output_json, merged_json(Path(args.output_json), {s.key: s.data for s in sections}))
    print(f"wrote {args.output_md}, {args.output_json} and plots under {args.img_dir}/ "
          f"in {(time.monotonic() - start) / 60:.1f} min")
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    add_arguments(parser)
    return main(parser.parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(cli())
