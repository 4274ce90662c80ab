"""models/requantize.py: GGUF matrices of types the kernel does not serve become served blocks, IQ3_XXS and
IQ3_S as Q6_K with the very values gguf-py dequantizes them to, the rest as Q8_0; the loader takes that way
for them and counts IQ3 files as served."""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch

from cobatch.models.loader import _gguf_tensor, _mostly_served
from cobatch.models.quantization import dequantize
from cobatch.models.requantize import EXACT_IN_Q6_K, to_q6_k, to_served

IQ3 = sorted(EXACT_IN_Q6_K, key=lambda t: t.name)


def _random_blocks(kind: gguf.GGMLQuantizationType, rows: int, k: int, d: list[float]) -> np.ndarray:
    """Valid blocks of `kind` (any bytes are: grid indices, signs and scales) with each block's fp16 d drawn
    from `d`, [rows, K / 256 * block bytes]."""
    size = gguf.GGML_QUANT_SIZES[kind][1]
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, size=(rows, k // 256, size), dtype=np.uint8)
    scales = rng.choice(np.array(d, dtype=np.float16), size=(rows, k // 256))
    blocks[..., :2] = scales[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("kind", IQ3, ids=lambda t: t.name)
def test_iq3_becomes_q6_k_exactly(kind: gguf.GGMLQuantizationType) -> None:
    """Every value, also for d = 0, negative d and every ls, code and sign the random bytes reach."""
    data = _random_blocks(kind, 32, 1024, [0.01, -0.37, 0.0, 3.5e-3, 1.0])
    blocks = to_q6_k(data, kind)
    assert blocks is not None and blocks.shape == (32, 4, 210)
    assert torch.equal(dequantize(blocks, "q6_k"), torch.from_numpy(gguf.quants.dequantize(data, kind)))


def test_iq3_xxs_whose_halved_d_is_not_fp16_falls_back_to_q8_0() -> None:
    """IQ3_XXS's Q6_K d is d / 2: for a subnormal d that is an odd multiple of fp16's smallest step that
    is no fp16, so to_served writes Q8_0 (whose own fp16 scales are then as coarse)."""
    kind = gguf.GGMLQuantizationType.IQ3_XXS
    data = _random_blocks(kind, 16, 256, [0.01, 3 * 2.0**-24])
    assert to_q6_k(data, kind) is None
    assert to_served(data, kind).shape == (16, 8, 34)


def test_other_types_become_q8_0() -> None:
    kind = gguf.GGMLQuantizationType.IQ2_XXS
    data = _random_blocks(kind, 16, 512, [0.02])
    want = torch.from_numpy(gguf.quants.dequantize(data, kind))
    blocks = to_served(data, kind)
    assert blocks.shape == (16, 16, 34)
    block_max = want.abs().reshape(16, -1, 32).amax(-1, keepdim=True)
    error = (dequantize(blocks, "q8_0") - want).abs().reshape(16, -1, 32)
    assert (error <= block_max * (1 / 254 + 1 / 1024)).all()


@pytest.mark.parametrize("kind", IQ3, ids=lambda t: t.name)
def test_the_loader_keeps_iq3_as_q6_k_and_counts_it_served(kind: gguf.GGMLQuantizationType) -> None:
    data = _random_blocks(kind, 16, 512, [0.05])
    tensor = SimpleNamespace(data=data, tensor_type=kind, shape=np.array([512, 16]), n_bytes=data.nbytes)
    weight = _gguf_tensor(tensor, torch.float32, keep_blocks=True)
    assert weight.shape == (16, 2, 210)
    assert torch.equal(dequantize(weight, "q6_k"), torch.from_numpy(gguf.quants.dequantize(data, kind)))
    other = SimpleNamespace(shape=[64, 64], n_bytes=data.nbytes // 2, tensor_type=gguf.GGMLQuantizationType.IQ2_XS)
    assert _mostly_served([tensor, other])
    assert not _mostly_served([SimpleNamespace(**{**vars(tensor), "n_bytes": data.nbytes // 4}), other])
