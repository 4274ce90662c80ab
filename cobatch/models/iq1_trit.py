"""IQ1_TRIT: IQ1_S's weights as the file holds them, in a row block the kernel packs (csrc/gemm_quant.c).

An IQ1_S 256-block is an fp16 d, and per 32 weights a 3-bit ls, a delta sign and 4 grid indices (11 bits
each, one of llama.cpp's 2048 patterns of 8 values in -1, 0, 1): w = d (2 ls + 1) (g + delta), delta = +-1/8.
Its grid need not be looked up at all: each weight's g + 1 is a 2-bit code c, and with s = 2 ls + 1
w = d s c - d / 8 x s (8 - 8 delta), Q4_K's scale-and-min form over Q2_K's codes. IQ1_TRIT's row block
(70 bytes, 2.19 bits a weight, against IQ4_TAB's 4.375 and the file's 1.56) keeps every weight exactly:

    d (fp16) | scales [4]: byte b's low nibble sub-block b's ls | 8 where its delta is negative, its high
    nibble sub-block 4 + b's | qs [64]: Q2_K's, the code of weight 128 n + 32 i + l at bits 2 i of byte 32 n + l
"""

from __future__ import annotations

import functools

import gguf
import numpy as np

# A scale nibble's min, s (8 - 8 delta) (gemm_quant.c's T1_MIN): 7 s, or 9 s where the delta is negative.
_NIBBLE = np.arange(16)
MINS = ((2 * (_NIBBLE & 7) + 1) * np.where(_NIBBLE & 8, 9, 7)).astype(np.float32)


@functools.cache
def grid() -> np.ndarray:
    """IQ1_S's 2048 grid entries [2048, 8] (fp32 -1, 0, 1), as gguf-py holds them."""
    gguf.quants.IQ1_S.init_grid()
    return np.asarray(gguf.quants.IQ1_S.grid, np.float32).reshape(2048, 8)


def from_iq1_s(data: np.ndarray) -> np.ndarray:
    """IQ1_S bytes [N, K / 256 * 50] -> IQ1_TRIT blocks [N, K / 256, 70] of the same weights."""
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(n, -1, 50)  # d | qs [32] | qh [8] u16
    qh = blocks[..., 34:50].copy().view("<u2")  # [n, sb, 8]: 3 high index bits x 4, ls, the delta's sign
    nibble = ((qh >> 12) & 7) | ((qh >> 15) << 3)
    high = (qh[..., None] >> (3 * np.arange(4, dtype=np.uint16))) & 7  # [n, sb, 8, 4]
    index = blocks[..., 2:34].reshape(*high.shape).astype(np.uint16) | (high << 8)
    codes = (grid()[index] + 1).astype(np.uint8)  # [n, sb, 8, 4, 8]: g + 1
    return pack(blocks[..., :2].copy().view(np.float16)[..., 0], nibble, codes.reshape(n, -1, 256))


def pack(d: np.ndarray, nibble: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Row blocks [n, sb, 70] from fp16 d [n, sb], scale nibbles [n, sb, 8] (ls | 8 for a negative delta) and
    2-bit codes [n, sb, 256]."""
    n, sb = d.shape
    scales = (nibble[..., :4] | (nibble[..., 4:] << 4)).astype(np.uint8)
    quarters = codes.reshape(n, sb, 2, 4, 32).astype(np.uint8) << (2 * np.arange(4, dtype=np.uint8))[:, None]
    qs = np.bitwise_or.reduce(quarters, axis=-2).reshape(n, sb, 64)
    return np.concatenate([d[..., None].view(np.uint8), scales, qs], axis=-1)


def dequantize(blocks: np.ndarray) -> np.ndarray:
    """IQ1_TRIT blocks [N, nb, 70] -> [N, nb * 256] fp32: d s c - d / 8 min, exact (IQ1_S's values)."""
    n, nb = blocks.shape[:2]
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)[..., None]  # [n, nb, 1]
    nibble = np.concatenate([blocks[..., 2:6] & 0xF, blocks[..., 2:6] >> 4], axis=-1)  # [n, nb, 8]
    a = d * (2 * (nibble & 7) + 1).astype(np.float32)
    b = d * np.float32(0.125) * MINS[nibble]
    quarters = blocks[..., None, None, 6:].reshape(n, nb, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]
    codes = (quarters & 3).astype(np.float32).reshape(n, nb, 8, 32)
    return (a[..., None] * codes - b[..., None]).reshape(n, nb * 256)


def quantize(values: np.ndarray) -> np.ndarray:
    """[N, K] fp32 (K % 256 == 0) -> IQ1_TRIT blocks [N, K / 256, 70] (quantize_iq1_s's weights)."""
    return from_iq1_s(quantize_iq1_s(values))


def quantize_iq1_s(values: np.ndarray) -> np.ndarray:
    """[N, K] fp32 (K % 256 == 0) -> IQ1_S bytes [N, K / 256 * 50]: per 32 weights the scale that maps its
    largest magnitude nearest to 2 (clipped there: on Gaussian weights a relative error of 46%, against 59% with
    it at 9/8, the largest value), then of the two deltas the one whose nearest grid entries (least squares, per
    8 weights) fit it better. Plain rounding (llama.cpp's search is finer, with an importance matrix): for
    tests, test files and A/B runs."""
    n, k = values.shape
    sub = values.reshape(n, k // 256, 8, 32).astype(np.float32)
    amax = np.abs(sub).max(axis=-1)  # [n, sb, 8]
    d = (amax.max(axis=-1) / (15 * 2.0)).astype(np.float16)  # the largest scale, 15, fits the largest
    df = d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        odd = np.where(df > 0, amax / (2.0 * np.where(df > 0, df, 1)), 1.0)
    ls = np.clip(np.round((odd - 1) / 2), 0, 7).astype(np.uint16)
    step = df * (2 * ls + 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        units = np.where(step[..., None] > 0, sub / np.where(step > 0, step, 1)[..., None], 0.0)
    units = units.reshape(n, -1, 8, 4, 8)
    fits = [_nearest_entries(units - delta) for delta in (0.125, -0.125)]  # (index, squared error) each
    negative = fits[1][1].sum(axis=-1) < fits[0][1].sum(axis=-1)  # [n, sb, 8]
    index = np.where(negative[..., None], fits[1][0], fits[0][0]).astype(np.uint16)  # [n, sb, 8, 4]
    high = ((index >> 8) << (3 * np.arange(4, dtype=np.uint16))).sum(axis=-1, dtype=np.uint16)
    qh = high | (ls << 12) | (negative.astype(np.uint16) << 15)
    parts = [d[..., None].view(np.uint8), (index & 0xFF).astype(np.uint8).reshape(n, -1, 32), qh.view(np.uint8)]
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def _nearest_entries(units: np.ndarray, chunk: int = 1 << 14) -> tuple[np.ndarray, np.ndarray]:
    """The grid entry nearest each 8 of units [..., 8] (least squares) and its squared error, [...] each."""
    entries = grid()
    norms = (entries**2).sum(axis=-1)
    flat = units.reshape(-1, 8)
    index = np.empty(len(flat), np.int64)
    for at in range(0, len(flat), chunk):
        index[at:at + chunk] = (norms - 2 * flat[at:at + chunk] @ entries.T).argmin(axis=-1)
    error = ((flat - entries[index]) ** 2).sum(axis=-1)
    return index.reshape(units.shape[:-1]), error.reshape(units.shape[:-1])
