"""models/requantize.py: GGUF matrices of types the kernel does not serve become served blocks, IQ2_XXS,
IQ1_S, IQ3_XXS and IQ3_S as IQ4_TAB, IQ2_XS, IQ2_S and IQ1_M as IQ3_TAB16, IQ2_XXS as IQ2_GRID
where the CPU has VBMI, IQ1_S as IQ1_TRIT, TQ1_0 as TQ2_0 (which is served as it is), with the very values gguf-py
dequantizes them to, the rest (MXFP4 here) as Q8_0; the loader takes that way for them and counts such files as
served."""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from cobatch.kernels.quant_linear import native_quant_gemm
from cobatch.models import iq1_trit, iq2_grid
from cobatch.models.loader import _gguf_tensor, _mostly_served
from cobatch.models.quantization import dequantize
from cobatch.models.requantize import D_LAST, PER_16, TABLES, to_iq4_tab, to_served, to_tq2_0

GRIDS = sorted(TABLES, key=lambda t: t.name)


def _random_blocks(kind: gguf.GGMLQuantizationType, rows: int, k: int, d: list[float]) -> np.ndarray:
    """Valid blocks of `kind` (any bytes are: grid indices, signs and scales) with each block's fp16 d drawn
    from `d`, [rows, K / 256 * block bytes]."""
    size = gguf.GGML_QUANT_SIZES[kind][1]
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, size=(rows, k // 256, size), dtype=np.uint8)
    bits = rng.choice(np.array(d, dtype=np.float16), size=(rows, k // 256)).view(np.uint16)
    if kind == gguf.GGMLQuantizationType.IQ1_M:  # d: the top 4 bits of its 4 scale words (at 48)
        words = blocks[..., 48:56].copy().view("<u2")
        nibbles = (bits[..., None] >> (4 * np.arange(4, dtype=np.uint16))) & 0xF
        blocks[..., 48:56] = ((words & 0x0FFF) | (nibbles << 12).astype(np.uint16)).view(np.uint8)
    elif kind in D_LAST:
        blocks[..., -2:] = bits[..., None].view(np.uint8)
    else:
        blocks[..., :2] = bits[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", GRIDS, ids=lambda t: t.name)
def test_grid_types_become_iq4_tab_exactly(kind: gguf.GGMLQuantizationType) -> None:
    """Every value, also for d = 0, negative d, subnormal d (whose d / 8 is no fp16: IQ4_TAB keeps d, its table
    is in eighths) and every ls, grid entry, sign (IQ1_S: delta) the random bytes reach."""
    data = _random_blocks(kind, 32, 1024, [0.01, -0.37, 0.0, 3.5e-3, 1.0, 3 * 2.0**-24, 1.5e-4])
    blocks = to_iq4_tab(data, kind)
    fmt, size = ("iq3_tab16", 118) if kind in PER_16 else ("iq4_tab", 140)
    assert blocks is not None and blocks.shape == (32, 4, size)
    assert torch.equal(dequantize(blocks, fmt), torch.from_numpy(gguf.quants.dequantize(data, kind)))


def test_other_types_become_q8_0() -> None:
    kind = gguf.GGMLQuantizationType.MXFP4  # a power of 2 per 32 weights times one of 15 values: no served type
    data = gguf.quants.quantize(np.random.default_rng(3).normal(0, 0.02, (16, 512)).astype(np.float32), kind)
    want = torch.from_numpy(gguf.quants.dequantize(data, kind))
    blocks = to_served(data, kind)
    assert blocks.shape == (16, 16, 34)
    block_max = want.abs().reshape(16, -1, 32).amax(-1, keepdim=True)
    error = (dequantize(blocks, "q8_0") - want).abs().reshape(16, -1, 32)
    assert (error <= block_max * (1 / 254 + 1 / 1024)).all()


def test_iq2_xxs_becomes_iq2_grid_exactly() -> None:
    """IQ2_GRID (the kernel's own grid lookups) holds IQ2_XXS's every value too, at 72 bytes a 256-block: the
    eighth sign bit each 7 leave out (their parity) written out, the scale in IQ4_XS's fields."""
    kind = gguf.GGMLQuantizationType.IQ2_XXS
    data = _random_blocks(kind, 32, 1024, [0.01, -0.37, 0.0, 3.5e-3, 1.0, 3 * 2.0**-24, 1.5e-4])
    blocks = torch.from_numpy(iq2_grid.from_iq2_xxs(data))
    assert blocks.shape == (32, 4, 72)
    assert torch.equal(dequantize(blocks, "iq2_grid"), torch.from_numpy(gguf.quants.dequantize(data, kind)))


def test_iq1_s_becomes_iq1_trit_exactly() -> None:
    """IQ1_TRIT (2-bit codes g + 1, Q4_K's scale-and-min sums) holds IQ1_S's every value, at 70 bytes a
    256-block: every grid entry, ls and delta sign the random bytes reach, d = 0, negative and subnormal."""
    kind = gguf.GGMLQuantizationType.IQ1_S
    data = _random_blocks(kind, 32, 1024, [0.01, -0.37, 0.0, 3.5e-3, 1.0, 3 * 2.0**-24, 1.5e-4])
    blocks = torch.from_numpy(iq1_trit.from_iq1_s(data))
    assert blocks.shape == (32, 4, 70)
    assert torch.equal(dequantize(blocks, "iq1_trit"), torch.from_numpy(gguf.quants.dequantize(data, kind)))
    assert torch.equal(to_served(data, kind), blocks)


def test_tq1_0_becomes_tq2_0_exactly() -> None:
    """TQ2_0 (2-bit codes, the same d) holds TQ1_0's every value (d (c - 1)), at 66 bytes a 256-block: every code the
    random bytes reach, d = 0, negative and subnormal; a TQ2_0 matrix is kept as it is."""
    kind = gguf.GGMLQuantizationType.TQ1_0
    data = _random_blocks(kind, 32, 1024, [0.01, -0.37, 0.0, 3.5e-3, 1.0, 3 * 2.0**-24, 1.5e-4])
    blocks = to_tq2_0(data)
    assert blocks is not None and blocks.shape == (32, 4, 66)
    assert torch.equal(dequantize(blocks, "tq2_0"), torch.from_numpy(gguf.quants.dequantize(data, kind)))
    assert torch.equal(to_served(data, kind), blocks)
    tq2 = _random_blocks(gguf.GGMLQuantizationType.TQ2_0, 16, 512, [0.05, -1.0])  # every code, 3 (= 2 d) too
    tensor = SimpleNamespace(data=tq2, tensor_type=gguf.GGMLQuantizationType.TQ2_0, shape=np.array([512, 16]))
    assert torch.equal(_gguf_tensor(tensor, torch.float32, keep_blocks=True), torch.from_numpy(tq2).view(16, 2, 66))


@pytest.mark.parametrize("kind", GRIDS, ids=lambda t: t.name)
def test_the_loader_keeps_grid_types_as_iq4_tab_and_counts_them_served(kind: gguf.GGMLQuantizationType) -> None:
    """IQ1_S as IQ1_TRIT, IQ2_XXS as IQ2_GRID where the kernel has VBMI's byte lookups, IQ2_XS, IQ2_S and IQ1_M as
    IQ3_TAB16, TQ1_0 as TQ2_0, every grid type else as IQ4_TAB."""
    data = _random_blocks(kind, 16, 512, [0.05])
    tensor = SimpleNamespace(data=data, tensor_type=kind, shape=np.array([512, 16]), n_bytes=data.nbytes)
    weight = _gguf_tensor(tensor, torch.float32, keep_blocks=True)
    fmt, size = ("iq3_tab16", 118) if kind in PER_16 else ("iq4_tab", 140)
    kernel = native_quant_gemm()
    if kind == gguf.GGMLQuantizationType.IQ2_XXS and kernel is not None and kernel.byte_lookups:
        fmt, size = "iq2_grid", 72
    if kind == gguf.GGMLQuantizationType.IQ1_S:
        fmt, size = "iq1_trit", 70
    if kind == gguf.GGMLQuantizationType.TQ1_0:
        fmt, size = "tq2_0", 66
    assert weight.shape == (16, 2, size)
    assert torch.equal(dequantize(weight, fmt), torch.from_numpy(gguf.quants.dequantize(data, kind)))
    other = SimpleNamespace(shape=[64, 64], n_bytes=data.nbytes // 2, tensor_type=gguf.GGMLQuantizationType.MXFP4)
    assert _mostly_served([tensor, other])
    assert not _mostly_served([SimpleNamespace(**{**vars(tensor), "n_bytes": data.nbytes // 4}), other])
