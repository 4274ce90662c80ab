"""`python -m benchmarks.peers`: HF transformers static `generate` and HF continuous batching vs cobatch.

Same model weights (loaded by transformers from the same GGUF/folder), same dtype, same workload,
greedy, ignore EOS, per-request output lengths; reported as ratios against cobatch measured in the same
process. Optional extra: `pip install .[peers]` (accelerate). A peer that fails to run is reported as
failed with its error, not hidden.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from benchmarks.claims_sections import ClaimsContext, Section, markdown_table
from cobatch.bench.common import add_workload_arguments, workload_from_args
from cobatch.bench.datasets import BenchRequest
from cobatch.bench.runs import EngineFactory, run_workload, warm_up
from cobatch.config_cli import add_engine_args, engine_config_from_args


def load_hf_model(model: str | None, dtype: object) -> object:
    """The HF reference model on the same weights (GGUF via transformers' gguf_file)."""
    from transformers import AutoModelForCausalLM

    from cobatch.model_paths import is_gguf, resolve_model_path

    path = resolve_model_path(model)
    if is_gguf(path):
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return hf.eval()


def hf_static(hf: object, requests: list[BenchRequest], batch_size: int) -> float:
    """Useful tokens/s of left-padded batches that each run to their longest member."""
    import torch

    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(r.prompt_token_ids or ()) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, r in enumerate(batch):
            prompt = torch.tensor(r.prompt_token_ids or ())
            ids[row, width - len(prompt):] = prompt
            mask[row, width - len(prompt):] = 1
        longest = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                        min_new_tokens=longest, do_sample=False, pad_token_id=0)
    return sum(r.max_tokens for r in requests) / (time.perf_counter() - start)


def hf_continuous(hf: object, requests: list[BenchRequest], max_num_seqs: int) -> float:
    """Useful tokens/s of transformers' continuous batching manager (per-request max_new_tokens)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=max(r.max_tokens
                                                                                      for r in requests))
    cb = ContinuousBatchingConfig(max_requests_per_batch=max_num_seqs, block_size=16, num_blocks=2048)
    manager = hf.init_continuous_batching(generation_config=config, continuous_batching_config=cb)
    manager.start()
    start = time.perf_counter()
    try:
        pending = {manager.add_request(list(r.prompt_token_ids or ()), max_new_tokens=r.max_tokens)
                   for r in requests}
        generated = 0
        # Take results in completion order: get_result(request_id=...) requeues other requests'
        # results and returns None, which turns a run into a crawl of timeouts.
        while pending:
            result = manager.get_result(timeout=600)
            if result is None:
                raise RuntimeError(f"HF continuous batching stalled with {len(pending)} pending")
            if result.is_finished() and result.request_id in pending:
                pending.discard(result.request_id)
                generated += len(result.generated_tokens)
    finally:
        manager.stop(block=True)
    return generated / (time.perf_counter() - start)


def measure(factory: EngineFactory, requests: list[BenchRequest], max_num_seqs: int,
            model: str | None, hf_static_batch_sizes: list[int] | None = None) -> list[dict]:
    """cobatch (continuous, static) and the HF peers on one workload, in this process.

    HF static runs once per batch size in `hf_static_batch_sizes` (default: max_num_seqs), so the best
    static configuration is measured rather than assumed.
    """
    rows = []
    for batching in ("continuous", "static"):
        result = run_workload(factory.make(batching=batching, max_num_seqs=max_num_seqs), requests)
        rows.append({"system": f"cobatch {batching}", "tokens_per_s": result.tokens_per_s})
    hf = load_hf_model(model, getattr(factory.runner, "dtype", None))
    peers = [(f"HF generate (static, left-padded, batch {b})", hf_static, b)
             for b in hf_static_batch_sizes or [max_num_seqs]]
    peers.append(("HF continuous batching (generate_batch manager)", hf_continuous, max_num_seqs))
    for name, fn, batch_size in peers:
        try:
            rows.append({"system": name, "tokens_per_s": fn(hf, requests, batch_size)})
        except Exception as exc:  # noqa: BLE001 - a peer's failure is a reported result
            rows.append({"system": name, "tokens_per_s": float("nan"),
                         "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
    ours = rows[0]["tokens_per_s"]
    for row in rows:
        row["cobatch_continuous_over_this"] = ours / row["tokens_per_s"] if row["tokens_per_s"] else None
    return rows


def peers_section(ctx: ClaimsContext) -> Section:
    """The claims-report section for the peers."""
    requests = ctx.workload(16, "32-64", "8-16,48-64", seed=5)
    rows = measure(ctx.factory, requests, 8, ctx.factory.config.model)
    table = markdown_table(["system", "useful tok/s", "cobatch continuous / this"],
                   [[r["system"], r["tokens_per_s"],
                     "failed: " + r["error"] if "error" in r else f"{r['cobatch_continuous_over_this']:.2f}x"]
                    for r in rows])
    md = (f"{len(requests)} requests (prompts 32-64, outputs 8-16 / 48-64), batch 8, greedy, ignore "
          f"EOS, same weights and dtype.\n\n{table}")
    return Section("peers", "Peers: HF transformers in the same harness", md, {"rows": rows})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine and workload flags, plus the HF static batch sizes."""
    add_engine_args(parser)
    add_workload_arguments(parser)
    parser.set_defaults(max_num_seqs=8, num_prompts=16, input_len="32-64", output_len="8-16,48-64")
    parser.add_argument("--hf-static-batch-sizes", default=None,
                        help="comma-separated batch sizes for HF static generate (default: --max-num-seqs)")


def main(args: argparse.Namespace) -> int:
    """Measure cobatch and the HF peers on the workload; print one line per system."""
    factory = EngineFactory.load(engine_config_from_args(args))
    warm_up(factory)
    sizes = [int(b) for b in args.hf_static_batch_sizes.split(",")] if args.hf_static_batch_sizes else None
    for row in measure(factory, workload_from_args(args), args.max_num_seqs, args.model, sizes):
        extra = row.get("error") or f"cobatch continuous / this = {row['cobatch_continuous_over_this']:.2f}x"
        print(f"{row['system']:>50}: {row['tokens_per_s']:8.1f} tok/s   {extra}")
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(cli())
