"""bf16 linear layers at small M (decode steps) with a native kernel (csrc/linear_bf16.c), else F.linear.

At decode, M (sequences in the batch) is small and a step streams every weight matrix from DRAM once;
torch's F.linear (oneDNN) reads bf16 weights at ~10-15 GB/s there, the native kernel at ~25-30 GB/s (the
machine's read bandwidth) and stays faster up to the compute-bound sizes (numbers: scripts/
linear_microbench.py). It reads the weights in their stored [N, K] layout: no repacked copy.

`linear(x, weight, bias)` is a drop-in for F.linear: it takes the kernel when x, weight (and bias) are
contiguous CPU bf16 tensors, no autograd is recording and the row count is at most MAX_ROWS; anything
else (other dtypes, devices, strides, COBATCH_NO_NATIVE=1, a CPU without AVX512-BF16, no compiler) goes
to F.linear. Results match F.linear up to fp32 summation order (each output rounded once to bf16; the
kernel flushes denormals to zero), and a row's result does not depend on the other rows of its batch or
on the thread count.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
import torch.nn.functional as F

from cobatch.models.native import load_library

# Largest M (rows of x) sent to the kernel: the measured crossover vs F.linear (weights not in cache,
# SmolLM2-135M shapes, scripts/linear_microbench.py). At 2 threads the kernel is 1.01-1.09x at M = 256,
# about even at 384, 0.88-0.93x at 512; at 1 thread even at 256 (lm_head 0.95x). Prefill-sized M stays
# on oneDNN, whose blocked GEMM is made for it.
MAX_ROWS = 256

_PTR, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class NativeLinear:
    """y = x @ weight.T + bias for contiguous CPU bf16 x [M, K], weight [N, K], bias [N] (csrc/linear_bf16.c)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.linear_bf16
        self._fn.argtypes = [_PTR] * 4 + [_I64] * 3 + [_INT]
        self._fn.restype = _INT

    @staticmethod
    def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
        """Whether the kernel takes these operands (any M; `linear` adds the M limit). Plain attribute
        checks: this runs ~120 times per decode step, where a few microseconds each would show."""
        bf16 = torch.bfloat16
        if not (x.dtype == bf16 and weight.dtype == bf16 and x.is_cpu and weight.is_cpu
                and x.is_contiguous() and weight.is_contiguous() and weight.dim() == 2 and x.dim() >= 1
                and x.shape[-1] == weight.shape[1] and x.numel() > 0):
            return False
        if bias is not None and not (bias.dtype == bf16 and bias.is_cpu and bias.is_contiguous()
                                     and bias.shape == (weight.shape[0],)):
            return False
        recording = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                 or (bias is not None and bias.requires_grad))
        return not recording

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """[..., K] -> [..., N]; the caller has checked `supports`."""
        out_features, in_features = weight.shape
        out = x.new_empty(*x.shape[:-1], out_features)
        status = self._fn(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                          out.data_ptr(), x.numel() // in_features, out_features, in_features, torch.get_num_threads())
        if status != 0:
            raise RuntimeError("linear_bf16 is not available on this CPU")
        return out


@lru_cache(maxsize=1)
def native_linear() -> NativeLinear | None:
    """The kernel, built on first use; None when native code is off, the build fails or the CPU lacks
    AVX512-BF16 (the C file then builds a stub that says so)."""
    lib = load_library("linear_bf16")
    if lib is None or not lib.linear_bf16_available():
        return None
    return NativeLinear(lib)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), by the native kernel where it is faster (see the module docstring)."""
    kernel = native_linear()
    if kernel is not None and kernel.supports(x, weight, bias) and x.numel() <= MAX_ROWS * x.shape[-1]:
        return kernel(x, weight, bias)
    return F.linear(x, weight, bias)
