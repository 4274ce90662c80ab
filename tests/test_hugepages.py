"""Huge-page tensors: lazily zero, aligned, and weights moved there keep their values and their ties."""

from __future__ import annotations

import torch

from cobatch.kernels.hugepages import HUGE_PAGE_BYTES, huge_page_zeros, move_to_huge_pages


def test_huge_page_zeros_are_zero_and_start_on_a_huge_page() -> None:
    big = huge_page_zeros((3, HUGE_PAGE_BYTES // 4 + 5), torch.float32)
    assert big.shape == (3, HUGE_PAGE_BYTES // 4 + 5) and big.dtype == torch.float32
    assert big.data_ptr() % HUGE_PAGE_BYTES == 0 and big.is_contiguous() and not big.any()
    small = huge_page_zeros((7,), torch.bfloat16)
    assert small.shape == (7,) and not small.any()
    assert huge_page_zeros((0, 4), torch.float32).shape == (0, 4)


def test_moved_parameters_keep_values_ties_and_alignment() -> None:
    embed = torch.nn.Parameter(torch.randn(50, 8).bfloat16())
    norm = torch.nn.Parameter(torch.randn(3).bfloat16())
    proj = torch.nn.Parameter(torch.randn(2, 5, 16, 2).bfloat16())  # a packed-weight shape
    before = [p.detach().clone() for p in (embed, norm, proj)]
    old_ptr = embed.data_ptr()
    moved = move_to_huge_pages([embed, norm, proj, embed])  # a tied weight comes twice
    assert moved == sum(-(-p.numel() * 2 // 64) * 64 for p in before)
    assert embed.data_ptr() != old_ptr and all(p.data_ptr() % 64 == 0 for p in (embed, norm, proj))
    assert all(torch.equal(p, b) for p, b in zip((embed, norm, proj), before))
    assert len({p.data_ptr() for p in (embed, norm, proj)}) == 3  # no two share bytes
    assert move_to_huge_pages([]) == 0
