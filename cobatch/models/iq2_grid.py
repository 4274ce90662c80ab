"""IQ2_GRID: IQ2_XXS's weights as the file holds them, in a row block the kernel packs (csrc/gemm_quant.c).

An IQ2_XXS 256-block is an fp16 d, and per 32 weights a 4-bit ls and 4 grid indices (8 weights each, one of
llama.cpp's 256 patterns of the magnitudes 8, 25 and 43) with 7 sign bits per index (the eighth is their
parity): w = d (2 ls + 1) / 8 x sign x g. IQ2_GRID's row block (72 bytes, 2.25 bits a weight) keeps all of
it, with the scale 2 ls + 1 in IQ4_XS's d and scale fields and the eighth sign bit written out:

    d (fp16) | scales_h (u16) | scales_l [4] (IQ4_XS's: scale + 32, 6 bits) |
    per 32-block: grid indices [4] | signs [4] (bit k of byte i: weight 8 i + k is negative)

The kernel serves it on CPUs with AVX-512 VBMI (byte lookups of the grid: `byte_lookups`); elsewhere the
loader holds IQ2_XXS as IQ4_TAB (requantize.py), the same values in 4.375 bits a weight.
"""

from __future__ import annotations

import functools

import gguf
import numpy as np


@functools.cache
def grid() -> np.ndarray:
    """IQ2_XXS's 256 grid entries [256, 8] (fp32 magnitudes 8, 25, 43), as gguf-py holds them."""
    gguf.quants.IQ2_XXS.init_grid()
    return np.asarray(gguf.quants.IQ2_XXS.grid, np.float32).reshape(256, 8)


def from_iq2_xxs(data: np.ndarray) -> np.ndarray:
    """IQ2_XXS bytes [N, K / 256 * 66] -> IQ2_GRID blocks [N, K / 256, 72] of the same weights."""
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(n, -1, 66)
    words = blocks[..., 2:].copy().view("<u4").reshape(n, -1, 8, 2)  # per 32-block: indices | signs, ls
    seven = (words[..., 1:2] >> (7 * np.arange(4, dtype=np.uint32))) & 0x7F  # [n, sb, 8, 4]
    parity = np.bitwise_count(seven.astype(np.uint8)) & 1
    signs = (seven | (parity << 7)).astype(np.uint8)
    scale = 2 * (words[..., 1] >> 28).astype(np.int16) + 1
    d = blocks[..., :2].copy().view(np.float16)[..., 0]
    return pack(d, scale, words[..., 0:1].copy().view(np.uint8), signs)


def pack(d: np.ndarray, scale: np.ndarray, index: np.ndarray, signs: np.ndarray) -> np.ndarray:
    """Row blocks [n, sb, 72] from fp16 d [n, sb], odd scales 1..31 [n, sb, 8], grid indices [n, sb, 8, 4] and
    sign bytes [n, sb, 8, 4] (uint8)."""
    ls = (scale + 32).astype(np.uint16)  # IQ4_XS's 6-bit fields
    scales_h = ((ls >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=-1, dtype=np.uint16)
    scales_l = ((ls[..., 0::2] & 0xF) | ((ls[..., 1::2] & 0xF) << 4)).astype(np.uint8)
    groups = np.concatenate([index.astype(np.uint8), signs], axis=-1).reshape(*d.shape, 64)
    return np.concatenate([d[..., None].view(np.uint8), scales_h[..., None].view(np.uint8), scales_l, groups],
                          axis=-1)


def dequantize(blocks: np.ndarray) -> np.ndarray:
    """IQ2_GRID blocks [N, nb, 72] -> [N, nb * 256] fp32 (exact: d x scale / 8 x an integer)."""
    n, nb = blocks.shape[:2]
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [n, nb]
    scales_h = blocks[..., 2:4].copy().view("<u2")
    sub = np.arange(8)
    low = (blocks[..., 4 + sub // 2] >> (4 * (sub % 2))) & 0xF
    scale = (low | (((scales_h >> (2 * sub)) & 3) << 4)).astype(np.float32) - 32  # [n, nb, 8]
    groups = blocks[..., 8:].reshape(n, nb, 8, 2, 4)
    magnitude = grid()[groups[..., 0, :]]  # [n, nb, 8, 4, 8]
    negative = (groups[..., 1, :, None] >> np.arange(8, dtype=np.uint8)) & 1
    step = d[..., None] * scale / np.float32(8)
    values = np.where(negative == 1, -magnitude, magnitude) * step[..., None, None]
    return values.reshape(n, nb * 256)


def quantize(values: np.ndarray) -> np.ndarray:
    """[N, K] fp32 (K % 256 == 0) -> IQ2_GRID blocks [N, K / 256, 72] (quantize_iq2_xxs's weights)."""
    return from_iq2_xxs(quantize_iq2_xxs(values))


def quantize_iq2_xxs(values: np.ndarray) -> np.ndarray:
    """[N, K] fp32 (K % 256 == 0) -> IQ2_XXS bytes [N, K / 256 * 66]: per 32 weights the odd scale that maps
    its largest magnitude nearest to 43, each 8 weights' magnitudes to the nearest grid entry (least squares),
    their signs kept but for an odd count of negatives, where the smallest weight's sign flips (IQ2_XXS keeps
    7 sign bits and their parity, as llama.cpp's quantizer). Plain rounding (llama.cpp's search is finer): for
    tests, test files and A/B runs."""
    n, k = values.shape
    sub = values.reshape(n, k // 256, 8, 32).astype(np.float32)
    amax = np.abs(sub).max(axis=-1)  # [n, sb, 8]
    d = (amax.max(axis=-1) * 8 / (43 * 31)).astype(np.float16)  # the largest scale, 31, fits the largest
    df = d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        odd = np.where(df > 0, amax * 8 / (43 * np.where(df > 0, df, 1)), 1.0)
    ls = np.clip(np.round((odd - 1) / 2), 0, 15).astype(np.uint32)
    step = df * (2 * ls + 1) / np.float32(8)
    groups = sub.reshape(n, -1, 8, 4, 8)
    with np.errstate(divide="ignore", invalid="ignore"):
        units = np.abs(groups) / np.where(step > 0, step, 1)[..., None, None]
    index = _nearest_entries(units.reshape(-1, 8)).reshape(units.shape[:-1])
    negative = groups < 0
    odd_count = negative.sum(axis=-1) % 2 == 1
    smallest = np.abs(groups).argmin(axis=-1)[..., None] == np.arange(8)
    negative ^= odd_count[..., None] & smallest
    seven = (negative[..., :7] << np.arange(7, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)  # [n, sb, 8, 4]
    signs = (seven << (7 * np.arange(4, dtype=np.uint32))).sum(axis=-1, dtype=np.uint32) | (ls << 28)
    words = np.stack([index.astype(np.uint8).copy().view("<u4")[..., 0], signs], axis=-1)  # [n, sb, 8, 2]
    return np.concatenate([d[..., None].view(np.uint8), words.reshape(n, -1, 16).view(np.uint8)],
                          axis=-1).reshape(n, -1)


def _nearest_entries(units: np.ndarray, chunk: int = 1 << 16) -> np.ndarray:
    """The grid entry nearest each row of units [G, 8] (least squares: |g|^2 - 2 u.g), chunk rows at a time."""
    entries = grid()
    norms = (entries**2).sum(axis=-1)
    index = np.empty(len(units), np.uint8)
    for at in range(0, len(units), chunk):
        index[at:at + chunk] = (norms - 2 * units[at:at + chunk] @ entries.T).argmin(axis=-1)
    return index
