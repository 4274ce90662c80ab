"""Dense weights -> GGUF blocks (Q8_0, Q4_0, Q4_1, Q2_K, Q3_K, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, IQ4_NL, IQ4_XS,
TQ2_0), for `--quantization` and the test files; and IQ4_TAB, the kernel's own: IQ4_XS's blocks, each with 4 bytes
of a table of 16 values in eighths of d x scale (`with_table`; `dequantize` reads it back), IQ3_TAB16 (a scale per
16 weights and 3-bit indices into a table of 8: `pack_iq3_tab16`), IQ2_GRID (models/iq2_grid.py: IQ2_XXS's grid
kept) and IQ1_TRIT (models/iq1_trit.py: IQ1_S's weights as 2-bit codes).

The 32-weight formats and TQ2_0 use gguf-py's `gguf.quants.quantize`, the reference rounding of llama.cpp's
`quantize_row_q8_0_ref` / `quantize_row_q4_0_ref` / `quantize_row_tq2_0_ref` / ..., so a folder quantized here
holds the bytes llama-quantize's reference path writes. gguf-py has no K-quant quantizers: `quantize_k_with_mins` is a
plain one (each 32-weight sub-block's range mapped onto 0..15 for Q4_K, 0..31 for Q5_K, its scale and min
rounded to 6 bits of the super block's fp16 d and dmin), and so is `quantize_q6_k` (each 16-weight
sub-block's largest value mapped onto -32, its scale rounded to an int8 of the super block's d, as the
first step of llama.cpp's), and so is `quantize_q3_k` (the same with codes -4..3 and 6-bit scales),
`quantize_q2_k` (Q4_K's way on 16-weight sub-blocks, codes 0..3, 4-bit scales and mins), and
`quantize_iq4_xs` (each 32-weight sub-block's largest value mapped
onto the table's -127, its scale rounded to 6 bits of the super block's d, each weight to the nearest
table value) and `quantize_iq4_nl` (the same per 32-block, with an fp16 scale), all without llama.cpp's
iterative search for the best scale, so their error is somewhat larger; the formats and the bytes' meaning
are GGUF's (gguf-py dequantizes them, tested).
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from cobatch.kernels.quant_linear import FORMATS, QuantFormat
from cobatch.models import iq1_trit, iq2_grid

GGUF_TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
              "q4_k": gguf.GGMLQuantizationType.Q4_K, "q5_0": gguf.GGMLQuantizationType.Q5_0,
              "q6_k": gguf.GGMLQuantizationType.Q6_K, "q5_k": gguf.GGMLQuantizationType.Q5_K,
              "q4_1": gguf.GGMLQuantizationType.Q4_1, "q5_1": gguf.GGMLQuantizationType.Q5_1,
              "iq4_xs": gguf.GGMLQuantizationType.IQ4_XS, "iq4_nl": gguf.GGMLQuantizationType.IQ4_NL,
              "q3_k": gguf.GGMLQuantizationType.Q3_K, "q2_k": gguf.GGMLQuantizationType.Q2_K,
              "tq2_0": gguf.GGMLQuantizationType.TQ2_0}
# IQ4_NL's and IQ4_XS's 16 weight values per unit of scale (llama.cpp's kvalues_iq4nl).
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def format_of(tensor_type: gguf.GGMLQuantizationType) -> QuantFormat | None:
    """The kernel's format for a GGUF tensor type, None for types it does not serve."""
    return next((FORMATS[name] for name, t in GGUF_TYPES.items() if t == tensor_type), None)


def quantize(weight: torch.Tensor, name: str) -> torch.Tensor:
    """A dense [N, K] weight -> its GGUF blocks [N, K / block, block_bytes] (uint8) in format `name`."""
    fmt = FORMATS[name]
    values = weight.detach().to(torch.float32).numpy()
    if name in ("q4_k", "q5_k"):  # gguf-py's own quantizers stop at the 32-weight formats
        data = quantize_k_with_mins(values, 5 if name == "q5_k" else 4)
    elif name == "q6_k":
        data = quantize_q6_k(values)
    elif name == "iq4_xs":
        data = quantize_iq4_xs(values)
    elif name == "iq4_tab":  # IQ4_XS's rounding, and its table (in eighths: d x 8, exact)
        xs = quantize_iq4_xs(values).reshape(values.shape[0], -1, 136)
        xs[..., :2] = (xs[..., :2].view(np.float16) * np.float16(8)).view(np.uint8)
        data = with_table(xs, IQ4_VALUES)
    elif name == "iq4_tab16":  # the same, each 32-weight scale twice
        d, scale, index = _xs_fields(quantize_iq4_xs(values).reshape(values.shape[0], -1, 136))
        data = pack_iq4_tab16(d * np.float16(8), np.repeat(scale, 2, axis=-1), index, IQ4_VALUES)
    elif name == "iq3_tab16":  # Q3_K's rounding, its codes' values (in eighths) as the table
        d, sc, codes = _signed_sub_blocks(values, 4, 32)
        data = pack_iq3_tab16(d, sc, codes.reshape(*d.shape, 256), 8 * (np.arange(8, dtype=np.int16) - 4))
    elif name == "iq4_nl":
        data = quantize_iq4_nl(values)
    elif name == "iq2_grid":
        data = iq2_grid.quantize(values)
    elif name == "iq1_trit":
        data = iq1_trit.quantize(values)
    elif name == "q3_k":
        data = quantize_q3_k(values)
    elif name == "q2_k":
        data = quantize_q2_k(values)
    else:
        data = gguf.quants.quantize(values, GGUF_TYPES[name])
    return torch.from_numpy(np.ascontiguousarray(data)).view(weight.shape[0], -1, fmt.block_bytes)


def dequantize(blocks: torch.Tensor, name: str) -> torch.Tensor:
    """GGUF blocks [N, nb, block_bytes] -> the dense [N, K] fp32 weight (gguf-py's dequantization)."""
    if name in ("iq4_tab", "iq4_tab16"):
        return torch.from_numpy(dequantize_iq4_tab(blocks.numpy()))
    if name == "iq3_tab16":
        return torch.from_numpy(dequantize_iq3_tab16(blocks.numpy()))
    if name == "iq2_grid":
        return torch.from_numpy(iq2_grid.dequantize(blocks.numpy()))
    if name == "iq1_trit":
        return torch.from_numpy(iq1_trit.dequantize(blocks.numpy()))
    data = blocks.reshape(blocks.shape[0], -1).numpy()
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(data, GGUF_TYPES[name])))


def with_table(xs: np.ndarray, table: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks [N, nb, 136] whose 4-bit indices stand for `table`'s 16 values (integers -128..127, in
    eighths of d x scale) -> IQ4_TAB blocks [N, nb, 140]: row r's 4 more bytes are the table's (values + 128)
    4 (r % 4) ..: any 4 rows in a row (a panel's 16) hold it whole."""
    codes = (table.astype(np.int16) + 128).astype(np.uint8).reshape(4, 4)
    share = np.broadcast_to(codes[np.arange(xs.shape[0]) % 4][:, None, :], (*xs.shape[:2], 4))
    return np.concatenate([xs, share], axis=-1)


def pack_iq4_tab16(d: np.ndarray, sc: np.ndarray, index: np.ndarray, table: np.ndarray) -> np.ndarray:
    """IQ4_TAB16 blocks [n, sb, 152] from fp16 d [n, sb], int8 scales per 16 weights [n, sb, 16], 4-bit
    table indices [n, sb, 8, 32] and the table (as with_table): d | scales | qs as IQ4_XS's | share | 2 unused."""
    qs = (index[..., :16] | (index[..., 16:] << 4)).astype(np.uint8).reshape(*d.shape, 128)
    head = np.concatenate([d[..., None].view(np.uint8), sc.astype(np.int8).view(np.uint8), qs], axis=-1)
    out = with_table(head, table)
    return np.concatenate([out, np.zeros((*d.shape, 2), np.uint8)], axis=-1)


def _xs_fields(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IQ4_XS's (or IQ4_TAB's) blocks [n, nb, >= 136] -> fp16 d [n, nb], scales [n, nb, 8], indices [n, nb, 8, 32]."""
    d = blocks[..., :2].copy().view(np.float16)[..., 0]
    scales_h = blocks[..., 2:4].copy().view("<u2")  # [n, nb, 1]
    sub = np.arange(8)
    low = (blocks[..., 4 + sub // 2] >> (4 * (sub % 2))) & 0xF  # [n, nb, 8]
    scale = (low | (((scales_h >> (2 * sub)) & 3) << 4)).astype(np.int16) - 32
    return d, scale, _indices(blocks[..., 8:136])


def _indices(qs: np.ndarray) -> np.ndarray:
    """IQ4_XS's qs [n, nb, 128] -> the 4-bit indices [n, nb, 8, 32] (per 32-block: K 0..15 in the low
    nibbles, 16..31 in the high ones)."""
    qs = qs.reshape(*qs.shape[:2], 8, 16)
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def pack_iq3_tab16(d: np.ndarray, sc: np.ndarray, index: np.ndarray, table: np.ndarray) -> np.ndarray:
    """IQ3_TAB16 blocks [n, sb, 118] from fp16 d [n, sb], int8 scales per 16 weights [n, sb, 16], 3-bit table indices
    [n, sb, 256] (K order) and the table (at most 8 values, as with_table's): d | scales | hmask [32] | qs [64] as
    Q3_K's (K 128 h + 32 i + l: its low 2 bits at bit 2 i of qs[32 h + l], its third at bit 4 h + i of hmask[l]) |
    share."""
    codes = index.reshape(*d.shape, 2, 4, 32).astype(np.uint8)
    qs = ((codes & 3) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(axis=-2, dtype=np.uint8)  # [n, sb, 2, 32]
    bit = (4 * np.arange(2)[:, None] + np.arange(4)[None, :]).astype(np.uint8)[..., None]
    hmask = ((codes >> 2) << bit).sum(axis=(-3, -2), dtype=np.uint8)  # [n, sb, 32]
    head = np.concatenate([d[..., None].view(np.uint8), sc.astype(np.int8).view(np.uint8), hmask,
                           qs.reshape(*d.shape, 64)], axis=-1)
    return with_table(head, np.concatenate([table, np.zeros(16 - len(table), table.dtype)]))


def dequantize_iq3_tab16(blocks: np.ndarray) -> np.ndarray:
    """IQ3_TAB16 blocks [N, nb, 118] (N a multiple of 4) -> [N, nb * 256] fp32: d x scale x table[index] / 8 per
    16 weights, the table from the first 4 rows' shares."""
    n, nb = blocks.shape[:2]
    table = blocks[:4, :, 114:118].transpose(1, 0, 2).reshape(nb, 16).astype(np.float32) - 128  # [nb, 16]
    d, scale = blocks[..., :2].copy().view(np.float16)[..., 0], blocks[..., 2:18].view(np.int8)
    low = (blocks[..., 50:114].reshape(n, nb, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    bit = (4 * np.arange(2)[:, None] + np.arange(4)[None, :]).astype(np.uint8)[..., None]
    third = (blocks[..., None, None, 18:50] >> bit) & 1  # [n, nb, 2, 4, 32]
    index = (low | (third << 2)).reshape(n, nb, 1, 256).astype(np.int64)
    values = np.take_along_axis(table[None, :, None, :], index, axis=-1).reshape(n, nb, 16, 16)
    step = d.astype(np.float32)[..., None] * scale.astype(np.float32)
    return (step[..., None] * values / np.float32(8)).reshape(n, -1)


def dequantize_iq4_tab(blocks: np.ndarray) -> np.ndarray:
    """IQ4_TAB [N, nb, 140] or IQ4_TAB16 [N, nb, 152] blocks (N a multiple of 4) -> [N, nb * 256] fp32:
    d x scale x table[index] / 8 per 32 (16) weights, the table from the first 4 rows' shares."""
    n, nb = blocks.shape[:2]
    at = 136 if blocks.shape[-1] == 140 else 146
    table = blocks[:4, :, at:at + 4].transpose(1, 0, 2).reshape(nb, 16).astype(np.float32) - 128  # [nb, 16]
    if blocks.shape[-1] == 140:
        d, scale, index = _xs_fields(blocks)
    else:
        d, scale = blocks[..., :2].copy().view(np.float16)[..., 0], blocks[..., 2:18].view(np.int8)
        index = _indices(blocks[..., 18:146])
    values = np.take_along_axis(table[None, :, None, :], index.reshape(n, nb, 1, 256).astype(np.int64),
                                axis=-1).reshape(n, nb, scale.shape[-1], -1)
    step = d.astype(np.float32)[..., None] * scale.astype(np.float32)
    return (step[..., None] * values / np.float32(8)).reshape(n, -1)


def quantize_k_with_mins(values: np.ndarray, bits: int) -> np.ndarray:
    """[N, K] fp32 (K % 256 == 0) -> Q4_K bytes [N, K / 256 * 144] (bits 4) or Q5_K [N, K / 256 * 176] (5)."""
    n, k = values.shape
    top = (1 << bits) - 1
    sub = values.reshape(n, k // 256, 8, 32).astype(np.float32)
    low = np.minimum(sub.min(axis=-1), 0.0)  # each sub-block's range, holding 0 (a min >= 0 is subtracted)
    scale = (sub.max(axis=-1) - low) / top
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)  # [n, sb]
    dmin = ((-low).max(axis=-1) / 63.0).astype(np.float16)
    sc = _ratio(scale, d).clip(0, 63).astype(np.uint8)  # [n, sb, 8]
    mn = _ratio(-low, dmin).clip(0, 63).astype(np.uint8)
    a = d.astype(np.float32)[..., None] * sc  # the weights as stored: a * code - b
    b = dmin.astype(np.float32)[..., None] * mn
    codes = _ratio(sub + b[..., None], a[..., None]).clip(0, top).astype(np.uint8)  # [n, sb, 8, 32]
    chunks = (codes & 0xF).reshape(n, k // 256, 4, 2, 32)
    qs = (chunks[..., 0, :] | (chunks[..., 1, :] << 4)).reshape(n, k // 256, 128)
    head = [d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), _pack_scales(sc, mn)]
    if bits == 5:  # qh: bit s of byte l holds the fifth bit of sub-block s's code l
        head.append(((codes >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=-2, dtype=np.uint8))
    return np.concatenate([*head, qs], axis=-1).reshape(n, -1)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """[N, K] fp32 (K % 256 == 0) -> Q6_K bytes [N, K / 256 * 210]."""
    return pack_q6_k(*_signed_sub_blocks(values, 32, 128))


def pack_q6_k(d: np.ndarray, sc: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Q6_K's parts -> its bytes [N, K / 256 * 210]: d [n, sb] fp16, the 16 sub-block scales [n, sb, 16]
    (-128..127), the codes + 32 [n, sb, half, quarter, l] (uint8 0..63: GGUF's order of a super block's)."""
    n, blocks = d.shape
    lo, hi = codes & 0xF, codes >> 4
    ql = np.concatenate([lo[..., 0, :] | (lo[..., 2, :] << 4), lo[..., 1, :] | (lo[..., 3, :] << 4)], axis=-1)
    qh = hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)
    out = np.concatenate([ql.reshape(n, blocks, 128), qh.reshape(n, blocks, 64), sc.astype(np.int8).view(np.uint8),
                          d[..., None].view(np.uint8)], axis=-1)
    return out.reshape(n, -1)


def quantize_q3_k(values: np.ndarray) -> np.ndarray:
    """[N, K] fp32 (K % 256 == 0) -> Q3_K bytes [N, K / 256 * 110]."""
    n, k = values.shape
    d, sc, codes = _signed_sub_blocks(values, 4, 32)
    low, third = codes & 3, codes >> 2
    qs = (low << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(axis=-2, dtype=np.uint8)  # [n, sb, 2, 32]
    bit = (4 * np.arange(2)[:, None] + np.arange(4)[None, :]).astype(np.uint8)[..., None]  # bit 4 half + i
    hmask = (third << bit).sum(axis=(-3, -2), dtype=np.uint8)  # [n, sb, 32]
    ls = (sc + 32).astype(np.uint8)  # [n, sb, 16]: 6 bits each
    low4, top2 = ls & 0xF, ls >> 4
    scales = np.concatenate([low4[..., 0:4] | (low4[..., 8:12] << 4), low4[..., 4:8] | (low4[..., 12:16] << 4),
                             top2[..., 0:4] | (top2[..., 4:8] << 2) | (top2[..., 8:12] << 4) | (top2[..., 12:16] << 6)],
                            axis=-1)
    out = np.concatenate([hmask, qs.reshape(n, k // 256, 64), scales, d[..., None].view(np.uint8)], axis=-1)
    return out.reshape(n, -1)


def quantize_q2_k(values: np.ndarray) -> np.ndarray:
    """[N, K] fp32 (K % 256 == 0) -> Q2_K bytes [N, K / 256 * 84]."""
    n, k = values.shape
    sub = values.reshape(n, k // 256, 16, 16).astype(np.float32)
    low = np.minimum(sub.min(axis=-1), 0.0)  # each sub-block's range, holding 0, onto codes 0..3
    scale = (sub.max(axis=-1) - low) / 3.0
    d = (scale.max(axis=-1) / 15.0).astype(np.float16)  # [n, sb]: scales and mins in 4 bits
    dmin = ((-low).max(axis=-1) / 15.0).astype(np.float16)
    sc = _ratio(scale, d).clip(0, 15).astype(np.uint8)  # [n, sb, 16]
    mn = _ratio(-low, dmin).clip(0, 15).astype(np.uint8)
    a = d.astype(np.float32)[..., None] * sc  # the weights as stored: a * code - b
    b = dmin.astype(np.float32)[..., None] * mn
    codes = _ratio(sub + b[..., None], a[..., None]).clip(0, 3).astype(np.uint8)
    return pack_q2_k(d, dmin, sc, mn, codes.reshape(n, k // 256, 256))


def pack_q2_k(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, mn: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Q2_K's parts -> its bytes [N, K / 256 * 84]: d, dmin [n, sb] fp16, the 16 sub-block scales and mins
    [n, sb, 16] (0..15), the codes [n, sb, 256] (0..3, in K order): w = d sc code - dmin mn."""
    out = np.concatenate([sc | (mn << 4), pack_2bit_codes(codes), d[..., None].view(np.uint8),
                          dmin[..., None].view(np.uint8)], axis=-1)
    return out.reshape(d.shape[0], -1)


def pack_2bit_codes(codes: np.ndarray) -> np.ndarray:
    """2-bit codes [n, sb, 256] (0..3, in K order) -> Q2_K's and TQ2_0's qs [n, sb, 64]: K 128 h + 32 i + l at
    bits 2 i of byte 32 h + l."""
    quarters = codes.reshape(*codes.shape[:2], 2, 4, 32)
    qs = (quarters << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(axis=-2, dtype=np.uint8)  # [n, sb, 2, 32]
    return qs.reshape(*codes.shape[:2], 64)


def quantize_iq4_xs(values: np.ndarray) -> np.ndarray:
    """[N, K] fp32 (K % 256 == 0) -> IQ4_XS bytes [N, K / 256 * 136]."""
    n, k = values.shape
    sub = values.reshape(n, k // 256, 8, 32).astype(np.float32)
    scale = _signed_absmax(sub) / -127.0  # the sub-block's largest value -> the table's -127   [n, sb, 8]
    d = (_signed_absmax(scale) / -32.0).astype(np.float16)  # the largest scale -> -32   [n, sb]
    sc = _ratio(scale, d).clip(-32, 31).astype(np.int16)
    step = d.astype(np.float32)[..., None] * sc  # each sub-block's weight per table unit
    with np.errstate(divide="ignore", invalid="ignore"):
        units = np.where(step[..., None] != 0, sub / np.where(step[..., None] != 0, step[..., None], 1.0), 0.0)
    return pack_iq4_xs(d, sc, _iq4_indices(units)).reshape(n, -1)


def pack_iq4_xs(d: np.ndarray, sc: np.ndarray, index: np.ndarray) -> np.ndarray:
    """IQ4_XS's fields -> its blocks [n, sb, 136]: fp16 d [n, sb], scales -32..31 [n, sb, 8], 4-bit table
    indices [n, sb, 8, 32]."""
    ls = (sc + 32).astype(np.uint16)  # 6 bits each
    scales_h = ((ls >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=-1, dtype=np.uint16)
    scales_l = ((ls[..., 0::2] & 0xF) | ((ls[..., 1::2] & 0xF) << 4)).astype(np.uint8)
    qs = (index[..., :16] | (index[..., 16:] << 4)).astype(np.uint8).reshape(*d.shape, 128)
    return np.concatenate([d[..., None].view(np.uint8), scales_h[..., None].view(np.uint8), scales_l, qs], axis=-1)


def quantize_iq4_nl(values: np.ndarray) -> np.ndarray:
    """[N, K] fp32 (K % 32 == 0) -> IQ4_NL bytes [N, K / 32 * 18]."""
    n, k = values.shape
    sub = values.reshape(n, k // 32, 32).astype(np.float32)
    d = (_signed_absmax(sub) / -127.0).astype(np.float16)  # the block's largest value -> the table's -127
    step = np.broadcast_to(d.astype(np.float32)[..., None], sub.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        units = np.where(step != 0, sub / np.where(step != 0, step, 1.0), 0.0)
    index = _iq4_indices(units)
    qs = index[..., :16] | (index[..., 16:] << 4)  # K 0..15 in the low nibbles, 16..31 in the high ones
    return np.concatenate([d[..., None].view(np.uint8), qs], axis=-1).reshape(n, -1)


def _iq4_indices(units: np.ndarray) -> np.ndarray:
    """Values in units of their block's scale -> their nearest table entries' indices (uint8)."""
    table = IQ4_VALUES.astype(np.float32)
    return np.searchsorted((table[1:] + table[:-1]) / 2, units).astype(np.uint8)


def _signed_sub_blocks(values: np.ndarray, code_min: int, scale_min: int) -> tuple[np.ndarray, ...]:
    """Q6_K's and Q3_K's rounding: [N, K] (K % 256 == 0) in 16-weight sub-blocks, each sub-block's largest value
    mapped onto code -code_min, the largest scale onto -scale_min. Returns the fp16 d [n, sb], the integer
    scales [n, sb, 16] (int16) and the codes + code_min [n, sb, half, quarter, l] (uint8: GGUF's order)."""
    n, k = values.shape
    sub = values.reshape(n, k // 256, 16, 16).astype(np.float32)
    scale = _signed_absmax(sub) / -code_min  # [n, sb, 16]
    d = (_signed_absmax(scale) / -scale_min).astype(np.float16)  # [n, sb]
    sc = _ratio(scale, d).clip(-scale_min, scale_min - 1).astype(np.int16)
    step = d.astype(np.float32)[..., None] * sc  # each sub-block's weight per code step
    codes = _ratio(sub, step).clip(-code_min, code_min - 1) + code_min
    return d, sc, codes.astype(np.uint8).reshape(n, k // 256, 2, 4, 32)


def _signed_absmax(values: np.ndarray) -> np.ndarray:
    """The entry of largest magnitude along the last axis, with its sign."""
    at = np.abs(values).argmax(axis=-1)[..., None]
    return np.take_along_axis(values, at, axis=-1)[..., 0]


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """round(num / den), 0 where den is 0."""
    den = np.broadcast_to(den.astype(np.float32)[..., None] if den.ndim < num.ndim else den, num.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den != 0, np.round(num / np.where(den != 0, den, 1.0)), 0.0)


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins -> GGUF's 12 bytes (llama.cpp's get_scale_min_k4 reads them back)."""
    out = np.zeros((*sc.shape[:-1], 12), dtype=np.uint8)
    out[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 0xF) | ((mn[..., 4:8] & 0xF) << 4)
    return out
