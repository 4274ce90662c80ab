"""N-gram speculative decoding against plain decoding, alternating in one process (the host is noisy):
useful tokens/s, drafts and accepted drafts (that the outputs are identical is for the tests).

Workloads: `mixed64` (issue 5's: random-token prompts, which a 135M model continues with loops) and
`chat` (32 chat-templated questions answered in up to 200 tokens: natural text, where n-gram matches
mislead about half the time), each at several max_num_seqs.

    .venv/bin/python -m benchmarks.spec_decode_ab [--num-speculative-tokens 3] [--repeats 2]
        [--output-json docs/bench/spec_decode.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace

from cobatch.bench.datasets import BenchRequest, preset, synthesize
from cobatch.bench.runs import EngineFactory, run_workload, warm_up
from cobatch.config import EngineConfig
from cobatch.tokenizer import Tokenizer

QUESTIONS = ["Explain how a refrigerator works.", "Write a short poem about the sea.",
             "What are the benefits of exercise?", "Summarize the plot of Romeo and Juliet.",
             "How do I make a cup of tea?", "Why is the sky blue?",
             "Give me three tips for learning a new language.", "What is photosynthesis?"]


def chat_requests() -> list[BenchRequest]:
    tokenizer = Tokenizer.load(None)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS * 4]
    return [BenchRequest(200, prompt_token_ids=tuple(tokenizer.apply_chat_template(c))) for c in conversations]


def run_once(factory: EngineFactory, requests: list[BenchRequest], max_num_seqs: int) -> dict:
    """One run: tokens/s, drafts, accepted drafts, steps."""
    engine = factory.make(max_num_seqs=max_num_seqs)
    result = run_workload(engine, requests)
    scheduler = engine.scheduler
    return {"tokens_per_s": result.tokens_per_s, "num_draft_tokens": scheduler.num_draft_tokens_total,
            "num_accepted_tokens": scheduler.num_accepted_tokens_total, "num_steps": engine.num_steps}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.spec_decode_ab", description=__doc__.splitlines()[0])
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    config = EngineConfig(dtype="bfloat16", max_num_seqs=64, max_model_len=1024)
    plain = EngineFactory.load(config)
    speculative = EngineFactory(plain.runner, replace(config, num_speculative_tokens=args.num_speculative_tokens))
    warm_up(plain)
    workloads = {"mixed64": (synthesize(preset("mixed64")), (64, 4, 1)), "chat": (chat_requests(), (32, 4))}
    rows = []
    for name, (requests, batch_sizes) in workloads.items():
        for max_num_seqs in batch_sizes:  # one request at a time: its 4 first long ones keep it short
            reqs = [r for r in requests if r.max_tokens >= 128][:4] if max_num_seqs == 1 else requests
            runs = {"plain": [], "speculative": []}
            for _ in range(args.repeats):
                for label, factory in (("plain", plain), ("speculative", speculative)):
                    runs[label].append(run_once(factory, reqs, max_num_seqs))
            p, s = (statistics.median(r["tokens_per_s"] for r in runs[k]) for k in ("plain", "speculative"))
            last = runs["speculative"][-1]
            rows.append({"workload": name, "max_num_seqs": max_num_seqs, "num_requests": len(reqs),
                         "plain_tokens_per_s": p, "speculative_tokens_per_s": s, "speedup": s / p,
                         "num_draft_tokens": last["num_draft_tokens"],
                         "num_accepted_tokens": last["num_accepted_tokens"]})
            r = rows[-1]
            print(f"{name:8s} max_num_seqs={max_num_seqs:3d}: plain {p:6.1f} tok/s, speculative {s:6.1f} "
                  f"({s / p:.2f}x); drafts {r['num_draft_tokens']}, accepted {r['num_accepted_tokens']} "
                  f"({r['num_accepted_tokens'] / max(1, r['num_draft_tokens']):.0%})", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"num_speculative_tokens": args.num_speculative_tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
