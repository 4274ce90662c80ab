"""Paged attention over a block-structured KV cache, for a ragged batch of decode rows and prefill chunks.

KV cache of one layer: K and V tensors `[num_blocks, block_size, num_kv_heads, head_dim]`; token t of a
sequence lives at slot `block_table[t // block_size] * block_size + t % block_size`. Each step first
writes its new tokens' K/V to their slots, then attends, so every query's whole context is in the cache.
Where the native kernel's AVX-512 path serves the cache, the elements inside each block are in the
kernel's own order (head-major, pre-arranged for its dot products: kernels/csrc/paged_attention.c),
written only through `kernel.write_kv`; everything else here handles whole blocks (swap, prefix sharing)
and never looks inside.

Native path (kernels/attention.py, kernels/csrc/paged_attention.c): one kernel call for the whole batch.
Every query token sees its own context (a decode row: seq_len keys; a prefill token at position p: p + 1,
causal) through its sequence's block table, read in place; tiles of consecutive tokens of one sequence
share the K/V reads:

    tokens:  [ d0 | d1 | ... | p0 p0 p0 ... p0 p0 | p1 p1 ... ]
    tiles:     1    1          <= tile_tokens each    (seq, first token, num tokens, context of the first)

Torch path (no compiler, COBATCH_NO_NATIVE=1, other devices): the flat batch puts decode rows first
(the runner builds it that way); decode rows are batched (gather + 2 bmm + length mask), each prefill row
is one SDPA call over its new K/V, or over its gathered cached context with a causal mask.

Masked-out slots (padding of block tables, other sequences' blocks) hold whatever was written there: zeros
from allocation or K/V computed by the model, always finite; -inf / boolean masks give them exactly zero
weight (finite garbage times a zero weight is zero; NaN garbage could not be masked, hence the zeroed cache).
The kernel uses none of them: it reads whole quads of 4 keys, but masks the scores past a query's
context and never loads a value past the chunk's last key (tests fill those slots with NaN).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionKernel(Protocol):
    """A fused paged attention over the whole ragged batch (kernels/attention.py): K/V read in place."""

    tile_tokens: int  # most query tokens per tile

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, tiles: torch.Tensor, scale: float) -> torch.Tensor: ...

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None: ...


@dataclass(slots=True)
class PrefillSpan:
    """One prefill row: its query tokens in the flat batch and the cached context they attend to."""

    start: int  # first token of the row in the flat batch
    end: int  # one past its last token
    # [ctx] flat cache slots of positions 0..ctx-1; None for a fresh prompt (no cached tokens), which
    # attends to its own new K/V directly with a plain causal mask.
    context_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # [1, 1, q, ctx] bool: key j visible to query i iff j <= computed + i


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step, built once and shared by all layers."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    num_decode_tokens: int  # decode rows are tokens [0, num_decode_tokens) of the flat batch
    # The C layer loop: its first num_own_writes tokens are one-token rows (one tile each, in order) whose
    # K/V the attention kernel writes itself, at their natural slots (no padding redirect): 0 = none.
    num_own_writes: int = 0
    # Native path: one call over all tokens.
    kernel: AttentionKernel | None = None
    block_tables: torch.Tensor | None = None  # [R, max_blocks] int64, one row per scheduled row
    tiles: torch.Tensor | None = None  # [N, 4] int64: (row, first token, num tokens, context of the first)
    # Torch path.
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks] int64, padded with block 0
    # [D, 1, max_blocks * block_size] fp32, additive: 0 where slot < seq_len, -inf beyond
    decode_mask: torch.Tensor | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)


def make_tiles(num_computed: torch.Tensor, num_new: torch.Tensor, tile_tokens: int) -> torch.Tensor:
    """Split each row's new tokens (rows consecutive in the flat batch) into tiles of <= tile_tokens.

    num_computed, num_new: [R] int64 -> [N, 4] int64 rows (row, first token, num tokens, context of the
    first token, i.e. its position + 1).
    """
    per_row = (num_new + tile_tokens - 1) // tile_tokens  # [R]
    row = torch.repeat_interleave(torch.arange(len(num_new)), per_row)  # [N]
    first_tile = torch.cumsum(per_row, 0) - per_row  # [R]
    offset = (torch.arange(len(row)) - first_tile[row]) * tile_tokens  # [N]: first token within its row
    row_start = torch.cumsum(num_new, 0) - num_new  # [R]: the row's first token in the flat batch
    count = torch.clamp(num_new[row] - offset, max=tile_tokens)
    return torch.stack([row, row_start[row] + offset, count, num_computed[row] + offset + 1], dim=1)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, kernel: AttentionKernel | None = None) -> None:
    """Store the new tokens' K/V ([T, kvh, hd]) at their cache slots: through the kernel, in the layout it
    reads, when it serves the step; else as the cache's shape says."""
    if kernel is not None:
        kernel.write_kv(k_cache, v_cache, k, v, slot_mapping)
        return
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's K/V to the cache, then attend: q [T, nh, hd], k/v [T, kvh, hd] -> [T, nh * hd]."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping, meta.kernel)
    num_tokens, num_heads, head_dim = q.shape
    if meta.kernel is not None:
        assert meta.block_tables is not None and meta.tiles is not None
        out = meta.kernel(q, k_cache, v_cache, meta.block_tables, meta.tiles, scale)  # [T, nh, hd]
        return out.view(num_tokens, num_heads * head_dim)
    out = q.new_empty(num_tokens, num_heads, head_dim)  # [T, nh, hd]
    num_decode = meta.num_decode_tokens
    if num_decode:
        out[:num_decode] = _decode_attention(q[:num_decode], k_cache, v_cache, meta, scale)
    for span in meta.prefills:
        out[span.start:span.end] = _prefill_attention(q, k, v, k_cache, v_cache, span, scale)
    return out.view(num_tokens, num_heads * head_dim)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """All one-token rows at once (torch path): gather their blocks, two batched matmuls, a length mask.

    GQA without copying K/V into head-major order: the gathered K of a row is [ctx, kvh * hd], and
    each query head is placed block-diagonally in a [kvh * hd] vector (zeros outside its KV head's
    slice), so one bmm scores every head against its own KV head. It multiplies some zeros (kvh x the
    flops), but decode attention is memory-bound and this reads K/V once, straight from the gather.

        q_bd [D, nh, kvh * hd]:   head h (of KV group j) = [ 0 .. 0 | q_h | 0 .. 0 ]  (q_h in slice j)
    """
    assert meta.decode_block_tables is not None and meta.decode_mask is not None
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    k = _gather_blocks(k_cache, meta.decode_block_tables)  # [D, ctx, kvh * hd]
    v = _gather_blocks(v_cache, meta.decode_block_tables)  # [D, ctx, kvh * hd]
    eye = torch.eye(num_kv_heads, dtype=q.dtype, device=q.device)
    q_bd = q.view(num_rows, num_kv_heads, group, 1, head_dim) * eye.view(1, num_kv_heads, 1, num_kv_heads, 1)
    q_bd = q_bd.view(num_rows, num_heads, num_kv_heads * head_dim)  # [D, nh, kvh * hd]
    scores = torch.bmm(q_bd, k.transpose(1, 2)).float() * scale + meta.decode_mask  # [D, nh, ctx] fp32
    probs = scores.softmax(dim=-1).to(q.dtype)
    out = torch.bmm(probs, v).view(num_rows, num_kv_heads, group, num_kv_heads, head_dim)
    # Keep each head's own KV-head slice: the block diagonal.
    out = out.diagonal(dim1=1, dim2=3)  # [D, group, hd, kvh]
    return out.permute(0, 3, 1, 2).reshape(num_rows, num_heads, head_dim)  # [D, nh, hd]


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, kvh, hd] through block tables [B, nb] -> [B, nb * bs, kvh * hd]."""
    num_rows, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    return cache[block_tables].view(num_rows, max_blocks * block_size, num_kv_heads * head_dim)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, span: PrefillSpan, scale: float) -> torch.Tensor:
    """One prefill row: causal over its cached context plus its new tokens -> [n, nh, hd]."""
    q_row = q[span.start:span.end].transpose(0, 1).unsqueeze(0)  # [1, nh, n, hd]
    if span.context_slots is None:
        k_row = k[span.start:span.end]  # [n, kvh, hd]
        v_row = v[span.start:span.end]
    else:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_row = k_cache.view(-1, num_kv_heads, head_dim)[span.context_slots]  # [ctx, kvh, hd]
        v_row = v_cache.view(-1, num_kv_heads, head_dim)[span.context_slots]
    k_row = k_row.transpose(0, 1).unsqueeze(0)  # [1, kvh, ctx, hd]: a view, no copy
    v_row = v_row.transpose(0, 1).unsqueeze(0)
    # enable_gqa: each KV head serves its group of query heads without a repeat_interleave copy.
    out = F.scaled_dot_product_attention(q_row, k_row, v_row, attn_mask=span.mask,
                                         is_causal=span.mask is None, scale=scale,
                                         enable_gqa=q.shape[1] != k_row.shape[1])
    return out.squeeze(0).transpose(0, 1)  # [n, nh, hd]
