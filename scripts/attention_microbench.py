"""Native paged attention alone, the step microbench's shapes (SmolLM2-135M: 9 heads, 3 KV heads, hd 64,
block 16, 30 layers with their own caches, so K/V come from memory as in a real step): ms per step
(30 calls) for decode B rows at ctx 256 and a 12 x 170 prefill, and decode's K/V bandwidth. NT threads."""
import os, statistics, sys, time

import torch

from cobatch.models.attention import make_tiles
from cobatch.models.native import load_attention_kernel

torch.set_num_threads(int(os.environ.get("NT", "2")))
if os.environ.get("PA_SO"):  # a variant build (A/B of compile-time settings)
    import ctypes
    from cobatch.models.native import AttentionKernel
    kernel = AttentionKernel(ctypes.CDLL(os.environ["PA_SO"]))
else:
    kernel = load_attention_kernel()
if os.environ.get("TILE"):  # query tokens per tile (A/B)
    kernel.tile_tokens = int(os.environ["TILE"])
LAYERS, BLOCKS, BS, NH, KVH, HD = 30, 2400, 16, 9, 3, 64
dtype = getattr(torch, os.environ.get("DTYPE", "bfloat16"))
def cache() -> torch.Tensor:
    """[2, blocks, bs, kvh, hd]; HUGE=1: on transparent huge pages (madvise), to see what TLB misses cost."""
    x = torch.randn(2, BLOCKS, BS, KVH, HD).to(dtype)
    if os.environ.get("HUGE") != "1":
        return x
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    size, huge = x.numel() * x.element_size(), 2 << 20
    addr = libc.mmap(None, size + huge, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
    start = (addr + huge - 1) & ~(huge - 1)
    assert libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(size), 14) == 0  # MADV_HUGEPAGE
    arr = (ctypes.c_char * size).from_address(start)
    y = torch.frombuffer(arr, dtype=dtype).view(x.shape)
    y.copy_(x)
    buf = arr
    _keep.append(buf)
    return y


_keep = []
caches = [cache() for _ in range(int(os.environ.get("CACHES", LAYERS)))]
caches = (caches * LAYERS)[:LAYERS]  # CACHES=1: one cache, K/V from the caches (compute-bound check)


def time_step(q, tables, computed, new, reps=7):
    tiles = make_tiles(computed, new, kernel.tile_tokens)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for k, v in caches:
            kernel(q, k, v, tables, tiles, HD ** -0.5)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def decode(b, ctx=256):
    nb = -(-(ctx + 1) // BS)
    tables = torch.tensor([[(i * nb + j) % BLOCKS for j in range(nb)] for i in range(b)])
    if os.environ.get("SHUFFLE") == "1":  # blocks scattered over the pool, as after LRU churn
        tables = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(0))[tables]
    q = torch.randn(b, NH, HD).to(dtype)
    s = time_step(q, tables, torch.full((b,), ctx), torch.ones(b, dtype=torch.int64))
    gb = LAYERS * b * (ctx + 1) * KVH * HD * 2 * dtype.itemsize / 1e9
    print(f"decode B={b:3d} ctx {ctx}: {1000 * s:7.2f} ms  ({gb / s:5.1f} GB/s of K/V)", flush=True)


def prefill(n=12, length=170):
    tables = torch.tensor([list(range(i * 11, i * 11 + 11)) for i in range(n)])
    q = torch.randn(n * length, NH, HD).to(dtype)
    s = time_step(q, tables, torch.zeros(n, dtype=torch.int64), torch.full((n,), length), reps=3)
    print(f"prefill {n}x{length}: {1000 * s:7.2f} ms", flush=True)


if os.environ.get("HUGE") == "1":
    print([l for l in open("/proc/self/smaps_rollup") if "AnonHuge" in l])
for arg in sys.argv[1:] or ["prefill", "1", "8", "32", "64"]:
    prefill() if arg == "prefill" else decode(int(arg))
