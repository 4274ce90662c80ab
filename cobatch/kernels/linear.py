"""bf16 and fp32 linear layers on packed weights (csrc/gemm_bf16.c, csrc/gemm_f32.c, and bf16 weights under fp32
activations: csrc/gemm_f32_wbf16.c), F.linear for the rest.

One native kernel per dtype serves every batch size: decode steps (M = 1..64 rows, each weight streamed
from DRAM once) and prefill (thousands of rows, compute-bound); in bf16 on a CPU with AMX its tiles run
on the tile unit (use_amx; on a 1B model 2.8x a batch of 16, 5x a prefill). It needs the weight repacked
once, at load time, into panels of 16 output columns, one 64-byte line per K step: a K pair in bf16 (the layout
vdpbf16ps consumes), one K value in fp32 (vfmadd231ps against a broadcast x); the C files and their
shared gemm_packed.h explain it. scripts/linear_microbench.py measures it against oneDNN's F.linear
(docs/BENCHMARKS.md).

`pack_weight` turns a [N, K] weight into the packed [N/16B, K/t, 16B, t] tensor, t = STEP[dtype] (bf16 2,
fp32 1), B = 3 panels per block where N/16 allows it in bf16, else 1 (a plain permutation: same bytes, no
copy kept; the C files explain why blocks of 3 in bf16 and single panels in fp32). A bf16 weight packed
for fp32 activations (`activations=torch.float32`: weight-only bf16, where the CPU lacks AVX512-BF16 and
the model computes in fp32) takes single panels too; gemm_f32_wbf16.c widens it to fp32 in registers, so
a decode step streams bf16's bytes for fp32 math. `linear(x, weight, bias)` takes either layout: a packed
weight goes to the kernel of its dtype and x's, a [N, K] one to F.linear. The MLP's fused gate/up weight can
take a third layout, `pack_gate_up`'s [2I/48, 48/C, K/t, C, t] (a gate block, then the same up block),
which only `silu_mul_linear` reads: the kernel applies SiLU-multiply to each tile as it computes it, so
the [M, 2I] gate/up output never goes through memory (the same bits as linear + silu_mul).
`embedding` looks rows up in either layout (a tied lm_head is packed together with the embedding
table). Weights are packed only where the kernel of their dtype exists (bf16: AVX512-BF16, fp32 and
weight-only bf16: AVX-512F or AVX2 + FMA; a compiler; COBATCH_NO_NATIVE unset), for CPU weights with N % 16 == 0 (and K
even in bf16).

Numerics: each output is one fp32 sum over K in a fixed order (bf16: rounded once to bf16, as F.linear
rounds; that kernel flushes denormal products to zero; weight-only bf16: the fp32 kernel's sums on the
upcast weight, which is exact). The order depends on nothing but K: a row's
bits do not depend on the other rows of its batch, the tiling or the thread count. F.linear's own
order differs (fp32: equal within summation error, not bit for bit).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
import torch.nn.functional as F

from cobatch.kernels.bindings import load_kernels
from cobatch.kernels.quant_linear import is_quantized, quantized_linear, quantized_rows

PANEL = 16  # output columns per packed panel (one AVX-512 vector of fp32 results)
BLOCK_PANELS = 3  # panels side by side in a packed block: the kernel's tile width (NZ in gemm_packed.h)
# K values one 64-byte panel line holds (the last dimension of the packed layout): a bf16 K pair for
# vdpbf16ps, a single fp32 value for vfmadd231ps.
STEP = {torch.bfloat16: 2, torch.float32: 1}
# The C entry points' suffix per (activations, weight) dtype: f32_wbf16 keeps bf16 weights under fp32 math.
_PREFIX = {(torch.bfloat16, torch.bfloat16): "bf16", (torch.float32, torch.float32): "f32",
           (torch.float32, torch.bfloat16): "f32_wbf16"}


class PackedGemm:
    """y = x @ W.T + bias for contiguous CPU x [M, K] of `dtype` and a packed W of `weight_dtype` (bf16:
    csrc/gemm_bf16.c, fp32: csrc/gemm_f32.c, fp32 on bf16 weights: csrc/gemm_f32_wbf16.c)."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype, weight_dtype: torch.dtype | None = None) -> None:
        self.dtype, self.weight_dtype = dtype, weight_dtype or dtype
        prefix = _PREFIX[dtype, self.weight_dtype]
        self._fn, self._rows = getattr(lib, f"gemm_{prefix}"), getattr(lib, f"packed_rows_{prefix}")

    def reads(self, packed: torch.Tensor) -> bool:
        """Whether `packed` (either packed layout) is in this kernel's weight dtype and block width."""
        n, _ = packed_shape(packed)
        columns = packed.shape[3] if is_gate_up_packed(packed) else packed.shape[2]
        return packed.dtype == self.weight_dtype and columns == block_columns(n, packed.dtype, self.dtype)

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """[..., K] -> [..., N]."""
        out_features, in_features = packed_shape(packed)
        _check_input(x, in_features, self.dtype)
        if bias is not None and (bias.dtype != self.dtype or bias.shape != (out_features,)):
            raise ValueError(f"packed linear takes a {self.dtype} bias [{out_features}]")
        x = x.contiguous()
        bias = None if bias is None else bias.contiguous()  # kept alive across the call
        out = x.new_empty(*x.shape[:-1], out_features)
        rows = x.numel() // in_features
        if rows == 0:
            return out
        status = self._fn(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                          out.data_ptr(), rows, out_features, in_features, torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"packed GEMM ({self.dtype}) failed with status {status}")
        return out

    def rows(self, ids: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight `packed` holds (an embedding lookup): [*ids.shape, K]."""
        out_features, in_features = packed_shape(packed)
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), in_features, dtype=self.dtype)
        if self._rows(packed.data_ptr(), flat.data_ptr(), flat.numel(), out_features, in_features,
                      out.data_ptr()) != 0:
            raise IndexError(f"token id out of range [0, {out_features})")
        return out.view(*ids.shape, in_features)


class PackedGemmSilu:
    """silu(x @ Wg.T) * (x @ Wu.T) for contiguous CPU x [M, K] of `dtype` and a pack_gate_up weight of
    `weight_dtype` (gemm_*_silu; the activation is fused_ops.c's silu_mul_rows_*)."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype, weight_dtype: torch.dtype | None = None) -> None:
        self.dtype, self._fn = dtype, getattr(lib, f"gemm_{_PREFIX[dtype, weight_dtype or dtype]}_silu")

    def __call__(self, x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., K] -> [..., I]."""
        two_inter, in_features = packed_shape(gate_up)
        _check_input(x, in_features, self.dtype)
        x = x.contiguous()
        out = x.new_empty(*x.shape[:-1], two_inter // 2)
        rows = x.numel() // in_features
        if rows == 0:
            return out
        status = self._fn(x.data_ptr(), gate_up.data_ptr(), out.data_ptr(), rows, two_inter // 2, in_features,
                          torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"packed gate/up GEMM ({self.dtype}) failed with status {status}")
        return out


def _check_input(x: torch.Tensor, in_features: int, dtype: torch.dtype) -> None:
    if x.dtype != dtype or x.shape[-1] != in_features or not x.is_cpu:
        raise ValueError(f"packed linear takes {dtype} CPU input [..., {in_features}], got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")


@lru_cache(maxsize=4)
def native_gemm(dtype: torch.dtype = torch.bfloat16, weight_dtype: torch.dtype | None = None) -> PackedGemm | None:
    """The kernel for activations of `dtype` on weights of `weight_dtype` (default the same: bf16 or fp32;
    fp32 on bf16: weight-only bf16), built on first use; None when native code is off, the build fails or
    the CPU lacks what it needs (bf16: AVX512-BF16, the others: AVX-512F or AVX2; the C file then builds a stub
    that says so)."""
    lib, prefix = load_kernels(), _PREFIX.get((dtype, weight_dtype or dtype))
    if prefix is None or lib is None or not getattr(lib, f"gemm_{prefix}_available")():
        return None
    return PackedGemm(lib, dtype, weight_dtype)


@lru_cache(maxsize=4)
def native_gemm_silu(dtype: torch.dtype = torch.bfloat16,
                     weight_dtype: torch.dtype | None = None) -> PackedGemmSilu | None:
    """The fused gate/up + SiLU-multiply kernel, where native_gemm(dtype, weight_dtype) is (the same library
    holds both)."""
    lib = load_kernels()
    missing = native_gemm(dtype, weight_dtype) is None or lib is None
    return None if missing else PackedGemmSilu(lib, dtype, weight_dtype)


def use_amx(on: bool = True) -> bool:
    """Run the bf16 kernel on AMX's tile unit (on, the default where the CPU has AMX-BF16 and Linux grants
    it) or on its AVX512-BF16 tile (off: A/B runs, tests); whether AMX is now in use. The two tiles sum K
    in different steps (32 K per instruction against a pair), so their bits may differ by an ulp: one
    process keeps one of them for every batch size, which keeps a row's bits independent of its batch."""
    lib = load_kernels()
    return native_gemm() is not None and lib is not None and bool(lib.gemm_bf16_set_amx(int(on)))


def can_pack(weight: torch.Tensor, activations: torch.dtype | None = None) -> bool:
    """Whether `weight` [N, K] (bf16 or fp32) can take the packed layout and the kernel for it under
    `activations` (default: the weight's dtype) is here to use it."""
    return (weight.dim() == 2 and weight.dtype in STEP and weight.is_cpu and weight.shape[0] % PANEL == 0
            and weight.shape[1] % STEP[weight.dtype] == 0
            and native_gemm(activations or weight.dtype, weight.dtype) is not None)


def block_columns(out_features: int, dtype: torch.dtype = torch.bfloat16,
                  activations: torch.dtype | None = None) -> int:
    """Output columns per packed block: bf16 (under bf16 activations), 3 panels when they divide N's
    panels, else 1; fp32 and weight-only bf16, always 1 (one stream per panel: gemm_f32.c says why). The C
    kernels' block_panels rule: both sides must agree."""
    bf16_math = dtype == torch.bfloat16 and activations in (None, torch.bfloat16)
    sequential = bf16_math and (out_features // PANEL) % BLOCK_PANELS == 0
    return PANEL * (BLOCK_PANELS if sequential else 1)


def pack_weight(weight: torch.Tensor, activations: torch.dtype | None = None) -> torch.Tensor:
    """[N, K] -> packed [N/C, K/t, C, t], C = block_columns(N, dtype, activations), t = STEP[dtype] (bf16 2,
    fp32 1): packed[b, s, c, i] = weight[C b + c, t s + i]."""
    n, k = weight.shape
    c, t = block_columns(n, weight.dtype, activations), STEP[weight.dtype]
    return weight.view(n // c, c, k // t, t).permute(0, 2, 1, 3).contiguous()


def can_pack_gate_up(weight: torch.Tensor, activations: torch.dtype | None = None) -> bool:
    """Whether a [2I, K] gate/up weight can take pack_gate_up's layout (I a multiple of 48) and the fused
    kernel is here to read it under `activations` (default: the weight's dtype)."""
    return (can_pack(weight, activations) and weight.shape[0] % (2 * PANEL * BLOCK_PANELS) == 0
            and native_gemm_silu(activations or weight.dtype, weight.dtype) is not None)


def pack_gate_up(weight: torch.Tensor, activations: torch.dtype | None = None) -> torch.Tensor:
    """[2I, K] (gate rows, then up rows) -> [2I/48, 48/C, K/t, C, t], C = block_columns(2I, dtype,
    activations): gate block j (48 rows) packed as pack_weight packs it, then up block j. The bytes are
    those of pack_weight applied to the rows reordered so; the kernel (gemm_*_silu) reads gate and up
    block j together."""
    n, k = weight.shape
    width = PANEL * BLOCK_PANELS
    blocks = weight.view(2, n // 2 // width, width, k).transpose(0, 1).reshape(n, k)  # gate 0, up 0, gate 1, ...
    c, t = block_columns(n, weight.dtype, activations), STEP[weight.dtype]
    return pack_weight(blocks, activations).view(n // width, width // c, k // t, c, t)


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_weight (and of pack_gate_up): [N, K]."""
    n, k = packed_shape(packed)
    if is_gate_up_packed(packed):
        width = PANEL * BLOCK_PANELS
        blocks = unpack_weight(packed.flatten(0, 1)).view(n // 2 // width, 2, width, k)  # [I/48, gate|up, 48, K]
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
        return packed.shape[0] * packed.shape[1] * packed.shape[3], packed.shape[2] * packed.shape[4]
    return packed.shape[0] * packed.shape[2], packed.shape[1] * packed.shape[3]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for a [N, K] weight; the native kernel for a packed or quantized one."""
    if is_quantized(weight):
        return quantized_linear(x, weight, bias)
    if is_packed(weight):
        return _packed_kernel(weight, x.dtype)(x, weight, bias)
    if weight.dtype != x.dtype:  # a weight-only bf16 weight left unpacked (never by the runner): widened
        return F.linear(x, weight.to(x.dtype), bias)
    return F.linear(x, weight, bias)


def _packed_kernel(packed: torch.Tensor, dtype: torch.dtype) -> PackedGemm:
    """The kernel for `dtype` activations that reads this packed weight (its own dtype's where none does,
    which then names the mismatch)."""
    kernel = native_gemm(dtype, packed.dtype)
    if kernel is None or not kernel.reads(packed):
        kernel = native_gemm(packed.dtype)
    assert kernel is not None, "packed weights exist only where the kernel does"
    return kernel


def silu_mul_linear(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x's projection by a pack_gate_up weight: [..., K] -> [..., I]."""
    gemm = _packed_kernel(gate_up, x.dtype)
    kernel = native_gemm_silu(gemm.dtype, gemm.weight_dtype)
    assert kernel is not None and is_gate_up_packed(gate_up), "gate/up packing exists only where the kernel does"
    return kernel(x, gate_up)


def embedding(ids: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """F.embedding(ids, weight) for a [V, H] table or a packed one: rows [*ids.shape, H] in `dtype` (the
    model's; default the table's): a quantized table's rows dequantized, a bf16 one's widened (weight-only
    bf16)."""
    if is_quantized(weight):
        return quantized_rows(ids, weight, dtype or torch.float32)
    if not is_packed(weight):
        rows = F.embedding(ids, weight)
        return rows if dtype is None else rows.to(dtype)
    return _packed_kernel(weight, dtype or weight.dtype).rows(ids, weight)
