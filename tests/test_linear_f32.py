"""Packed-weight fp32 GEMM (csrc/gemm_f32.c via cobatch.kernels.linear) against F.linear and a float64
reference: every tile height, N and K off the tile, bias, denormals, the fused SiLU gate/up variant, and
COBATCH_NO_NATIVE. Batch invariance, thread counts, the rows lookup, operand checks, the model packing
its weights and the stub without AVX-512: tests/test_linear_kernel.py, in both dtypes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cobatch.kernels import linear as linear_module
from cobatch.kernels.bindings import load_kernels
from cobatch.kernels.fused_ops import fused_ops
from cobatch.kernels.linear import (can_pack, can_pack_gate_up, is_gate_up_packed, is_packed, linear,
                                   native_gemm, pack_gate_up, pack_weight, packed_shape, silu_mul_linear,
                                   unpack_weight)

KERNEL = native_gemm(torch.float32)
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no AVX-512F or no compiler here")
FP32_EPS = 2.0 ** -24


def _operands(m: int, n: int, k: int, bias: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    return x, w, torch.randn(n, generator=g) if bias else None


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """Within the error bound of a sequential fp32 sum (K u sum |x w|, plus the bias add) of the float64
    value; a wrong, missing or doubled term is off by ~|x w| ~ 1/sqrt(K) of that sum, well over it."""
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    magnitude = F.linear(x.double().abs(), w.double().abs(), None if b is None else b.double().abs())
    bound = (x.shape[-1] + 1) * FP32_EPS * magnitude
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert ((out.double() - ref).abs() <= bound).all()
    assert ((out - F.linear(x, w, b)).double().abs() <= 2 * bound).all()


@pytest.mark.parametrize("n,columns", [(48, 16), (96, 16), (32, 16), (80, 16)])
def test_pack_layout_and_round_trip(n: int, columns: int) -> None:
    """packed[p, k, c, 0] = W[16 p + c, k]: one K value of a panel's 16 outputs per 64-byte line, single
    panels (one stream each) whatever N."""
    w = torch.arange(n * 7, dtype=torch.float32).view(n, 7)
    packed = pack_weight(w)
    assert packed.shape == (n // columns, 7, columns, 1) and is_packed(packed) and not is_packed(w)
    for b, k, c in [(0, 0, 0), (0, 0, 1), (0, 1, 0), (n // columns - 1, 6, columns - 1), (0, 3, columns // 2)]:
        assert packed[b, k, c, 0] == w[columns * b + c, k]
    assert torch.equal(unpack_weight(packed), w) and packed_shape(packed) == (n, 7)


@pytest.mark.parametrize("shape,ok", [((32, 64), True), ((32, 63), True), ((40, 64), False), ((16, 1), True)])
def test_can_pack(shape: tuple[int, int], ok: bool) -> None:
    """Whole 16-column panels; any K (no pairs in fp32)."""
    assert can_pack(torch.zeros(shape)) == ok


# panels 1..9 (tile widths 3 + tails of 1 and 2; single panels in fp32 whatever the count), K from 1
# to the model's sizes, odd ones too, and K in 2 or 3 blocks (KC_MAX 1024: 768 + 768, 701 + 700 + 700)
SHAPES = [(576, 1536), (16, 1), (32, 37), (48, 34), (64, 96), (80, 575), (96, 64), (112, 9), (144, 40),
          (32, 2101)]
ROWS = (*range(1, 18), 23, 24, 25, 31, 33, 64, 70, 130, 257)  # tile heights, prefetch thresholds, chunks of 256


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(n: int, k: int, bias: bool) -> None:
    for m in ROWS:
        x, w, b = _operands(m, n, k, bias, seed=m * 1000 + n + k)
        _check(linear(x, pack_weight(w), b), x, w, b)


def test_k_blocks_do_not_depend_on_the_batch() -> None:
    """K in blocks (partial sums stored in y and reloaded) is still one sum in k order: a row's bits are
    the same alone, in any batch, at any thread count."""
    x, w, b = _operands(300, 96, 2101, True, seed=4)
    packed = pack_weight(w)
    full = linear(x, packed, b)
    for rows in (slice(0, 1), slice(0, 9), slice(7, 24), slice(13, 300)):
        assert torch.equal(linear(x[rows], packed, b), full[rows])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(linear(x, packed, b), full)
    finally:
        torch.set_num_threads(threads)


def test_keeps_denormals() -> None:
    """No flush to zero: a denormal product and sum come out as fp32 computes them."""
    w = torch.zeros(16, 2)
    w[0] = torch.tensor([2.0 ** -130, 2.0 ** -131])
    out = linear(torch.ones(1, 2), pack_weight(w))
    assert out[0, 0].item() == 2.0 ** -130 + 2.0 ** -131 and (out[0, 1:] == 0).all()


@pytest.mark.parametrize("inter,k", [(48, 64), (96, 33), (144, 576), (48, 1100)])
def test_gate_up_silu_same_bits_as_linear_then_silu_mul(inter: int, k: int) -> None:
    """The fused kernel computes each gate/up tile as the GEMM does and applies silu_mul's fp32 arithmetic,
    so its bits are the two-step path's for every tile height, the prefetch thresholds, row chunks of 256
    and thread counts; a NaN input row stays NaN."""
    assert can_pack_gate_up(torch.zeros(2 * inter, k)) and not can_pack_gate_up(torch.zeros(2 * 64, k))
    ops = fused_ops()
    for m in (1, 5, 8, 9, 17, 24, 300):
        x, w, _ = _operands(m, 2 * inter, k, False, seed=7 * m + inter + k)
        if m == 9:
            x[4, 1] = float("nan")
        packed = pack_gate_up(w)
        assert is_gate_up_packed(packed) and packed.shape == (2 * inter // 48, 3, k, 16, 1)
        expected = ops.silu_mul(linear(x, pack_weight(w)))
        got = silu_mul_linear(x, packed)
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))  # NaNs included
        if m == 9:
            assert got[4].isnan().all() and got[:4].isfinite().all()
    threads = torch.get_num_threads()
    try:
        for t in (1, 3):
            torch.set_num_threads(t)
            assert torch.equal(silu_mul_linear(x, packed), expected)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(unpack_weight(packed), w)


def test_no_native_means_no_fp32_packing(monkeypatch: pytest.MonkeyPatch) -> None:
    """COBATCH_NO_NATIVE=1: no library, no kernel, nothing packed (the pure-torch path)."""
    monkeypatch.setenv("COBATCH_NO_NATIVE", "1")
    monkeypatch.setattr(linear_module, "load_kernels", load_kernels.__wrapped__)  # uncached: reads the env
    assert native_gemm.__wrapped__(torch.float32) is None
    monkeypatch.setattr(linear_module, "native_gemm", native_gemm.__wrapped__)
    assert not can_pack(torch.zeros(32, 64))
