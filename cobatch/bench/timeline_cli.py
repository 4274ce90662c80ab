"""`cobatch bench timeline`: the metro plot of static vs continuous batching on one workload."""

from __future__ import annotations

import argparse

from cobatch.bench import offline, timeline
from cobatch.bench.common import add_workload_arguments, workload_from_args
from cobatch.bench.runs import EngineFactory, warm_up
from cobatch.config_cli import add_engine_args, engine_config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # A small workload: a picture you can read in under a minute (with --max-num-seqs 6: a few rows).
    add_engine_args(parser)
    add_workload_arguments(parser, default="mixed64")
    parser.set_defaults(num_prompts=18, input_len="16-64", output_len="4-16,48-64")
    parser.add_argument("--plot", default="timeline.png")


def main(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)
    requests = offline.tokenize_text_prompts(workload_from_args(args), args.model)
    factory = EngineFactory.load(config)
    warm_up(factory)
    report = offline.compare(factory, requests, config.max_num_seqs)
    for result in report["_last"]:
        offline.print_run(result)
    print(f"continuous / static: {report['ratio']:.2f}x; "
          f"static padding row-steps: {100 * report['padding_share_static']:.0f}%")
    print(f"wrote {timeline.plot_timeline(list(report['_last']), args.plot)}")
    return 0
