"""The quantized GEMM (csrc/gemm_quant.c) against fp32 F.linear and the machine's read bandwidth, one process.

A decoder's worth of weights (LAYERS layers of SmolLM2-like projections, hidden 512 so that Q4_K's
256-weight super-blocks fit: far more bytes than the last-level cache in every format) is run layer after
layer, as a decode step streams it. Per format and M: ms per pass, effective GB/s (the format's bytes
over the time), its share of the read bandwidth (a sum over a 512 MiB tensor on huge pages, as `cobatch
bench roofline` measures it), and the speed-up over fp32 F.linear on the same dense weights, measured
alternately in rounds so that a noisy moment hits both.

    .venv/bin/python scripts/quant_microbench.py [--rows 1,16,512] [--rounds 5] [--layers 30]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from cobatch.kernels.hugepages import huge_page_zeros
from cobatch.kernels.quant_linear import FORMATS, pack_blocks, quantized_linear
from cobatch.models.quantization import quantize

SHAPES = ((960, 512), (512, 512), (3072, 512), (512, 1536))  # qkv, o, gate_up, down (N, K)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,512")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=30)
    args = parser.parse_args()
    torch.manual_seed(0)
    dense = [torch.randn(n, k) * 0.05 for _ in range(args.layers) for n, k in SHAPES]
    big = huge_page_zeros(((1 << 29) // 4,), torch.float32).fill_(1.0)
    bandwidth = max(big.nbytes / _timed(big.sum) for _ in range(args.rounds))
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, threads {torch.get_num_threads()}")
    for name in FORMATS:
        packed = [pack_blocks(quantize(w, name)) for w in dense]
        nbytes = sum(p.numel() for p in packed)
        for m in map(int, args.rows.split(",")):
            xs = {k: torch.randn(m, k) for k in (512, 1536)}
            quant, fp32 = [], []
            for _ in range(args.rounds):
                quant.append(min(_timed(lambda: [quantized_linear(xs[d.shape[1]], p) for d, p in zip(dense, packed)])
                                 for _ in range(2)))
                fp32.append(_timed(lambda: [F.linear(xs[d.shape[1]], d) for d in dense]))
            q, f = min(quant), min(fp32)
            print(f"{name} M={m:4d}: {q * 1e3:8.2f} ms {nbytes / q / 1e9:6.1f} GB/s ({nbytes / q / bandwidth:4.0%} of "
                  f"read bw) | fp32 F.linear {f * 1e3:8.2f} ms {4 * sum(d.numel() for d in dense) / f / 1e9:5.1f} "
                  f"GB/s | speed-up {f / q:5.2f}x  ({nbytes / 2**20:.0f} MiB vs "
                  f"{4 * sum(d.numel() for d in dense) / 2**20:.0f} MiB)")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
