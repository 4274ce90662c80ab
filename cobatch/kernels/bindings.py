"""Every ctypes declaration of the kernels library, in the order of csrc/cobatch_kernels.h: the structs
Python passes in (field for field; tests/test_kernel_bindings.py checks them against the layout the
library exports) and each entry point's signature. `load_kernels` is the only way in: the library built
(build.py) with these signatures applied.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import Sequence

from cobatch.kernels.build import load_library

_PTR, _I64, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def _struct(name: str, fields: Sequence[tuple[str, type]]) -> type[ctypes.Structure]:
    return type(name, (ctypes.Structure,), {"_fields_": list(fields)})


def _pointers(*names: str) -> list[tuple[str, type]]:
    return [(n, _PTR) for n in names]


def _int64s(*names: str) -> list[tuple[str, type]]:
    return [(n, _I64) for n in names]


# decoder.c's inputs (cobatch_kernels.h documents each field).
Shape = _struct("Shape", _int64s("hidden", "inter", "num_heads", "num_kv_heads", "head_dim", "block_size",
                                 "fused_mlp", "is_bf16") + [("eps", _FLOAT), ("scale", _FLOAT)])
Layer = _struct("Layer", _pointers("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "down",
                                   "q_norm", "k_norm", "k_cache", "v_cache")
               + _int64s("qkv_type", "o_type", "gate_up_type", "down_type", "skip_rope")
               + _pointers("qkv_tail") + _int64s("qkv_tail_type", "qkv_tail_rows"))
Step = _struct("Step", _int64s("num_tokens", "max_blocks", "num_tiles", "num_keep", "num_own_writes")
               + _pointers("positions", "slot_mapping", "block_tables", "tiles", "keep", "keep_tiles", "cos", "sin"))
Buffers = _struct("Buffers", _pointers("residual", "x", "h", "qkv", "attn", "gate_up", "act", "residual_keep",
                                       "q_keep", "out"))
# layout.c's table rows.
FieldLayout = _struct("FieldLayout", [("type", ctypes.c_char_p), ("field", ctypes.c_char_p), ("offset", _I64),
                                      ("size", _I64)])
STRUCTS: tuple[type[ctypes.Structure], ...] = (Shape, Layer, Step, Buffers, FieldLayout)

# decoder.c's kernel_seconds in a -DKERNEL_TIMERS build, in its order (rope with Qwen3's q/k head norms,
# attention with the last layer's gather of the kept rows, gate/up with its SiLU).
KERNEL_TIMERS = ("norm", "qkv", "rope", "write_kv", "attention", "o_proj", "post_norm", "gate_up+silu", "down")

# q, q_stride, k_cache, v_cache, block_tables, max_blocks, tiles, num_tiles, out, num_heads, num_kv_heads,
# head_dim, block_size, scale, num_own_writes
_ATTENTION = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _INT, _PTR, _INT, _INT, _INT, _INT, _FLOAT, _I64]
# k, k_stride, v, v_stride, k_cache, v_cache, slot_mapping, num_tokens, num_kv_heads, head_dim, block_size
_WRITE_KV = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _INT, _INT, _INT]
# name -> (restype, argtypes)
SIGNATURES: dict[str, tuple[type | None, list]] = {
    # fused_ops.c
    "add_rms_norm": (None, [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _FLOAT, _INT]),
    "silu_mul": (None, [_PTR, _PTR, _I64, _I64, _INT]),
    "silu_mul_rows_bf16": (None, [_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64]),
    "silu_mul_rows_f32": (None, [_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64]),
    "rope_inplace": (None, [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT]),
    "head_rms_norm": (None, [_PTR, _PTR, _I64, _I64, _I64, _I64, _FLOAT, _INT]),
    "argmax_rows": (None, [_PTR, _I64, _I64, _INT, _PTR, _PTR]),
    # gemm_bf16.c
    "gemm_bf16_available": (_INT, []),
    "gemm_bf16_set_amx": (_INT, [_INT]),
    "gemm_bf16": (_INT, [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT]),
    "gemm_bf16_silu": (_INT, [_PTR, _PTR, _PTR, _I64, _I64, _I64, _INT]),
    "packed_rows_bf16": (_INT, [_PTR, _PTR, _I64, _I64, _I64, _PTR]),
    # gemm_f32.c (the same arguments)
    "gemm_f32_available": (_INT, []),
    "gemm_f32": (_INT, [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT]),
    "gemm_f32_silu": (_INT, [_PTR, _PTR, _PTR, _I64, _I64, _I64, _INT]),
    "packed_rows_f32": (_INT, [_PTR, _PTR, _I64, _I64, _I64, _PTR]),
    # gemm_f32_wbf16.c (the same arguments)
    "gemm_f32_wbf16_available": (_INT, []),
    "gemm_f32_wbf16": (_INT, [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT]),
    "gemm_f32_wbf16_silu": (_INT, [_PTR, _PTR, _PTR, _I64, _I64, _I64, _INT]),
    "packed_rows_f32_wbf16": (_INT, [_PTR, _PTR, _I64, _I64, _I64, _PTR]),
    # paged_attention.c
    "paged_attention_f32": (_INT, _ATTENTION),
    "paged_attention_bf16": (_INT, _ATTENTION),
    "paged_attention_is_fast": (_INT, [_INT, _INT, _INT]),
    "paged_write_kv_f32": (None, _WRITE_KV),
    "paged_write_kv_bf16": (None, _WRITE_KV),
    # decoder.c: shape, layers, num_layers, final_norm, step, buffers, threads
    "decoder_forward": (_INT, [ctypes.POINTER(Shape), ctypes.POINTER(Layer), _INT, _PTR, ctypes.POINTER(Step),
                               ctypes.POINTER(Buffers), _INT]),
    # gemm_quant.c: x, wq, qtype, bias, y, M, N, K, is_bf16, threads; blocks, qtype, N, K, out, threads;
    # wq, qtype, ids, n, N, K, out, is_bf16
    "gemm_quant_path": (_INT, []),
    "gemm_quant_strided": (_INT, [_PTR, _PTR, _INT, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT, _INT]),
    "gemm_quant_byte_lookups": (_INT, []),
    "gemm_quant_set_single_stream": (None, [_INT]),
    "gemm_quant_set_single_stream_for": (None, [_INT, _INT]),
    "gemm_quant_set_single_prefetch": (None, [_INT]),
    "gemm_quant_set_single_prefetch_for": (None, [_INT, _INT]),
    "gemm_quant_set_wide_tiles": (None, [_INT]),
    "gemm_quant_set_amx": (_INT, [_INT]),
    "gemm_quant": (_INT, [_PTR, _PTR, _INT, _PTR, _PTR, _I64, _I64, _I64, _INT, _INT]),
    "quant_pack": (_INT, [_PTR, _INT, _I64, _I64, _PTR, _INT]),
    "quant_rows": (_INT, [_PTR, _INT, _PTR, _I64, _I64, _I64, _PTR, _INT]),
    # layout.c
    "cobatch_struct_layouts": (ctypes.POINTER(FieldLayout), []),
}


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Apply SIGNATURES to a loaded build of the library (raises AttributeError if it lacks one)."""
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


@lru_cache(maxsize=2)
def load_kernels(timers: bool = False) -> ctypes.CDLL | None:
    """The library, built on first use and bound; timers: the -DKERNEL_TIMERS build (decoder.c's
    kernel_seconds). None when native code is off or the build fails."""
    lib = load_library(("-DKERNEL_TIMERS",) if timers else ())
    try:
        return None if lib is None else bind(lib)
    except AttributeError:
        return None


def kernel_seconds(lib: ctypes.CDLL) -> ctypes.Array | None:
    """The timers build's per-kernel seconds (KERNEL_TIMERS order), or None in the engine's build."""
    try:
        return (ctypes.c_double * len(KERNEL_TIMERS)).in_dll(lib, "kernel_seconds")
    except ValueError:  # no such symbol
        return None


def struct_layouts(lib: ctypes.CDLL) -> dict[str, list[tuple[str | None, int, int]]]:
    """layout.c's table: struct name -> [(None, 0, sizeof), (field, offset, size), ...] in C's order."""
    table, layouts = lib.cobatch_struct_layouts(), {}
    i = 0
    while table[i].type is not None:  # the table ends with a NULL type
        row = table[i]
        field = None if row.field is None else row.field.decode()
        layouts.setdefault(row.type.decode(), []).append((field, row.offset, row.size))
        i += 1
    return layouts
