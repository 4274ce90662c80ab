"""csrc/gemm_quant.c's builds timed side by side, one thread.

scripts/quant_microbench.py times the library's own build against the read bandwidth; this one compares builds.

Each format (Q8_0, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K) on an N x K matrix at M = 1 and 16 rows, weights
out of cache (a ring of copies, --ring-mb, many times the last-level cache; --in-cache: one copy, for a matrix that
fits in L2), against torch's fp32 `F.linear` on the dense matrix (a ring too), each build's time also as GB/s
of weights. Builds: this CPU's own path (AVX-512 VNNI, AVX2 or plain C), the plain C path (-DQUANT_SCALAR),
with --baseline REV the gemm_quant.c of a git revision (its own default path), and with --variant
NAME='-DX=1 ...' this tree's built with those flags (retuning a #define); each compiled alone with the
library's flags. Prints a table and writes JSON.

    .venv/bin/python scripts/quant_builds_microbench.py [--baseline HEAD~1] [--n 1536 --k 1536] [--json PATH]
        [--rows 1,16] [--rounds 1] [--formats q8_0,q4_0,q4_k,...] [--variant NAME=FLAGS ...]
        [--single-stream [--no-single-prefetch | --single-prefetch-l2]] [--wide-tiles] [--in-cache] [--ring-mb 512]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cobatch.bench.common import write_json
from cobatch.kernels.build import COMPILE_FLAGS
from cobatch.kernels.hugepages import huge_page_zeros
from cobatch.kernels.quant_linear import FORMATS, SINGLE_STREAM_ROWS
from cobatch.models.quantization import quantize

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "cobatch/kernels/csrc"
QTYPES = {name: fmt.qtype for name, fmt in FORMATS.items()}
# A ring 3x this Zen 4's 32 MB L3 (96 MB) still left part of each pass there: its replacement keeps part of a
# cyclic set larger than itself, and one row read 1.2-1.4x above the DRAM rate (Q4_K 11264 x 2048: 34.4 GB/s
# against 24.9 with 512 MB, 25.6 on a model's 22 gate | up matrices, 285 MB).
RING_MB = 512


def build(source: Path, header_dir: Path, flags: tuple[str, ...], out: Path) -> ctypes.CDLL:
    """gemm_quant.c alone as a shared library, its two entry points typed."""
    subprocess.run(["gcc", *COMPILE_FLAGS, *flags, "-I", str(header_dir), str(source), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    lib.gemm_quant.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.quant_pack.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                               ctypes.c_int]
    return lib


def builds(tmp: Path, baseline: str | None, variants: list[str]) -> dict[str, ctypes.CDLL]:
    libs = {"this CPU's path": build(CSRC / "gemm_quant.c", CSRC, (), tmp / "native.so"),
            "plain C": build(CSRC / "gemm_quant.c", CSRC, ("-DQUANT_SCALAR",), tmp / "plain.so")}
    for i, variant in enumerate(variants):
        name, _, flags = variant.partition("=")
        libs[name] = build(CSRC / "gemm_quant.c", CSRC, tuple(flags.split()), tmp / f"variant{i}.so")
    if baseline:
        old = tmp / "old"
        old.mkdir()
        for name in ("gemm_quant.c", "cobatch_kernels.h", "parallel.h", "amx.h"):
            shown = subprocess.run(["git", "show", f"{baseline}:cobatch/kernels/csrc/{name}"], cwd=ROOT,
                                   capture_output=True, text=True)
            if shown.returncode == 0:
                (old / name).write_text(shown.stdout)
            elif name not in ("parallel.h", "amx.h"):  # the headers a baseline may lack (before 3684822, 74e5c26)
                raise SystemExit(f"{baseline} has no {name}: {shown.stderr.strip()}")
        libs[f"at {baseline}"] = build(old / "gemm_quant.c", old, (), tmp / "old.so")
    return libs


def seconds_per_call(fn: Callable[[], None], budget_s: float = 0.5) -> float:
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < budget_s or calls < 3:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def ring(tensor: torch.Tensor, in_cache: bool = False, ring_mb: int = RING_MB) -> list[torch.Tensor]:
    """Copies of `tensor` on huge pages, as the engine keeps its weights (kernels/hugepages.py), ring_mb in all;
    one if `in_cache`."""
    copies = 1 if in_cache else max(2, (ring_mb << 20) // (tensor.numel() * tensor.element_size()))
    return [huge_page_zeros(tuple(tensor.shape), tensor.dtype).copy_(tensor) for _ in range(copies)]


def run(libs: dict[str, ctypes.CDLL], n: int, k: int, rows: list[int], rounds: int,
        formats: list[str], in_cache: bool = False, ring_mb: int = RING_MB) -> list[dict]:
    """Per format and row count: each build's ms a call, the best of `rounds` rounds that visit the builds
    in turn (a noisy moment hits all of them), and torch's."""
    results = []
    for fmt in formats:
        qtype = QTYPES[fmt]
        blocks = quantize(torch.randn(n, k) * 0.1, fmt).contiguous()
        packed = torch.empty_like(blocks)
        next(iter(libs.values())).quant_pack(blocks.data_ptr(), qtype, n, k, packed.data_ptr(), 1)
        weights, dense = ring(packed, in_cache, ring_mb), ring(torch.randn(n, k), in_cache, ring_mb)
        for m in rows:
            x, y = torch.randn(m, k), torch.empty(m, n)
            cell = {"format": fmt, "m": m, "ms": {name: float("inf") for name in libs}, "weight_bytes": packed.numel()}
            for _ in range(rounds):
                for name, lib in libs.items():
                    calls = iter(range(1 << 62))
                    cell["ms"][name] = min(cell["ms"][name], 1e3 * seconds_per_call(lambda: lib.gemm_quant(
                        x.data_ptr(), weights[next(calls) % len(weights)].data_ptr(), qtype, None,
                        y.data_ptr(), m, n, k, 0, 1)))
            calls = iter(range(1 << 62))
            cell["ms"]["torch fp32"] = 1e3 * seconds_per_call(
                lambda: torch.nn.functional.linear(x, dense[next(calls) % len(dense)]))
            gbs = {name: packed.numel() / v / 1e6 for name, v in cell["ms"].items() if name in libs}
            print(f"{fmt} M={m:2d}: " + " | ".join(f"{name} {v:.3f} ms" + (f" ({gbs[name]:.1f} GB/s)" if name in gbs
                                                                          else "") for name, v in cell["ms"].items()),
                  flush=True)
            results.append(cell)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a git revision whose gemm_quant.c is timed beside this one")
    parser.add_argument("--n", type=int, default=1536)
    parser.add_argument("--k", type=int, default=1536)
    parser.add_argument("--rows", default="1,16", help="row counts M")
    parser.add_argument("--rounds", type=int, default=1, help="rounds over the builds, the best kept")
    parser.add_argument("--formats", default=",".join(QTYPES))
    parser.add_argument("--variant", action="append", default=[], help="NAME=FLAGS: this tree built with FLAGS")
    parser.add_argument("--no-plain", action="store_true", help="leave the plain C build out")
    parser.add_argument("--single-stream", action="store_true",
                        help="every build in single-stream mode (gemm_quant_set_single_stream), as the runner sets it")
    parser.add_argument("--no-single-prefetch", action="store_true",
                        help="with --single-stream: its software prefetch off (gemm_quant_set_single_prefetch)")
    parser.add_argument("--single-prefetch-l2", action="store_true",
                        help="with --single-stream: its software prefetch into L2, not L1 "
                             "(gemm_quant_set_single_prefetch)")
    parser.add_argument("--wide-tiles", action="store_true",
                        help="every build in wide-tile mode (gemm_quant_set_wide_tiles), as the runner may set it")
    parser.add_argument("--ring-mb", type=int, default=RING_MB,
                        help="MB of weight copies a pass cycles through out of cache (figures before 2026-12-06: 96)")
    parser.add_argument("--in-cache", action="store_true",
                        help="one copy of the weights, not a ring past the last-level cache (a matrix that fits in L2)")
    parser.add_argument("--json", default="/tmp/quant_kernel.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [int(m) for m in args.rows.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        libs = builds(Path(tmp), args.baseline, args.variant)
        if args.no_plain:
            del libs["plain C"]
        for lib in libs.values():
            if args.single_stream and hasattr(lib, "gemm_quant_set_single_stream"):
                lib.gemm_quant_set_single_stream(SINGLE_STREAM_ROWS)
            if hasattr(lib, "gemm_quant_set_single_prefetch"):
                level = 0 if args.no_single_prefetch else 2 if args.single_prefetch_l2 else 1
                lib.gemm_quant_set_single_prefetch(level)
            if args.wide_tiles and hasattr(lib, "gemm_quant_set_wide_tiles"):
                lib.gemm_quant_set_wide_tiles(1)
        results = run(libs, args.n, args.k, rows, args.rounds, args.formats.split(","), args.in_cache, args.ring_mb)
    write_json(args.json, {"n": args.n, "k": args.k, "threads": 1, "rounds": args.rounds,
                           "single_stream": args.single_stream,
                           "single_prefetch": 0 if args.no_single_prefetch else 2 if args.single_prefetch_l2 else 1,
                           "wide_tiles": args.wide_tiles, "in_cache": args.in_cache, "results": results})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
