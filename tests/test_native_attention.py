"""The native decode-attention kernel against the pure-torch path (gather + bmm + mask)."""

from __future__ import annotations

import pytest
import torch

from cobatch.models.attention import AttentionMetadata, _decode_attention
from cobatch.models.native import load_decode_kernel
from tests.runner_helpers import BlockAllocator, hf_greedy, runner_for, step, tiny_hf_model

KERNEL = load_decode_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the torch path runs instead")


def _case(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, seq_lens: list[int],
          block_size: int = 4, num_blocks: int = 64) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    max_blocks = -(-max(seq_lens) // block_size)
    # Each row gets distinct, shuffled blocks; padding entries point at block 0 (masked out).
    perm = torch.randperm(num_blocks, generator=gen)[:len(seq_lens) * max_blocks].view(len(seq_lens), -1)
    tables = torch.stack([torch.where(torch.arange(max_blocks) < -(-n // block_size), perm[i], 0)
                          for i, n in enumerate(seq_lens)])  # [D, nb]
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(seq_lens)


def _torch_reference(q, k_cache, v_cache, tables, seq_lens) -> torch.Tensor:
    slots = torch.arange(tables.shape[1] * k_cache.shape[1])
    mask = torch.zeros(len(seq_lens), slots.numel()).masked_fill_(slots >= seq_lens[:, None], float("-inf"))
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), num_decode_tokens=len(q),
                             decode_block_tables=tables, decode_mask=mask.unsqueeze(1))
    return _decode_attention(q, k_cache, v_cache, meta, q.shape[-1] ** -0.5)


@needs_kernel
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads", [(4, 2, 16), (9, 3, 64), (2, 2, 8)])
def test_kernel_matches_torch_path(dtype: torch.dtype, atol: float, heads: tuple[int, int, int]) -> None:
    q, k_cache, v_cache, tables, seq_lens = _case(dtype, *heads, seq_lens=[1, 5, 17, 9, 4])
    got = KERNEL(q, k_cache, v_cache, tables, seq_lens, q.shape[-1] ** -0.5)
    want = _torch_reference(q, k_cache, v_cache, tables, seq_lens)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)


@needs_kernel
def test_kernel_and_torch_path_runners_match_hf() -> None:
    hf_model = tiny_hf_model("llama")
    prompts = [[5, 17, 99, 3, 250, 42, 7], [11, 12], [77]]
    reference = [hf_greedy(hf_model, p, 6) for p in prompts]
    for native in (True, False):
        runner = runner_for(hf_model, native_attention=native)
        assert (runner.decode_kernel is not None) == native
        alloc = BlockAllocator(runner.block_size)
        seqs = [alloc.seq(f"r{i}", p, len(p) + 6) for i, p in enumerate(prompts)]
        step(runner, [(s, None) for s in seqs])
        for _ in range(5):
            step(runner, [(s, 1) for s in seqs])
        assert [s.output for s in seqs] == reference
