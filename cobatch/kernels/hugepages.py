"""CPU tensors on transparent huge pages: the KV cache pool and the packed weights.

Why: both are read in big scattered or streamed sweeps every step, and on 4 KiB pages the TLB misses (and
the hardware prefetchers stopping at every page) cost measurable time in the attention kernel and in
small-batch GEMMs (scripts/attention_microbench.py SHUFFLE=1 vs HUGE=1 and scripts/linear_microbench.py
measure it). Where THP is off (or only "never") the advice is ignored and this is plain memory.
"""

from __future__ import annotations

import mmap
from typing import Sequence

import torch

HUGE_PAGE_BYTES = 2 << 20
_ALIGN_BYTES = 64  # each tensor in a shared mapping starts on a cache line


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros from an anonymous private mapping advised MADV_HUGEPAGE, starting on a huge-page boundary.
    The OS maps zero pages lazily, so a 4 GiB cache costs nothing until used (torch.zeros would memset it
    all at once)."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)  # mmap cannot map 0 bytes
    pad = HUGE_PAGE_BYTES if nbytes >= HUGE_PAGE_BYTES else 0  # room to start on a 2 MiB boundary
    buf = mmap.mmap(-1, nbytes + pad, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no THP in this kernel (EINVAL) or no madvise here: plain pages
        pass
    # frombuffer keeps `buf` alive as long as the tensor (and its views) live.
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    start = (-raw.data_ptr()) % HUGE_PAGE_BYTES if pad else 0
    return raw[start:start + nbytes].view(dtype).view(shape)


def move_to_huge_pages(params: Sequence[torch.nn.Parameter]) -> int:
    """Copy the parameters' data, one after another, into one huge-page mapping and point them at it (the
    same Parameter objects: tied weights follow); each old copy is dropped as soon as it is copied, so
    the peak grows by about one tensor. Returns the bytes moved."""
    unique = list({id(p): p for p in params if p.device.type == "cpu" and p.numel() > 0}.values())
    offsets, total = [], 0
    for p in unique:
        offsets.append(total)
        total += -(-p.numel() * p.element_size() // _ALIGN_BYTES) * _ALIGN_BYTES
    if total == 0:
        return 0
    pool = huge_page_zeros((total,), torch.uint8)
    for p, offset in zip(unique, offsets):
        nbytes = p.numel() * p.element_size()
        view = pool[offset:offset + nbytes].view(p.dtype).view(p.shape)
        view.copy_(p.data)
        p.data = view
    return total
