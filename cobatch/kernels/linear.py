"""bf16 linear layers on packed weights (csrc/gemm_bf16.c), F.linear for everything else.

One native kernel serves every batch size: decode steps (M = 1..64 rows, each weight streamed from DRAM
once) and prefill (thousands of rows, compute-bound). It needs the weight repacked once, at load time,
into panels of 16 output columns whose K pairs interleave (the layout vdpbf16ps consumes; the C file
explains it). scripts/linear_microbench.py measures it against oneDNN's F.linear (docs/BENCHMARKS.md).

`pack_weight` turns a [N, K] weight into the packed [N/16B, K/2, 16B, 2] tensor, B = 3 panels per block
where N/16 allows it, else 1 (a plain permutation: same bytes, no copy kept; the C file explains why
blocks of 3); `linear(x, weight, bias)` takes either layout: a packed weight goes to the
kernel, a [N, K] one to F.linear. The MLP's fused gate/up weight can take a third layout,
`pack_gate_up`'s [I/48, 2, K/2, 48, 2] (a gate block, then the same up block), which only
`silu_mul_linear` reads: the kernel applies SiLU-multiply to each tile as it computes it, so the
[M, 2I] gate/up output never goes through memory (the same bits as linear + silu_mul).
`embedding` looks rows up in either layout (a tied lm_head is packed together with the embedding
table). Weights are packed only where the kernel exists (AVX512-BF16, a compiler, COBATCH_NO_NATIVE
unset), for bf16 CPU weights with N % 16 == 0 and K even.

Numerics: each output is one fp32 sum over K in a fixed order, rounded once to bf16 (as F.linear rounds;
the kernel flushes denormal products to zero). The order depends on nothing but K: a row's bits do not
depend on the other rows of its batch, the tiling or the thread count.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
import torch.nn.functional as F

from cobatch.kernels.bindings import load_kernels
from cobatch.kernels.quant_linear import is_quantized, quantized_linear, quantized_rows

PANEL = 16  # output columns per packed panel (one AVX-512 vector of fp32 results)
BLOCK_PANELS = 3  # panels side by side in a packed block: the kernel's tile width (NZ in gemm_bf16.c)


class PackedGemm:
    """y = x @ W.T + bias for contiguous CPU bf16 x [M, K] and a packed W (csrc/gemm_bf16.c)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn, self._rows = lib.gemm_bf16, lib.packed_rows_bf16

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """[..., K] -> [..., N]."""
        out_features, in_features = packed_shape(packed)
        _check_input(x, in_features)
        if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (out_features,)):
            raise ValueError(f"packed linear takes a bf16 bias [{out_features}]")
        x = x.contiguous()
        bias = None if bias is None else bias.contiguous()  # kept alive across the call
        out = x.new_empty(*x.shape[:-1], out_features)
        rows = x.numel() // in_features
        if rows == 0:
            return out
        status = self._fn(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                          out.data_ptr(), rows, out_features, in_features, torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"gemm_bf16 failed with status {status}")
        return out

    def rows(self, ids: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight `packed` holds (an embedding lookup): [*ids.shape, K]."""
        out_features, in_features = packed_shape(packed)
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = packed.new_empty(flat.numel(), in_features)
        if self._rows(packed.data_ptr(), flat.data_ptr(), flat.numel(), out_features, in_features,
                      out.data_ptr()) != 0:
            raise IndexError(f"token id out of range [0, {out_features})")
        return out.view(*ids.shape, in_features)


class PackedGemmSilu:
    """silu(x @ Wg.T) * (x @ Wu.T) for contiguous CPU bf16 x [M, K] and a pack_gate_up weight
    (csrc/gemm_bf16.c, gemm_bf16_silu; the activation is fused_ops.c's silu_mul_rows_bf16)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.gemm_bf16_silu

    def __call__(self, x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., K] -> [..., I]."""
        two_inter, in_features = packed_shape(gate_up)
        _check_input(x, in_features)
        x = x.contiguous()
        out = x.new_empty(*x.shape[:-1], two_inter // 2)
        rows = x.numel() // in_features
        if rows == 0:
            return out
        status = self._fn(x.data_ptr(), gate_up.data_ptr(), out.data_ptr(), rows, two_inter // 2, in_features,
                          torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"gemm_bf16_silu failed with status {status}")
        return out


def _check_input(x: torch.Tensor, in_features: int) -> None:
    if x.dtype != torch.bfloat16 or x.shape[-1] != in_features or not x.is_cpu:
        raise ValueError(f"packed linear takes bf16 CPU input [..., {in_features}], got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")


@lru_cache(maxsize=1)
def native_gemm() -> PackedGemm | None:
    """The kernel, built on first use; None when native code is off, the build fails or the CPU lacks
    AVX512-BF16 (the C file then builds a stub that says so)."""
    lib = load_kernels()
    if lib is None or not lib.gemm_bf16_available():
        return None
    return PackedGemm(lib)


@lru_cache(maxsize=1)
def native_gemm_silu() -> PackedGemmSilu | None:
    """The fused gate/up + SiLU-multiply kernel, where the GEMM is (the same library holds both)."""
    lib = load_kernels()
    return None if native_gemm() is None or lib is None else PackedGemmSilu(lib)


def can_pack(weight: torch.Tensor) -> bool:
    """Whether `weight` [N, K] can take the packed layout and the kernel is here to use it."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.is_cpu
            and weight.shape[0] % PANEL == 0 and weight.shape[1] % 2 == 0 and native_gemm() is not None)


def block_columns(out_features: int) -> int:
    """Output columns per packed block: 3 panels when they divide N's panels, else 1 (the C kernel's
    block_panels rule: both sides must agree)."""
    return PANEL * (BLOCK_PANELS if (out_features // PANEL) % BLOCK_PANELS == 0 else 1)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> packed [N/C, K/2, C, 2], C = block_columns(N): packed[b, kk, c, t] = weight[C b + c, 2 kk + t]."""
    n, k = weight.shape
    c = block_columns(n)
    return weight.view(n // c, c, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def can_pack_gate_up(weight: torch.Tensor) -> bool:
    """Whether a [2I, K] gate/up weight can take pack_gate_up's layout (I a multiple of 48) and the fused
    kernel is here to read it."""
    return (can_pack(weight) and weight.shape[0] % (2 * PANEL * BLOCK_PANELS) == 0
            and native_gemm_silu() is not None)


def pack_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """[2I, K] (gate rows, then up rows) -> [I/C, 2, K/2, C, 2], C = 48: gate block j packed as pack_weight
    packs it, then up block j. The bytes are those of pack_weight applied to the rows reordered so; the
    kernel (gemm_bf16_silu) reads gate and up block j together."""
    n, k = weight.shape
    c = PANEL * BLOCK_PANELS
    blocks = weight.view(2, n // 2 // c, c, k).transpose(0, 1).reshape(n, k)  # gate 0, up 0, gate 1, ...
    return pack_weight(blocks).view(n // 2 // c, 2, k // 2, c, 2)


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_weight (and of pack_gate_up): [N, K]."""
    n, k = packed_shape(packed)
    if is_gate_up_packed(packed):
        blocks = packed.permute(0, 1, 3, 2, 4).reshape(-1, 2, packed.shape[3], k)  # [I/C, gate|up, C, K]
        return blocks.transpose(0, 1).reshape(n, k)
    return packed.permute(0, 2, 1, 3).reshape(n, k)


def is_packed(weight: torch.Tensor) -> bool:
    """pack_weight's layout (linear reads it)."""
    return weight.dim() == 4


def is_gate_up_packed(weight: torch.Tensor) -> bool:
    """pack_gate_up's layout (silu_mul_linear reads it)."""
    return weight.dim() == 5


def packed_shape(packed: torch.Tensor) -> tuple[int, int]:
    """(N, K) of the weight a packed (or gate/up packed) tensor holds."""
    if is_gate_up_packed(packed):
        return packed.shape[0] * 2 * packed.shape[3], packed.shape[2] * 2
    return packed.shape[0] * packed.shape[2], packed.shape[1] * 2


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for a [N, K] weight; the native kernel for a packed or quantized one."""
    if is_quantized(weight):
        return quantized_linear(x, weight, bias)
    if is_packed(weight):
        kernel = native_gemm()
        assert kernel is not None, "packed weights exist only where the kernel does"
        return kernel(x, weight, bias)
    return F.linear(x, weight, bias)


def silu_mul_linear(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x's projection by a pack_gate_up weight: [..., K] -> [..., I]."""
    kernel = native_gemm_silu()
    assert kernel is not None and is_gate_up_packed(gate_up), "gate/up packing exists only where the kernel does"
    return kernel(x, gate_up)


def embedding(ids: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """F.embedding(ids, weight) for a [V, H] table or a packed one: rows [*ids.shape, H]; a quantized
    table's rows are dequantized into `dtype` (the model's)."""
    if is_quantized(weight):
        return quantized_rows(ids, weight, dtype)
    if not is_packed(weight):
        return F.embedding(ids, weight)
    kernel = native_gemm()
    assert kernel is not None, "packed weights exist only where the kernel does"
    return kernel.rows(ids, weight)
