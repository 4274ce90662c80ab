"""The cost of structured outputs on a batch, and the TTFT of a schema compiled fresh vs from the cache.

One process, the default model, the offline engine (LLM): 64 requests at once, all unconstrained, then
the same 64 with half of them constrained by a JSON schema (greedy; the unconstrained ones run to
max_tokens, the constrained ones until their JSON is complete), alternating for --repeats rounds, so
both see the same host; generated tokens per second of wall time and the mean step time of each. Then,
with nothing else running, time to first token of a request whose schema is new (compiled then) and of
the same schema again (from the cache), --ttft-repeats times each.

    .venv/bin/python -m benchmarks.structured_outputs [--repeats 3] [--num-requests 64] [--num-threads N]
        [--output-json docs/bench/structured_outputs.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from cobatch import LLM, SamplingParams
from cobatch.sampling_params import StructuredOutputsParams

NUM_REQUESTS, MAX_TOKENS = 64, 48
SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
    "required": ["name", "age", "role", "tags"], "additionalProperties": False}
PROMPTS = ["Describe a user of a web shop as JSON.", "Write a short story about a cat.",
           "A JSON profile of a guest:", "Explain why the sky is blue."]


def batch_params(constrained: bool, num_requests: int = NUM_REQUESTS) -> list[SamplingParams]:
    """num_requests requests; with `constrained`, every other one follows SCHEMA."""
    free = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    schema = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS * 2,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    return [schema if constrained and i % 2 else free for i in range(num_requests)]


def run_batch(llm: LLM, constrained: bool, num_requests: int) -> dict[str, float]:
    """Tokens/s and mean step ms of one batch."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(num_requests)]
    first_step = llm.engine.num_steps
    start = time.perf_counter()
    outputs = llm.generate(prompts, batch_params(constrained, num_requests), use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    steps = list(llm.engine.stats)[-(llm.engine.num_steps - first_step):]
    return {"tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
            "mean_step_ms": round(1e3 * statistics.mean(s.duration_s for s in steps), 2),
            "num_steps": len(steps)}


def ttft_s(llm: LLM, schema: dict[str, Any], request_id: str) -> float:
    """Seconds from add_request to the first generated token, the engine running nothing else."""
    params = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=StructuredOutputsParams(json=schema))
    start = time.perf_counter()
    llm.engine.add_request(request_id, llm.tokenizer.encode("A user as JSON:"), params)
    first = None
    while llm.engine.has_unfinished_requests():
        for delta in llm.engine.step():
            if first is None and delta.new_token_ids:
                first = time.perf_counter() - start
    assert first is not None
    return first


def measure_ttft(llm: LLM, repeats: int) -> dict[str, Any]:
    """TTFT of a new schema (a distinct property name each time: a cache miss) vs the same schema again."""
    new, cached = [], []
    for i in range(repeats):
        schema = json.loads(json.dumps(SCHEMA))
        schema["properties"][f"field_{i}_{time.time_ns()}"] = {"type": "boolean"}
        new.append(ttft_s(llm, schema, f"new-{i}"))
        cached.append(ttft_s(llm, schema, f"cached-{i}"))
    return {"new_schema_ms": [round(1e3 * s, 1) for s in new], "cached_schema_ms": [round(1e3 * s, 1) for s in cached],
            "median_new_ms": round(1e3 * statistics.median(new), 1),
            "median_cached_ms": round(1e3 * statistics.median(cached), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    parser.add_argument("--ttft-repeats", type=int, default=5)
    parser.add_argument("--num-threads", type=int, default=0, help="torch threads (0: the engine's default)")
    parser.add_argument("--output-json", type=Path, default=Path("docs/bench/structured_outputs.json"))
    args = parser.parse_args()
    load_before = os.getloadavg()
    llm = LLM(max_model_len=512, **({"num_threads": args.num_threads} if args.num_threads else {}))
    llm.generate(PROMPTS[:2], batch_params(True)[:2], use_tqdm=False)  # warm: the backend, the schema
    rounds: dict[str, list[dict[str, float]]] = {"unconstrained": [], "half_constrained": []}
    for _ in range(args.repeats):
        rounds["unconstrained"].append(run_batch(llm, False, args.num_requests))
        rounds["half_constrained"].append(run_batch(llm, True, args.num_requests))
        print(json.dumps({k: v[-1] for k, v in rounds.items()}))
    summary = {k: {"median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in v),
                   "median_step_ms": statistics.median(r["mean_step_ms"] for r in v)} for k, v in rounds.items()}
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "load_before": load_before,
              "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPUs",
              "num_requests": args.num_requests, "max_tokens": MAX_TOKENS, "schema": SCHEMA, "rounds": rounds,
              "summary": summary, "ttft": measure_ttft(llm, args.ttft_repeats)}
    print(json.dumps({"summary": summary, "ttft": report["ttft"]}, indent=1))
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
