"""GGUF matrices in types the quantized kernel does not serve -> blocks of a type it does, at load.

A file mostly in served formats can hold a few matrices in others (llama-quantize's mixes), and a fused
projection's parts can be in three formats; they become blocks of a served type rather than dense copies
(4-5x their bytes, streamed every step). Where the values fit a served type exactly, they are converted
without loss: Q4_0, Q5_0 and IQ4_NL to Q8_0 (one fp16 scale per 32 weights, integer codes within int8),
IQ1_S to IQ1_TRIT (its ternary grid values as 2-bit codes, 2.19 bits a weight: models/iq1_trit.py), IQ2_XXS,
IQ3_XXS and IQ3_S to IQ4_TAB (their weights are an fp16 d times an integer scale per 32 weights times one of at
most 16 grid values: IQ4_XS's layout with that table, at 4.375 bits a weight against Q8_0's 8.5; IQ2_XXS to
IQ2_GRID instead, its own grid at 2.25 bits, where the CPU has AVX-512 VBMI: models/iq2_grid.py), the ternary
TQ1_0 (d times -1, 0 or 1, 5 to a byte) to TQ2_0 (2-bit codes, 2.06 bits, which the kernel serves as it is);
IQ2_XS, IQ2_S and IQ1_M (a scale per 16 weights, 6 values) to IQ3_TAB16 (IQ4_TAB16's scales and table with 3-bit
indices in Q3_K's layout: 3.69 bits, against IQ4_TAB16's 4.75, which a 16-value table with a scale per 16 weights
would take). Every other type
(MXFP4, NVFP4, ...) is requantized to Q8_0 from its dequantized values.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from cobatch.kernels.quant_linear import native_quant_gemm
from cobatch.models import iq1_trit, iq2_grid
from cobatch.models.quantization import (IQ4_VALUES, pack_2bit_codes, pack_iq3_tab16, pack_iq4_tab16, pack_iq4_xs,
                                         quantize, with_table)

_TYPE = gguf.GGMLQuantizationType
EXACT_IN_Q8_0 = frozenset((_TYPE.Q4_0, _TYPE.Q5_0, _TYPE.IQ4_NL))
# IQ4_TAB's types: their grid's magnitudes in eighths of d x s (the table holds both signs)
TABLES = {_TYPE.IQ2_XXS: np.array([8, 25, 43], np.int16), _TYPE.IQ1_S: np.array([1, 7, 9], np.int16),
          _TYPE.IQ3_XXS: np.array([8, 24, 40, 56, 72, 88, 104, 124], np.int16),
          _TYPE.IQ3_S: np.arange(8, 121, 16, dtype=np.int16),
          _TYPE.IQ2_XS: np.array([8, 25, 43], np.int16), _TYPE.IQ2_S: np.array([8, 25, 43], np.int16),
          _TYPE.IQ1_M: np.array([1, 7, 9], np.int16),
          # ternary, with 0 in the table (searched as -0): should to_tq2_0 not hold a TQ1_0 matrix
          _TYPE.TQ1_0: np.array([0, 8, 16], np.int16)}
# the types whose fp16 d is their blocks' last 2 bytes: the ternary ones (TQ2_0 served as it is, TQ1_0 as TQ2_0)
D_LAST = frozenset((_TYPE.TQ1_0, _TYPE.TQ2_0))
# those with a scale per 16 weights: IQ3_TAB16 (IQ4_TAB16 for a table of more than 8 values)
PER_16 = frozenset((_TYPE.IQ2_XS, _TYPE.IQ2_S, _TYPE.IQ1_M))


def to_served(data: np.ndarray, tensor_type: gguf.GGMLQuantizationType) -> torch.Tensor:
    """A GGUF matrix [N, row bytes] of a type the kernel does not serve -> IQ1_TRIT blocks [N, K / 256, 70] for
    IQ1_S; IQ2_GRID blocks [N, K / 256, 72] for IQ2_XXS where the kernel looks its grid up at speed; TQ2_0 blocks
    [N, K / 256, 66] for TQ1_0; else IQ4_TAB blocks [N, K / 256, 140] holding its values exactly where
    to_iq4_tab can, else Q8_0 blocks [N, K / 32, 34] (to_q8_0)."""
    kernel = native_quant_gemm()
    if tensor_type == _TYPE.IQ1_S:
        return torch.from_numpy(iq1_trit.from_iq1_s(data))
    if tensor_type == _TYPE.IQ2_XXS and kernel is not None and kernel.byte_lookups:
        return torch.from_numpy(iq2_grid.from_iq2_xxs(data))
    blocks = to_tq2_0(data) if tensor_type == _TYPE.TQ1_0 else None
    if blocks is None and tensor_type in TABLES:
        blocks = to_iq4_tab(data, tensor_type)
    return blocks if blocks is not None else to_q8_0(data, tensor_type)


def to_tq2_0(data: np.ndarray) -> torch.Tensor | None:
    """A TQ1_0 matrix [N, row bytes] -> TQ2_0 blocks [N, K / 256, 66] of the same values (None should one not come
    back exactly): both are w = d (c - 1), TQ1_0's c in 0..2 packed 5 to a byte in base 3, TQ2_0's 2 bits each; 2.06
    bits a weight where TQ1_0 has 1.69, served without an unpacking per weight. The codes come from gguf-py's
    dequantized values."""
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(n, -1, gguf.GGML_QUANT_SIZES[_TYPE.TQ1_0][1])
    d = _d(blocks, _TYPE.TQ1_0)  # [n, sb]
    values = gguf.quants.dequantize(data, _TYPE.TQ1_0).reshape(n, d.shape[1], 256)
    step = np.broadcast_to(d.astype(np.float32)[..., None], values.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(step != 0, np.round(values / np.where(step != 0, step, 1.0)), 0.0) + 1
    codes = codes.clip(0, 3).astype(np.uint8)
    if not np.array_equal(step * (codes.astype(np.float32) - 1), values):
        return None
    return torch.from_numpy(np.concatenate([pack_2bit_codes(codes), d[..., None].view(np.uint8)], axis=-1))


def to_q8_0(data: np.ndarray, tensor_type: gguf.GGMLQuantizationType) -> torch.Tensor:
    """A GGUF matrix [N, row bytes] of any type -> Q8_0 blocks [N, K / 32, 34]: exact for Q4_0, Q5_0 and
    IQ4_NL (d kept, code - offset or the table's value as the int8), else gguf-py's Q8_0 quantization of
    its dequantized values (an error of at most half of each 32-block's max / 127)."""
    if tensor_type not in EXACT_IN_Q8_0:
        values = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, tensor_type)))
        return quantize(values, "q8_0")
    blocks = np.ascontiguousarray(data).reshape(data.shape[0], -1, gguf.GGML_QUANT_SIZES[tensor_type][1])
    qs = blocks[..., -16:]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int16)  # K 0..15, then 16..31
    if tensor_type == _TYPE.Q5_0:
        qh = blocks[..., 2:6].copy().view("<u4")  # bit j: the fifth bit of code j
        codes |= (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int16)
        codes -= 16
    elif tensor_type == _TYPE.IQ4_NL:
        codes = IQ4_VALUES[codes].astype(np.int16)
    else:
        codes -= 8
    out = np.concatenate([blocks[..., :2], codes.astype(np.int8).view(np.uint8)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(out))


def to_iq4_tab(data: np.ndarray, tensor_type: gguf.GGMLQuantizationType) -> torch.Tensor | None:
    """An IQ2_XXS, IQ1_S, IQ3_XXS, IQ3_S or TQ1_0 matrix [N, row bytes] -> IQ4_TAB blocks
    [N, K / 256, 140] of the same values; an IQ2_XS, IQ2_S or IQ1_M one (6 values) -> IQ3_TAB16 blocks
    [N, K / 256, 118] (IQ4_TAB16 [N, K / 256, 152] past 8 values) (None, then Q8_0, should one not come back
    exactly).

    Each is w = d x s x c / 8 per 32 weights (16: PER_16): d the file's fp16 d, s = 2 ls + 1 (ls: the type's
    3- or 4-bit scale), c one of at most 16 integers (TABLES: IQ4_TAB's table is in eighths):
    IQ2_XXS: w = d (0.5 + ls) / 4 x g, g in +-{8, 25, 43};  IQ1_S: w = d (2 ls + 1) (g +- 1/8), g in {-1, 0, 1};
    IQ3_XXS: w = d (0.5 + ls) / 2 x g, g in +-{4, 12, ..., 52, 62};  IQ3_S: w = d (1 + 2 ls) x g, g odd, |g| < 16;
    IQ2_XS, IQ2_S as IQ2_XXS, IQ1_M as IQ1_S (its delta per 8 weights, its d in its scales' top bits);
    TQ1_0: w = d x (c - 1), c in 0..2, ls = 0.
    The codes come from gguf-py's dequantized values (exact products in fp32), checked to give them back."""
    magnitudes = TABLES[tensor_type]
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(n, -1, gguf.GGML_QUANT_SIZES[tensor_type][1])
    d = _d(blocks, tensor_type)  # [n, sb]
    scale = 2 * _sub_block_ls(blocks, tensor_type).astype(np.int16) + 1  # [n, sb, 8 or 16]
    table = np.concatenate([-magnitudes[::-1], magnitudes, np.zeros(16 - 2 * len(magnitudes), np.int16)])
    values = gguf.quants.dequantize(data, tensor_type).reshape(n, -1, scale.shape[-1], 256 // scale.shape[-1])
    step = d.astype(np.float32)[..., None, None] * scale[..., None] / np.float32(8)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(step != 0, values / np.where(step != 0, step, 1.0), 0.0)
    index = np.searchsorted(table[:2 * len(magnitudes)], codes).clip(0, 15)
    if not np.array_equal(table[index] * step, values):
        return None
    index = index.reshape(n, -1, 8, 32)
    if tensor_type in PER_16 and 2 * len(magnitudes) <= 8:  # 3-bit indices: IQ3_TAB16
        return torch.from_numpy(pack_iq3_tab16(d, scale, index.reshape(n, -1, 256), table[:8])).view(n, -1, 118)
    if tensor_type in PER_16:
        return torch.from_numpy(pack_iq4_tab16(d, scale, index, table)).view(n, -1, 152)
    xs = pack_iq4_xs(d, scale, index)
    return torch.from_numpy(np.ascontiguousarray(with_table(xs, table))).view(n, -1, 140)


def _d(blocks: np.ndarray, tensor_type: gguf.GGMLQuantizationType) -> np.ndarray:
    """Each block's fp16 d [n, sb]: its first 2 bytes (D_LAST: its last), IQ1_M's the top 4 bits of its 4
    scale words."""
    if tensor_type in D_LAST:
        return blocks[..., -2:].copy().view(np.float16)[..., 0]
    if tensor_type != _TYPE.IQ1_M:
        return blocks[..., :2].copy().view(np.float16)[..., 0]
    words = blocks[..., 48:56].copy().view("<u2")  # qs [32] | qh [16] | scales [4] u16
    bits = (words >> 12).astype(np.uint16) << (4 * np.arange(4, dtype=np.uint16))
    return bits.sum(axis=-1, dtype=np.uint16).view(np.float16)


def _sub_block_ls(blocks: np.ndarray, tensor_type: gguf.GGMLQuantizationType) -> np.ndarray:
    """Each 32-weight sub-block's ls [n, sb, 8] from the type's blocks [n, sb, block bytes]."""
    n, sb = blocks.shape[:2]
    if tensor_type in D_LAST:  # no scale: ls = 0 is a scale of 1
        return np.zeros((n, sb, 8), np.uint8)
    if tensor_type == _TYPE.IQ2_XXS:  # d | 8 x (4 grid indices | 4 x 7 sign bits, ls in bits 28..31)
        return blocks[..., 2:66].copy().view("<u4").reshape(n, sb, 8, 2)[..., 1] >> 28
    if tensor_type == _TYPE.IQ1_S:  # d | qs [32] | qh [8] u16: ls in bits 12..14
        return (blocks[..., 34:50].copy().view("<u2") >> 12) & 7
    if tensor_type == _TYPE.IQ3_XXS:  # d | grid indices [64] | 8 words: signs, ls in bits 28..31
        return blocks[..., 66:98].copy().view("<u4") >> 28
    if tensor_type == _TYPE.IQ1_M:  # qs [32] | qh [16] | 4 u16: ls of 16-block 4 w + i in bits 3 i .. of word w
        words = blocks[..., 48:56].copy().view("<u2")[..., None] >> (3 * np.arange(4, dtype=np.uint16))
        return (words & 7).reshape(n, sb, 16)
    # IQ3_S: ... | scales [4] at 106, IQ2_XS: at 66 [8], IQ2_S: at 74 [8]; ls of block 2 i + h in nibble h of byte i
    at, count = {_TYPE.IQ3_S: (106, 4), _TYPE.IQ2_XS: (66, 8), _TYPE.IQ2_S: (74, 8)}[tensor_type]
    scales = blocks[..., at:at + count]
    return np.stack([scales & 0xF, scales >> 4], axis=-1).reshape(n, sb, 2 * count)
