"""`cobatch bench claims`: measure every claim of the seed in one run; write docs/BENCHMARKS.md + plots.

The generated part of BENCHMARKS.md sits between two markers; text outside them is kept, so the
hand-written explanations survive a re-run.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from cobatch.bench.claims_sections import SECTIONS, ClaimsContext, Section
from cobatch.bench.common import write_json
from cobatch.bench.runs import EngineFactory, warm_up
from cobatch.config import EngineConfig

BEGIN = "<!-- BEGIN GENERATED: cobatch bench claims -->"
END = "<!-- END GENERATED: cobatch bench claims -->"


def add_arguments(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument("--output-json", default="docs/img/claims.json")


def engine_config(args: argparse.Namespace) -> EngineConfig:
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
        from cobatch.bench.peers import peers_section

        sections.append(peers_section(ctx))
    return sections


def render(sections: list[Section], command: str, header: str) -> str:
    parts = [BEGIN, header, f"Command: `{command}`"]
    for section in sections:
        parts.append(f"### ({section.key}) {section.title}\n\n{section.markdown}")
    parts.append(END)
    return "\n\n".join(parts) + "\n"


def write_markdown(path: Path, generated: str) -> None:
    """Replace the generated block (or append it), keeping everything else in the file."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    if BEGIN in text and END in text:
        before, rest = text.split(BEGIN, 1)
        after = rest.split(END, 1)[1]
        text = before + generated.rstrip("\n") + after
    else:
        text = text.rstrip("\n") + "\n\n" + generated
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def machine_header(factory: EngineFactory, duration_s: float, quick: bool) -> str:
    import torch

    runner = factory.runner
    dtype = getattr(runner, "dtype", "?")
    return (f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {platform.machine()} with "
            f"{os.cpu_count()} CPU cores ({torch.get_num_threads()} torch threads), torch "
            f"{torch.__version__}, model dtype {dtype}; the whole run took {duration_s / 60:.1f} min."
            + (" **Quick smoke run: tiny workloads, not a result.**" if quick else "")
            + " Every comparison is measured side by side in this one process (the machine is "
              "shared and noisy: read ratios, not absolute numbers).")


def main(args: argparse.Namespace) -> int:
    start = time.monotonic()
    command = "cobatch bench claims " + " ".join(shlex.quote(a) for a in sys.argv[1:]
                                                 if a not in ("bench", "claims"))
    factory = EngineFactory.load(engine_config(args))
    warm_up(factory)
    ctx = ClaimsContext(factory, Path(args.img_dir), scale=0.15 if args.quick else 1.0,
                        tpot_slo_ms=args.tpot_slo_ms)
    ctx.img_dir.mkdir(parents=True, exist_ok=True)
    sections = run_sections(ctx, args.only, args.peers)
    header = machine_header(factory, time.monotonic() - start, args.quick)
    write_markdown(Path(args.output_md), render(sections, command.strip(), header))
    write_json(args.output_json, {s.key: s.data for s in sections})
    print(f"wrote {args.output_md}, {args.output_json} and plots under {args.img_dir}/ "
          f"in {(time.monotonic() - start) / 60:.1f} min")
    return 0
