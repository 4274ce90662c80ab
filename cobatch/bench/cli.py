"""`cobatch bench ...`: the benchmark sub-commands (also runnable as `python -m cobatch.bench.cli`).

The sub-command modules import no torch at module level; only the engine-driving ones load a model, when run.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# sub-command -> (module under cobatch.bench, help)
COMMANDS: dict[str, tuple[str, str]] = {
    "offline": ("offline", "engine throughput on a workload; static vs continuous (--compare)"),
    "serve": ("serve", "HTTP load generator for any OpenAI-compatible server"),
    "steps": ("steps", "decode step time vs batch size and context; T(B, ctx) fit"),
    "roofline": ("roofline", "decode tokens/s as a share of this machine's roofline for the weights"),
    "timeline": ("timeline_cli", "the metro plot: batch rows over time, static vs continuous"),
}
# The repository's report generators (docs/BENCHMARKS.md, peers) live in benchmarks/, not here.


def _module(command: str) -> object:
    return importlib.import_module(f"cobatch.bench.{COMMANDS[command][0]}")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the bench sub-commands to `parser` (the `cobatch bench` parser)."""
    sub = parser.add_subparsers(dest="bench_command", required=True)
    for command, (_, help_text) in COMMANDS.items():
        child = sub.add_parser(command, help=help_text, description=help_text)
        _module(command).add_arguments(child)  # type: ignore[attr-defined]


def run_bench(args: argparse.Namespace) -> int:
    """Run the chosen sub-command."""
    return int(_module(args.bench_command).main(args))  # type: ignore[attr-defined]


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point."""
    parser = argparse.ArgumentParser(prog="cobatch bench")
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
