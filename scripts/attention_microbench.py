"""Native paged attention alone at the step microbench's shapes (SmolLM2-135M: 9 heads, 3 KV heads, hd 64,
block 16; 30 layers with their own caches, so K/V come from memory as in a real step): ms per step (30
calls) for decode rows at ctx 256 and a 12 x 170 prefill, and decode's K/V bandwidth.

    .venv/bin/python scripts/attention_microbench.py [prefill] [B ...]

Environment: NT threads (2); DTYPE (bfloat16); PA_SO a variant build of the kernels library (all of
cobatch/kernels/csrc/*.c, for A/B of -D settings); TILE query tokens per tile; BS block size (16; the pool
keeps its token count); SHUFFLE=1 blocks scattered over the pool (as after LRU churn); HUGE=1 caches on
transparent huge pages (what TLB misses cost); CACHES=1 one cache for all layers (K/V from the CPU caches:
the compute-bound time).
"""
import ctypes
import os
import statistics
import sys
import time

import torch

from cobatch.kernels.attention import AttentionKernel, load_attention_kernel
from cobatch.kernels.bindings import bind
from cobatch.models.attention import make_tiles

BS = int(os.environ.get("BS", "16"))  # block size (tokens)
LAYERS, BLOCKS, NH, KVH, HD = 30, 2400 * 16 // BS, 9, 3, 64
torch.set_num_threads(int(os.environ.get("NT", "2")))
DTYPE = getattr(torch, os.environ.get("DTYPE", "bfloat16"))
KERNEL = AttentionKernel(bind(ctypes.CDLL(os.environ["PA_SO"]))) if os.environ.get("PA_SO") else load_attention_kernel()
assert KERNEL is not None, "the native kernel is not available"
if os.environ.get("TILE"):
    KERNEL.tile_tokens = int(os.environ["TILE"])


def huge_page_tensor(shape: tuple[int, ...]) -> torch.Tensor:
    """Zeros in a private anonymous mapping advised MADV_HUGEPAGE (mapped for the process's life)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    size, huge = DTYPE.itemsize * torch.Size(shape).numel(), 2 << 20
    addr = libc.mmap(None, size + huge, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
    start = (addr + huge - 1) & ~(huge - 1)
    assert libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(size), 14) == 0  # MADV_HUGEPAGE
    return torch.frombuffer((ctypes.c_char * size).from_address(start), dtype=DTYPE).view(shape)


def cache() -> torch.Tensor:
    """One layer's K and V: [2, blocks, bs, kvh, hd]."""
    x = torch.randn(2, BLOCKS, BS, KVH, HD).to(DTYPE)
    return huge_page_tensor(x.shape).copy_(x) if os.environ.get("HUGE") == "1" else x


CACHES = [cache() for _ in range(int(os.environ.get("CACHES", LAYERS)))]
CACHES = (CACHES * LAYERS)[:LAYERS]


def time_step(q: torch.Tensor, tables: torch.Tensor, computed: torch.Tensor, new: torch.Tensor,
              reps: int = 7) -> float:
    """Median seconds of one call per layer."""
    tiles = make_tiles(computed, new, KERNEL.tile_tokens)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for k, v in CACHES:
            KERNEL(q, k, v, tables, tiles, HD ** -0.5)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode(batch: int, ctx: int = 256) -> None:
    nb = -(-(ctx + 1) // BS)
    tables = torch.tensor([[(i * nb + j) % BLOCKS for j in range(nb)] for i in range(batch)])
    if os.environ.get("SHUFFLE") == "1":
        tables = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(0))[tables]
    q = torch.randn(batch, NH, HD).to(DTYPE)
    s = time_step(q, tables, torch.full((batch,), ctx), torch.ones(batch, dtype=torch.int64))
    gb = LAYERS * batch * (ctx + 1) * KVH * HD * 2 * DTYPE.itemsize / 1e9
    print(f"decode B={batch:3d} ctx {ctx}: {1000 * s:7.2f} ms  ({gb / s:5.1f} GB/s of K/V)", flush=True)


def prefill(num_prompts: int = 12, length: int = 170) -> None:
    tables = torch.tensor([list(range(i * 11, i * 11 + 11)) for i in range(num_prompts)])
    q = torch.randn(num_prompts * length, NH, HD).to(DTYPE)
    s = time_step(q, tables, torch.zeros(num_prompts, dtype=torch.int64), torch.full((num_prompts,), length),
                  reps=3)
    print(f"prefill {num_prompts}x{length}: {1000 * s:7.2f} ms", flush=True)


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["prefill", "1", "8", "32", "64"]:
        prefill() if arg == "prefill" else decode(int(arg))
