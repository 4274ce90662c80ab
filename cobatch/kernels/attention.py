"""Paged attention over a ragged batch (csrc/paged_attention.c) and the K/V writes into its cache layout."""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from cobatch.kernels.bindings import load_kernels

# One layer's K and V: [num_blocks, block_size, num_kv_heads, head_dim] each, in the kernel's element order
# inside a block on its AVX-512 path (csrc/paged_attention.c).
KVCache = tuple[torch.Tensor, torch.Tensor]

class AttentionKernel:
    """Paged attention over a ragged batch for fp32 and bf16 caches (csrc/paged_attention.c: layouts).

    The caches it reads are its own: shaped [blocks, block_size, kv heads, head_dim], but on its AVX-512
    path each block's elements are pre-arranged for it (`uses_avx512`; the file header draws the
    layout), so every write to them goes through `write_kv`. Whole blocks can still be copied, swapped
    and shared as they are."""

    tile_tokens = 16  # consecutive query tokens of one sequence that share each K/V read

    def __init__(self, lib: ctypes.CDLL) -> None:
        """lib: the kernels library, bound (bindings.load_kernels, or bindings.bind of a variant build)."""
        self._fns = {torch.float32: lib.paged_attention_f32, torch.bfloat16: lib.paged_attention_bf16}
        self._writes = {torch.float32: lib.paged_write_kv_f32, torch.bfloat16: lib.paged_write_kv_bf16}
        self._is_fast = lib.paged_attention_is_fast

    def supports(self, dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and dtype in self._fns

    def uses_avx512(self, dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
        """Whether this dtype, head size and block size run the AVX-512 path on the kernel layout (else
        the plain C one, on [blocks, block_size, kv heads, head_dim] as it looks)."""
        return bool(self._is_fast(dtype == torch.bfloat16, head_dim, block_size))

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store new tokens' K/V ([T, kvh, hd], token stride free) at their cache slots, in the layout
        the kernel reads."""
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        for x in (k, v):
            assert x.dtype == k_cache.dtype and x.stride(2) == 1 and x.stride(1) == head_dim
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype
        slots = slot_mapping.contiguous()
        assert slots.dtype == torch.int64 and len(slots) == len(k) == len(v)
        self._writes[k_cache.dtype](k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                                    v_cache.data_ptr(), slots.data_ptr(), len(slots), num_kv_heads, head_dim,
                                    block_size)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, tiles: torch.Tensor, scale: float,
                 num_own_writes: int = 0) -> torch.Tensor:
        """q [T, nh, hd] (token stride free), caches [blocks, bs, kvh, hd], block_tables [S, nb],
        tiles [N, 4] (seq, first token, tokens, context of the first) -> [T, nh, hd]. num_own_writes: the
        first tiles are one-token rows whose new K/V follow their q heads in q's rows ([q | k | v], as a
        fused QKV projection lays them out): the kernel writes them first (csrc: write_own_key)."""
        num_tokens, num_heads, head_dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            assert num_own_writes == 0, "own writes read K/V from q's rows: q must be a view of them"
            q = q.contiguous()
        _, block_size, num_kv_heads, _ = k_cache.shape
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.is_contiguous()
        assert block_tables.dtype == torch.int64 and tiles.dtype == torch.int64 and tiles.is_contiguous()
        assert num_heads % num_kv_heads == 0 and q.dtype == k_cache.dtype == v_cache.dtype
        out = q.new_empty(num_tokens, num_heads, head_dim)
        status = self._fns[q.dtype](
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.shape[1], tiles.data_ptr(), tiles.shape[0], out.data_ptr(), num_heads,
            num_kv_heads, head_dim, block_size, scale, num_own_writes)
        if status != 0:
            raise MemoryError("native attention could not allocate its scratch buffers")
        return out


@lru_cache(maxsize=1)
def load_attention_kernel() -> AttentionKernel | None:
    """The kernel, building the library if needed; None when native code is off or the build fails."""
    lib = load_kernels()
    return None if lib is None else AttentionKernel(lib)
