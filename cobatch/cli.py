"""`cobatch` command line: serve, generate, chat, bench."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import asdict

from cobatch.config_cli import add_engine_args, engine_config_from_args


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """Sampling flags of generate and chat (the engine's --seed seeds the sampler)."""
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)


def _llm(args: argparse.Namespace):
    from cobatch.llm import LLM

    return LLM(**asdict(engine_config_from_args(args)))


def _sampling(args: argparse.Namespace):
    from cobatch.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k)


def run_generate(args: argparse.Namespace) -> int:
    """Generate completions for the prompts given (or a short demo) and print them."""
    prompts = args.prompts or ["The capital of France is", "Continuous batching means",
                               "def fibonacci(n):"]
    llm = _llm(args)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], _sampling(args)) \
        if args.chat_template else llm.generate(prompts, _sampling(args))
    for prompt, output in zip(prompts, outputs):
        print(f"--- {prompt!r}\n{output.outputs[0].text}\n[{output.outputs[0].finish_reason}]")
    print(llm.summary())
    return 0


def run_chat(args: argparse.Namespace) -> int:
    """Interactive chat in the terminal; the conversation is kept; empty line or Ctrl-D quits."""
    llm = _llm(args)
    params = _sampling(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line:
            return 0
        messages.append({"role": "user", "content": line})
        reply = llm.chat([messages], params, use_tqdm=False)[0].outputs[0].text
        print(f"assistant> {reply}")
        messages.append({"role": "assistant", "content": reply})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cobatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    from cobatch.server.cli import add_serve_arguments, run_serve

    add_serve_arguments(serve)
    serve.set_defaults(func=run_serve)

    gen = sub.add_parser("generate", help="offline generation for a few prompts")
    gen.add_argument("prompts", nargs="*")
    gen.add_argument("--chat-template", action="store_true", help="wrap prompts as user messages")
    add_engine_args(gen)
    add_sampling_arguments(gen)
    gen.set_defaults(func=run_generate)

    chat = sub.add_parser("chat", help="interactive chat with the model")
    chat.add_argument("--system", default=None)
    add_engine_args(chat)
    add_sampling_arguments(chat)
    chat.set_defaults(func=run_chat, max_tokens=256)

    bench = sub.add_parser("bench", help="benchmarks: offline, serve, steps, roofline, timeline")
    from cobatch.bench.cli import add_bench_arguments, run_bench

    add_bench_arguments(bench)
    bench.set_defaults(func=run_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
