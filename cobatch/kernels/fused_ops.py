"""Fused elementwise ops of the decoder layer (csrc/fused_ops.c), with eager-torch equivalents.

`FusedOps` calls the native kernels when they are built and the tensors are contiguous CPU fp32/bf16;
otherwise (GPU, fp16, COBATCH_NO_NATIVE=1, no compiler) the same functions run as plain torch ops. Both
paths round like HF's formulas in the model dtype, so bf16 results agree bit for bit (tests check it).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
import torch.nn.functional as F

from cobatch.kernels.bindings import load_kernels

_NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ROPE_MAX_HEAD_DIM = 512  # ROPE_MAX_HALF in csrc/fused_ops.c


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back, like the HF reference: [T, H] -> [T, H]."""
    # The weight multiply stays in the model dtype, as in HF.
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up: [T, 2 I] -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               num_heads: int, head_dim: int) -> None:
    """Rotate-half RoPE (HF layout) in place on the first `num_heads` heads of each row of x [T, >= nh hd]."""
    heads = x[:, :num_heads * head_dim].view(x.shape[0], num_heads, head_dim)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, hd / 2]
    x1, x2 = heads.chunk(2, dim=-1)
    heads.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))


class FusedOps:
    """add_rms_norm, silu_mul, rope, head_rms_norm (and greedy's argmax) for one model dtype: native where
    possible, else eager torch."""

    def __init__(self, lib: ctypes.CDLL | None) -> None:
        """lib: the kernels library, bound (bindings.load_kernels); None: eager torch only."""
        self._lib = lib

    @property
    def native(self) -> bool:
        return self._lib is not None

    def _use_native(self, *tensors: torch.Tensor) -> bool:
        return self._lib is not None and all(
            t.device.type == "cpu" and t.dtype in _NATIVE_DTYPES and t.is_contiguous() for t in tensors)

    def add_rms_norm(self, x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """residual += x in place (when x is given), then return RMSNorm(residual) * weight: [T, H]."""
        if not self._use_native(residual, weight, *(() if x is None else (x,))):
            if x is not None:
                residual.add_(x)
            return rms_norm(residual, weight, eps)
        out = torch.empty_like(residual)
        self._lib.add_rms_norm(None if x is None else x.data_ptr(), residual.data_ptr(), weight.data_ptr(),
                               out.data_ptr(), residual.shape[0], residual.shape[1], eps,
                               _NATIVE_DTYPES[residual.dtype])
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up: [T, 2 I] -> [T, I]."""
        if not self._use_native(gate_up):
            return silu_mul_torch(gate_up)
        rows, width = gate_up.shape
        out = gate_up.new_empty(rows, width // 2)
        self._lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, _NATIVE_DTYPES[gate_up.dtype])
        return out

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
             num_heads: int, head_dim: int) -> None:
        """RoPE in place on the first `num_heads` heads of each row of x [T, W]; cos/sin [max_pos, hd / 2]."""
        if (not self._use_native(x, cos, sin) or head_dim > _ROPE_MAX_HEAD_DIM
                or positions.dtype != torch.int64 or not positions.is_contiguous()):
            rope_torch(x, cos, sin, positions, num_heads, head_dim)
            return
        self._lib.rope_inplace(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                               x.shape[0], x.shape[1], num_heads, head_dim, _NATIVE_DTYPES[x.dtype])

    def head_rms_norm(self, x: torch.Tensor, first_head: int, num_heads: int, head_dim: int, weight: torch.Tensor,
                      eps: float) -> None:
        """RMSNorm(head) * weight in place on heads first_head .. first_head + num_heads of each row of x
        [T, W] (Qwen3's q_norm / k_norm on the fused QKV output)."""
        if not self._use_native(x, weight):
            heads = x[:, first_head * head_dim:(first_head + num_heads) * head_dim]
            heads.copy_(rms_norm(heads.reshape(-1, head_dim), weight, eps).view(heads.shape))
            return
        start = x.data_ptr() + first_head * head_dim * x.element_size()
        self._lib.head_rms_norm(start, weight.data_ptr(), x.shape[0], x.shape[1], num_heads, head_dim, eps,
                                _NATIVE_DTYPES[x.dtype])

    def argmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [R, V] -> (max [R] fp32, first index of it [R]): torch.max(dim=-1) in one native pass
        (torch's bf16/fp32 max reduction runs at ~2 G values/s; this at memory speed). A row with a NaN
        has max NaN, as in torch; its index is then not meaningful."""
        if not self._use_native(logits) or logits.dim() != 2 or logits.shape[1] >= 2 ** 31:
            best, index = logits.max(dim=-1)
            return best.float(), index
        rows, cols = logits.shape
        best = torch.empty(rows, dtype=torch.float32)
        index = torch.empty(rows, dtype=torch.int64)
        self._lib.argmax_rows(logits.data_ptr(), rows, cols, _NATIVE_DTYPES[logits.dtype], index.data_ptr(),
                              best.data_ptr())
        return best, index


@lru_cache(maxsize=1)
def fused_ops() -> FusedOps:
    """The process's fused ops: native when the kernels library builds here, eager torch otherwise."""
    return FusedOps(load_kernels())


EAGER = FusedOps(None)  # the pure-torch path (tests, A/B)
