"""`python -m benchmarks.llama_cpp`: cobatch and llama.cpp's `llama-server` on the same GGUF files, served.

For each named shape (benchmarks/shapes.py: random weights, the published config) it writes the HF
folder, converts it with llama.cpp's own `convert_hf_to_gguf.py` to a dense GGUF (bf16 and/or f32) and
requantizes that file to Q8_0 / Q4_0 / Q4_1 / Q5_1 / Q4_K (scripts/quantize_gguf.py, gguf-py's reference
rounding, every matrix), or to llama-quantize's own mixes (q4_k_m: Q4_K with Q6_K / Q5_0 / Q8_0 matrices
where llama.cpp puts them; q5_k_m: Q5_K with Q6_K / Q5_1 / Q8_0; iq4_xs: IQ4_XS with Q6_K / Q5_K / Q8_0,
IQ4_NL where K is no multiple of 256; q3_k_m: Q3_K with Q4_K / Q5_K / Q6_K; q2_k: Q2_K with Q3_K / Q4_K /
Q6_K; iq3_m: IQ3_S with Q4_K / Q6_K; iq2_xxs: IQ2_XXS with Q4_K / Q2_K / Q5_K; iq1_s: IQ1_S with IQ2_XXS /
Q4_K / Q2_K / Q5_K; iq2_xs: IQ2_XS with Q4_K / Q2_K / Q5_K; q6_k: Q6_K (all but a few small tensors); needs
`build/bin/llama-quantize`, and for the i-quants' iq2_xxs, iq1_s and iq2_xs, which it refuses without an
importance matrix, a uniform one: every input weighed alike,
as the other quantizers here do). Both servers then load the very same file. Against each, in turn, one server up at a time:

    single   one stream: --num-single requests one after another
    batch    --batch-size requests at once

through `cobatch bench serve`'s client (token-id prompts, ignore_eos, the same lengths), each after a warm-up
load of other prompts (--cached-prompts: of its own, which both servers then find cached). The order of the
two servers alternates per repeat (the host is shared and noisy: compare the ratios). The roofline of a
one-stream decode is the read bandwidth (measured here, the servers' thread count) over the bytes a
token reads: the file's matrices (the embedding table only when it is also the lm_head). On a CPU
without AVX512-BF16 both engines keep a bf16 file's bytes and widen them to fp32 for the math (cobatch:
weight-only bf16, csrc/gemm_f32_wbf16.c). The ceiling of a batch is compute: every multiply-add of its
linear layers (prompts and outputs, macs_per_output_token) at this CPU's one-thread peak of the instruction it needs (benchmarks/cpu_peak.py:
int8 dot products for quantized files, fp32 FMAs for dense ones). JSON + plot.

    .venv/bin/python -m benchmarks.llama_cpp --llama-cpp DIR [--shapes smollm2-135m,qwen2.5-0.5b]
        [--formats bf16,q8_0,q4_0] [--threads 1] [--repeats 1] [--work-dir /tmp/llama_cpp_shapes] [--report]
        [--cached-prompts]

DIR is a llama.cpp tree with `build/bin/llama-server` (and for its mixes `llama-quantize`) built
(docs/BENCHMARKS.md says how). Cells are merged into an existing --json of the same loads: a re-run of
some shapes or formats replaces those and keeps the rest, each cell with its own date.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.cpu_peak import ComputePeaks
from benchmarks.cpu_peak import measure as measure_peaks
from benchmarks.shapes import SHAPES, write_checkpoint
from benchmarks.shared_cpu import workload
from cobatch.bench.common import write_json
from cobatch.bench.datasets import BenchRequest
from cobatch.bench.serve import LoadSpec, benchmark, resolve_model
from cobatch.testing.server import free_port, running_server

ROOT = Path(__file__).resolve().parent.parent
DENSE = ("bf16", "f32")
# format -> llama-quantize's type name
LLAMA_QUANTIZE_MIXES = {"q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "iq4_xs": "IQ4_XS", "q3_k_m": "Q3_K_M",
                        "q2_k": "Q2_K", "iq3_m": "IQ3_M", "iq2_xxs": "IQ2_XXS", "iq1_s": "IQ1_S", "iq2_xs": "IQ2_XS",
                        "q6_k": "Q6_K", "tq1_0": "TQ1_0", "tq2_0": "TQ2_0"}
NEEDS_IMATRIX = ("iq2_xxs", "iq1_s", "iq2_xs")
QUANTIZED = ("q8_0", "q4_0", "q4_1", "q5_1", "q4_k", *LLAMA_QUANTIZE_MIXES)
SERVERS = ("llama-server", "cobatch")
_READY_TIMEOUT_S = 600.0
# llama.cpp's converter, run as its own script, except for one thing: it names a BPE pre-tokenizer by the
# hash of its tokenizer's output, and under a Qwen2 config transformers loads the shapes' tokenizer (the
# default model's, SmolLM2's) as Qwen2Tokenizer, whose hash it does not know. The tokenizer.json is
# SmolLM2's, so its pre-tokenizer is "smollm".
_CONVERT = """
import runpy, sys
llama_cpp = sys.argv.pop(1)
sys.path.insert(0, llama_cpp)
from conversion import base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "smollm"
base.TextModel.get_vocab_base_pre = pre
sys.argv[0] = llama_cpp + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""  # a 1.5B fp32 checkpoint takes a while to load and pack


def gguf_files(shape: str, formats: list[str], work_dir: Path, llama_cpp: Path) -> dict[str, Path]:
    """format -> the GGUF file of `shape` in it (written once, reused by later runs)."""
    hf_dir = work_dir / shape
    if not (hf_dir / "config.json").exists():
        write_checkpoint(SHAPES[shape], hf_dir)
    files = {}
    for fmt in formats:
        path = work_dir / f"{shape}-{fmt}.gguf"
        if not path.exists():
            _write_gguf(fmt, hf_dir, path, work_dir / f"{shape}-bf16.gguf", llama_cpp)
        files[fmt] = path
    return files


def _write_gguf(fmt: str, hf_dir: Path, path: Path, dense_bf16: Path, llama_cpp: Path) -> None:
    if fmt in DENSE:
        cmd = [sys.executable, "-c", _CONVERT, str(llama_cpp), str(hf_dir), "--outtype", fmt, "--outfile", str(path)]
    else:
        if not dense_bf16.exists():
            _write_gguf("bf16", hf_dir, dense_bf16, dense_bf16, llama_cpp)
        if fmt in LLAMA_QUANTIZE_MIXES:
            imatrix = ["--imatrix", str(_uniform_imatrix(dense_bf16))] if fmt in NEEDS_IMATRIX else []
            cmd = [str(llama_cpp / "build" / "bin" / "llama-quantize"), *imatrix, str(dense_bf16), str(path),
                   LLAMA_QUANTIZE_MIXES[fmt], "1"]
        else:
            cmd = [sys.executable, str(ROOT / "scripts" / "quantize_gguf.py"), str(path), "--type", fmt,
                   "--model", str(dense_bf16)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)


def _uniform_imatrix(dense: Path) -> Path:
    """An importance matrix of ones for every matrix of `dense` (llama.cpp's legacy .dat: a count, then per
    matrix its name, one call and its input width's values; then the chunk count and a dataset name)."""
    import gguf

    path = dense.with_suffix(".uniform-imatrix.dat")
    matrices = [(t.name.encode(), int(t.shape[0])) for t in gguf.GGUFReader(dense).tensors if len(t.shape) == 2]
    with path.open("wb") as f:
        f.write(struct.pack("<i", len(matrices)))
        for name, width in matrices:
            f.write(struct.pack("<i", len(name)) + name + struct.pack("<ii", 1, width))
            f.write(struct.pack(f"<{width}f", *([1.0] * width)))
        f.write(struct.pack("<ii", 1, len(b"uniform")) + b"uniform")
    return path


def bytes_per_token(path: Path) -> int:
    """Bytes of weights one decode step reads: every matrix, the embedding only when tied to lm_head."""
    import gguf

    tensors = gguf.GGUFReader(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors
               if len(t.shape) == 2 and (tied or t.name != "token_embd.weight"))


def macs_per_output_token(path: Path, input_len: int, output_len: int) -> float:
    """Multiply-adds of the linear layers per output token of one request of the loads: its prompt through
    every matrix but the lm_head, the lm_head once per output token, the other output tokens but the
    last through the rest (attention's few MACs at these lengths are left out: the ceiling is generous)."""
    import gguf

    tensors = [t for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2]
    lm_head = next((t for t in tensors if t.name == "output.weight"), None) or \
        next(t for t in tensors if t.name == "token_embd.weight")
    body = sum(int(t.shape[0]) * int(t.shape[1]) for t in tensors
               if t.name not in ("output.weight", "token_embd.weight"))
    head = int(lm_head.shape[0]) * int(lm_head.shape[1])
    return ((input_len + output_len - 1) * body + output_len * head) / output_len


def batch_ceiling_tok_s(fmt: str, macs_per_token: float, peaks: ComputePeaks) -> float:
    """Output tok/s of a batch whose every multiply-add ran at the peak of the instruction it needs: int8
    dot products for quantized weights; for bf16 ones the fastest way this CPU has to multiply bf16
    (ComputePeaks.bf16_math_macs_per_s: AMX's tile product where it is), else fp32 FMAs (both engines
    widen bf16 to fp32 there); fp32 FMAs for fp32 ones."""
    bf16_rate = peaks.bf16_math_macs_per_s if fmt == "bf16" else None
    rate = peaks.int8_macs_per_s if fmt in QUANTIZED else bf16_rate or peaks.fp32_macs_per_s
    return rate / macs_per_token


def read_bandwidth(threads: int, nbytes: int = 1 << 29, reps: int = 5) -> float:
    """Bytes/s of a large sum with `threads` threads (the best of `reps`), on huge pages like the engine's."""
    import torch

    from cobatch.kernels.hugepages import huge_page_zeros

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        big = huge_page_zeros((nbytes // 4,), torch.float32).fill_(1.0)
        big.sum()
        best = min(_timed(big.sum) for _ in range(reps))
    finally:
        torch.set_num_threads(before)
    return nbytes / best


def _timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


@contextmanager
def serving(server: str, path: Path, args: argparse.Namespace, log_dir: Path) -> Iterator[str]:
    """`server` on the GGUF `path` for the block; its base URL."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    slots = args.batch_size
    if server == "llama-server":
        cmd = [str(args.llama_cpp / "build" / "bin" / "llama-server"), "-m", str(path), "-t", str(args.threads),
               "-np", str(slots), "-c", str(slots * (args.input_len + args.output_len + 16)), "--port", str(port)]
    else:
        cmd = [sys.executable, "-m", "cobatch.cli", "serve", str(path), "--port", str(port),
               "--num-threads", str(args.threads), "--thread-policy", "fixed", "--max-num-seqs", str(slots),
               "--max-model-len", str(args.input_len + args.output_len + 16), "--kv-cache-memory-gb", "0.5"]
    with running_server(cmd, base_url, log_dir / f"{server}-{path.stem}.log", _READY_TIMEOUT_S, cwd=ROOT):
        yield base_url


def measure(base_url: str, requests: list[BenchRequest], concurrency: int) -> dict[str, float]:
    """Output tok/s and median TPOT of one load."""
    spec = LoadSpec(base_url, resolve_model(base_url, None), max_concurrency=concurrency, use_token_ids=True, timeout_s=1800.0)
    report = asyncio.run(benchmark(requests, spec, show_progress=False))
    if report["failed"]:
        raise RuntimeError(f"{report['failed']} requests failed: {report['errors']}")
    return {"tok_s": report["output_throughput"], "tpot_ms_p50": report["tpot_ms"]["p50"]}


def loads(args: argparse.Namespace) -> dict[str, tuple[list[BenchRequest], list[BenchRequest], int]]:
    """Per load: its warm-up requests, its measured ones and its concurrency. The warm-up's prompts are other
    random ids of the same lengths, so the measured run computes its prompts. With --cached-prompts the warm-up
    sends the run's first requests (the method of docs/BENCHMARKS.md's tables but the AVX2 host's): both servers' prompt
    caches (cobatch's prefix cache, llama-server's slot reuse) keep them, and each computes one token of each."""
    single = workload(args.num_single, args.output_len, args.input_len, 0)
    batch = workload(args.batch_size, args.output_len, args.input_len, 1)
    if args.cached_prompts:
        return {"single": (single[:1], single, 1), "batch": (batch, batch, args.batch_size)}
    return {"single": (workload(1, args.output_len, args.input_len, 2), single, 1),
            "batch": (workload(args.batch_size, args.output_len, args.input_len, 3), batch, args.batch_size)}


def run_file(path: Path, args: argparse.Namespace, log_dir: Path) -> dict[str, dict]:
    """Both servers on one file, `repeats` times, the order alternating: server -> load -> runs."""
    runs: dict[str, dict[str, list[dict]]] = {s: {load: [] for load in loads(args)} for s in SERVERS}
    for repeat in range(args.repeats):
        for server in SERVERS[repeat % 2:] + SERVERS[:repeat % 2]:
            with serving(server, path, args, log_dir) as base_url:
                for load, (warm_up, requests, concurrency) in loads(args).items():
                    measure(base_url, warm_up, concurrency)
                    run = measure(base_url, requests, concurrency)
                    runs[server][load].append(run)
                    print(f"  {server:12s} {load:6s} #{repeat}: {run['tok_s']:7.2f} tok/s", flush=True)
    return {s: {load: {"runs": r, "tok_s": statistics.median(x["tok_s"] for x in r)} for load, r in by.items()}
            for s, by in runs.items()}


def summarize(fmt: str, path: Path, result: dict[str, dict], bandwidth: float) -> dict:
    """Ratios cobatch / llama-server, and each one stream against the roofline of the file's bytes."""
    nbytes = bytes_per_token(path)
    roofline = bandwidth / nbytes
    summary = {"format": fmt, "file": path.name, "bytes_per_token": nbytes, "read_bytes_per_s": bandwidth,
               "roofline_tok_s": roofline, "servers": result}
    for load in ("single", "batch"):
        summary[f"{load}_ratio"] = result["cobatch"][load]["tok_s"] / result["llama-server"][load]["tok_s"]
    for server in SERVERS:
        summary[f"{server}_single_of_roofline"] = result[server]["single"]["tok_s"] / roofline
    return summary


def with_batch_ceilings(results: list[dict], peaks: ComputePeaks | None, args: argparse.Namespace,
                        keep_earlier: bool = True) -> list[dict]:
    """Each cell with its batch ceiling (batch_ceiling_tok_s), both servers' batch share of it and the
    peaks it used. `peaks` is measured after the run: a cell of an earlier run keeps the ceiling of
    the peaks measured after it (the host's speed drifts) unless keep_earlier is False (--report)."""
    if peaks is None:
        return results
    out = []
    for r in results:
        if keep_earlier and "batch_ceiling_tok_s" in r:
            out.append(r)
            continue
        macs = macs_per_output_token(args.work_dir / r["file"], args.input_len, args.output_len)
        ceiling = batch_ceiling_tok_s(r["format"], macs, peaks)
        out.append({**r, "batch_ceiling_tok_s": ceiling, "macs_per_output_token": macs,
                    "peaks": dataclasses.asdict(peaks),
                    **{f"{s}_batch_of_ceiling": r["servers"][s]["batch"]["tok_s"] / ceiling for s in SERVERS}})
    return out


def decode_of_roofline(cell: dict) -> float:
    """cobatch's one-stream decode alone against the roofline: 1 / TPOT (the median run's median), the
    prompt's prefill (bound by compute, not bytes) left out. llama-server's TPOT, measured the same way by
    the client, is not used: on these random-weight files it reads above the roofline in several cells
    (its first text chunk comes late), so it does not time its decode."""
    tpot_ms = statistics.median(run["tpot_ms_p50"] for run in cell["servers"]["cobatch"]["single"]["runs"])
    return 1e3 / tpot_ms / cell["roofline_tok_s"]


def markdown(results: list[dict]) -> str:
    """The docs' table: tok/s of both servers, the ratios, the one-stream roofline (end to end, and cobatch's
    decode alone) and batch ceiling shares."""
    head = ("| shape | format | one stream: llama-server | cobatch | ratio | of roofline (llama / cobatch) "
            "| cobatch's decode of roofline | batch: llama-server | cobatch | ratio "
            "| of ceiling (llama / cobatch) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for r in results:
        tok = {s: (r["servers"][s]["single"]["tok_s"], r["servers"][s]["batch"]["tok_s"]) for s in SERVERS}
        ceiling = (f"{r['llama-server_batch_of_ceiling']:.0%} / {r['cobatch_batch_of_ceiling']:.0%}"
                   if "batch_ceiling_tok_s" in r else "")
        rows.append(f"| {r['shape']} | {r['format']} | {tok['llama-server'][0]:.1f} | {tok['cobatch'][0]:.1f} | "
                    f"{r['single_ratio']:.2f}x | {r['llama-server_single_of_roofline']:.0%} / "
                    f"{r['cobatch_single_of_roofline']:.0%} | {decode_of_roofline(r):.0%} | "
                    f"{tok['llama-server'][1]:.1f} | {tok['cobatch'][1]:.1f} | {r['batch_ratio']:.2f}x | {ceiling} |")
    return "\n".join([head, *rows])


def plot(results: list[dict], path: Path) -> None:
    """cobatch / llama-server per shape and format: one stream and batch, the targets (1x, 2x) drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['shape']}\n{r['format']}" for r in results]
    xs = range(len(results))
    fig, ax = plt.subplots(figsize=(max(7.5, 1.1 * len(results)), 4.2))  # room for each cell's label
    ax.bar([x - 0.2 for x in xs], [r["single_ratio"] for r in results], 0.4, label="one stream")
    ax.bar([x + 0.2 for x in xs], [r["batch_ratio"] for r in results], 0.4, label="batch")
    for level in (1.0, 2.0):
        ax.axhline(level, color="grey", lw=0.8, ls="--")
    ax.set_xticks(list(xs), labels, fontsize="small")
    ax.set_ylabel("cobatch tok/s / llama-server tok/s")
    ax.set_title("served side by side on the same GGUF file")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp tree, llama-server built")
    parser.add_argument("--shapes", default="smollm2-135m,qwen2.5-0.5b,llama-3.2-1b")
    parser.add_argument("--formats", default="bf16,q8_0,q4_0", help=f"of {', '.join(DENSE + QUANTIZED)}")
    parser.add_argument("--threads", type=int, default=1, help="both servers' compute threads")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--num-single", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--cached-prompts", action="store_true",
                        help="warm up on the measured prompts, so that both servers find them cached")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/llama_cpp_shapes"))
    parser.add_argument("--json", default=str(ROOT / "docs/bench/llama_cpp_shapes.json"))
    parser.add_argument("--plot", default=str(ROOT / "docs/img/llama_cpp_shapes.png"))
    parser.add_argument("--report", action="store_true",
                        help="run no server: re-read --json, measure the compute peaks, rewrite JSON, plot, table")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    results = earlier_results(Path(args.json), args)
    for shape in [] if args.report else args.shapes.split(","):
        files = gguf_files(shape, args.formats.split(","), args.work_dir, args.llama_cpp)
        for fmt, path in files.items():
            print(f"{shape} {fmt}: {path}", flush=True)
            bandwidth = read_bandwidth(args.threads)
            summary = summarize(fmt, path, run_file(path, args, args.work_dir), bandwidth)
            results = merged(results, {"shape": shape, "date": time.strftime("%Y-%m-%d %H:%M"), **summary})
            print(f"{shape} {fmt}: cobatch / llama-server one stream {summary['single_ratio']:.2f}x, batch "
                  f"{summary['batch_ratio']:.2f}x; one stream of roofline: cobatch "
                  f"{summary['cobatch_single_of_roofline']:.0%}, llama-server "
                  f"{summary['llama-server_single_of_roofline']:.0%}", flush=True)
            write_json(args.json, {"machine": _machine(args), "results": results})  # partial results kept
    peaks = measure_peaks()  # after the servers: nothing else runs
    results = with_batch_ceilings(results, peaks, args, keep_earlier=not args.report)
    write_json(args.json, {"machine": {**_machine(args), **({"peaks": dataclasses.asdict(peaks)} if peaks else {})},
                           "results": results})
    plot(results, Path(args.plot))
    print(markdown(results))
    print(f"wrote {args.json} and {args.plot}")
    return 0


def earlier_results(path: Path, args: argparse.Namespace) -> list[dict]:
    """The cells of an earlier run of the same loads in `path` (a re-run of some cells keeps the others,
    each with its own date); none when the file is absent or measured other loads."""
    if not path.exists():
        return []
    earlier = json.loads(path.read_text())
    same = {k: v for k, v in _machine(args).items() if k not in ("date", "repeats")}
    if any(earlier.get("machine", {}).get(k) != v for k, v in same.items()):
        return []
    return [{"date": earlier["machine"].get("date"), **r} for r in earlier.get("results", [])]


def merged(results: list[dict], cell: dict) -> list[dict]:
    """`results` with `cell` in place of the earlier one of its shape and format (appended if new)."""
    key = (cell["shape"], cell["format"])
    if all((r["shape"], r["format"]) != key for r in results):
        return [*results, cell]
    return [cell if (r["shape"], r["format"]) == key else r for r in results]


def _machine(args: argparse.Namespace) -> dict:
    import os
    import platform

    return {"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "machine": platform.machine(),
            "threads": args.threads, "batch_size": args.batch_size, "num_single": args.num_single,
            "input_len": args.input_len, "output_len": args.output_len, "repeats": args.repeats}


if __name__ == "__main__":
    sys.exit(main())
