"""GGUF matrices in types the quantized kernel does not serve -> blocks of a type it does, at load.

A file mostly in served formats can hold a few matrices in others (llama-quantize's mixes), and a fused
projection's parts can differ in format; they become blocks of a served type rather than dense copies
(4-5x their bytes, streamed every step). Where the values fit a served type exactly, they are converted
without loss: Q4_0, Q5_0 and IQ4_NL to Q8_0 (one fp16 scale per 32 weights, integer codes within int8),
IQ3_XXS and IQ3_S to Q6_K (their weights are an fp16 d times an integer scale per 32 weights times a
signed grid value: in Q6_K's terms d' x scale x code with |code| <= 31, at 6.56 bits a weight against
Q8_0's 8.5). Every other type is requantized to Q8_0 from its dequantized values.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from cobatch.models.quantization import IQ4_VALUES, pack_q6_k, quantize

_TYPE = gguf.GGMLQuantizationType
EXACT_IN_Q8_0 = frozenset((_TYPE.Q4_0, _TYPE.Q5_0, _TYPE.IQ4_NL))
EXACT_IN_Q6_K = frozenset((_TYPE.IQ3_XXS, _TYPE.IQ3_S))


def to_served(data: np.ndarray, tensor_type: gguf.GGMLQuantizationType) -> torch.Tensor:
    """A GGUF matrix [N, row bytes] of a type the kernel does not serve -> Q6_K blocks [N, K / 256, 210]
    holding its values exactly where to_q6_k can, else Q8_0 blocks [N, K / 32, 34] (to_q8_0)."""
    blocks = to_q6_k(data, tensor_type) if tensor_type in EXACT_IN_Q6_K else None
    return blocks if blocks is not None else to_q8_0(data, tensor_type)


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


def to_q6_k(data: np.ndarray, tensor_type: gguf.GGMLQuantizationType) -> torch.Tensor | None:
    """An IQ3_XXS or IQ3_S matrix [N, row bytes] -> Q6_K blocks [N, K / 256, 210] of the same values, or
    None where a block's d' is not exact in fp16 (a d near fp16's smallest: then to_q8_0).

    IQ3_XXS: w = d (1 + 2 ls) / 4 x g, g in +-{4, 12, ..., 52, 62}: d' = d / 2, code g / 2.
    IQ3_S:   w = d (1 + 2 ls) x g, g in +-{1, 3, ..., 15}: d' = d, code g.
    Both: ls (4 bits) per 32 weights, so both 16-weight halves take the scale 1 + 2 ls (1..31). The codes
    come from gguf-py's dequantized values (exact products of d, the scale and g in fp32)."""
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(n, -1, gguf.GGML_QUANT_SIZES[tensor_type][1])
    d = blocks[..., :2].copy().view(np.float16)[..., 0]  # [n, sb]
    if tensor_type == _TYPE.IQ3_XXS:  # d | grid indices [64] | 8 words: signs, ls in bits 28..31
        ls = blocks[..., 66:98].copy().view("<u4") >> 28
        d_q6 = (d.astype(np.float32) / 2).astype(np.float16)
        if not np.array_equal(d_q6.astype(np.float32) * 2, d.astype(np.float32)):
            return None
    else:  # IQ3_S: d | qs [64] | qh [8] | signs [32] | scales [4]: ls of 32-block 2 i + h in nibble h of byte i
        scales = blocks[..., 106:110]
        ls, d_q6 = np.stack([scales & 0xF, scales >> 4], axis=-1).reshape(n, -1, 8), d
    scale = (1 + 2 * ls.astype(np.int16))  # [n, sb, 8]
    values = gguf.quants.dequantize(data, tensor_type).reshape(n, -1, 8, 32)
    step = d_q6.astype(np.float32)[..., None, None] * scale[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(step != 0, np.round(values / np.where(step != 0, step, 1.0)), 0.0)
    if np.abs(codes).max(initial=0) > 31 or not np.array_equal(codes * step, values):
        return None
    q6 = pack_q6_k(d_q6, np.repeat(scale, 2, axis=-1), (codes + 32).astype(np.uint8).reshape(n, -1, 2, 4, 32))
    return torch.from_numpy(q6).view(n, -1, 210)
