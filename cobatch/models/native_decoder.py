"""All decoder layers of a step in one native call (csrc/decoder.c), for bf16 models on packed weights.

The C loop calls the same kernels as models/llama.py's layer-by-layer path, in the same order, so both
give the same bits (tests compare them); it only removes the per-layer Python and torch dispatch that
dominated small decode steps. `NativeDecoder.build` returns None where any piece is missing (fp32, a
weight left unpacked, no compiler, COBATCH_NO_NATIVE=1): the model then runs its Python loop.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Sequence

import torch

from cobatch.models.attention import AttentionMetadata
from cobatch.models.fused_ops import fused_ops
from cobatch.models.linear import is_gate_up_packed, is_packed, native_gemm
from cobatch.models.native import load_attention_kernel, load_library

if TYPE_CHECKING:
    from cobatch.models.llama import KVCache, LlamaForCausalLM

_PTR, _I64, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def _struct(name: str, fields: Sequence[tuple[str, type]]) -> type[ctypes.Structure]:
    return type(name, (ctypes.Structure,), {"_fields_": list(fields)})


# The structs of csrc/decoder.c, field for field.
_Kernels = _struct("Kernels", [(n, _PTR) for n in ("gemm", "add_rms_norm", "silu_mul", "rope", "attention",
                                                    "gemm_silu", "act_rows", "write_kv")])
_Shape = _struct("Shape", [(n, _I64) for n in ("hidden", "inter", "num_heads", "num_kv_heads", "head_dim",
                                              "block_size", "fused_mlp")] + [("eps", _FLOAT), ("scale", _FLOAT)])
_Layer = _struct("Layer", [(n, _PTR) for n in ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm",
                                              "gate_up", "down", "k_cache", "v_cache")])
_Step = _struct("Step", [(n, _I64) for n in ("num_tokens", "max_blocks", "num_tiles", "num_keep", "num_own_writes")]
                + [(n, _PTR) for n in ("positions", "slot_mapping", "block_tables", "tiles", "keep", "keep_tiles",
                                      "cos", "sin")])
_Buffers = _struct("Buffers", [(n, _PTR) for n in ("residual", "x", "h", "qkv", "attn", "gate_up", "act",
                                                  "residual_keep", "q_keep", "out")])
# decoder.c's kernel_seconds in a -DKERNEL_TIMERS build, in its order (attention with the last layer's
# gather of the kept rows, gate/up with its SiLU).
KERNEL_TIMERS = ("norm", "qkv", "rope", "write_kv", "attention", "o_proj", "post_norm", "gate_up+silu", "down")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _gate_up_layout(weight: torch.Tensor) -> str | None:
    return "fused" if is_gate_up_packed(weight) else "packed" if is_packed(weight) else None


class NativeDecoder:
    """The decoder stack of one LlamaForCausalLM as one C call per step; holds its weights' pointers (the
    model owns the tensors and must not repack or replace them afterwards)."""

    def __init__(self, model: LlamaForCausalLM, lib: ctypes.CDLL) -> None:
        c = model.config
        self._model, self._lib = model, lib
        self._fn = lib.decoder_forward
        self._fn.argtypes = [ctypes.POINTER(_Kernels), ctypes.POINTER(_Shape), ctypes.POINTER(_Layer),
                             ctypes.c_int, _PTR, ctypes.POINTER(_Step), ctypes.POINTER(_Buffers), ctypes.c_int]
        self._fn.restype = ctypes.c_int
        gemm, ops, attention = (load_library(name) for name in ("gemm_bf16", "fused_ops", "paged_attention"))
        self._kernels = _Kernels(*(ctypes.cast(f, _PTR).value for f in (
            gemm.gemm_bf16, ops.add_rms_norm, ops.silu_mul, ops.rope_inplace, attention.paged_attention_bf16,
            gemm.gemm_bf16_silu, ops.silu_mul_rows_bf16, attention.paged_write_kv_bf16)))
        fused_mlp = is_gate_up_packed(model.layers[0].gate_up_proj)  # build() checked all layers agree
        self._shape = _Shape(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, 0,
                             int(fused_mlp), c.rms_norm_eps, c.head_dim ** -0.5)
        self._layers = (_Layer * c.num_layers)(*(
            _Layer(*(_ptr(w) for w in (layer.input_norm, layer.qkv_proj, layer.qkv_bias, layer.o_proj,
                                       layer.o_bias, layer.post_attention_norm, layer.gate_up_proj,
                                       layer.down_proj)), None, None)
            for layer in model.layers))
        self._bound_caches: Sequence[KVCache] | None = None
        self._scratch = torch.empty(0, dtype=torch.bfloat16)  # the per-step activations (_workspace)

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> NativeDecoder | None:
        """The native stack for `model`, or None when it cannot run it (see the module docstring)."""
        weights = [w for layer in model.layers for w in (layer.qkv_proj, layer.o_proj, layer.down_proj)]
        gate_up_layouts = {_gate_up_layout(layer.gate_up_proj) for layer in model.layers}  # one for all layers
        if (model.embed_tokens.dtype != torch.bfloat16 or not all(is_packed(w) for w in weights)
                or gate_up_layouts not in ({"fused"}, {"packed"})
                or not fused_ops().native or native_gemm() is None or load_attention_kernel() is None):
            return None
        lib = load_library("decoder")
        return None if lib is None else cls(model, lib)

    def with_timers(self) -> NativeDecoder | None:
        """A twin on decoder.c built with -DKERNEL_TIMERS (its own cached build): the same kernels and
        bits, plus each kernel's wall time (take_kernel_seconds). None where that build fails."""
        lib = load_library("decoder", ("-DKERNEL_TIMERS",))
        return None if lib is None else NativeDecoder(self._model, lib)

    def take_kernel_seconds(self) -> dict[str, float]:
        """Seconds per kernel (KERNEL_TIMERS), summed over layers and calls since the last take, which
        zeroes them (the sums are the library's, shared by its decoders); empty without timers."""
        try:
            sums = (ctypes.c_double * len(KERNEL_TIMERS)).in_dll(self._lib, "kernel_seconds")
        except ValueError:  # the engine's build: no such symbol
            return {}
        taken = dict(zip(KERNEL_TIMERS, sums))
        ctypes.memset(sums, 0, ctypes.sizeof(sums))
        return taken

    def __call__(self, embeddings: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: Sequence[KVCache], keep: torch.Tensor | None = None,
                 keep_tiles: torch.Tensor | None = None) -> torch.Tensor:
        """embeddings [T, H] (overwritten), positions [T] -> the final hidden states (after the final norm)
        of the rows `keep` [R] (all rows, in order, when None). With keep, keep_tiles ([R, 4]: one attention
        tile per kept row, see csrc/decoder.c) lets the last layer compute only those rows past its K/V
        write."""
        assert meta.block_tables is not None and meta.tiles is not None, "needs the native attention's metadata"
        if keep is not None and keep_tiles is None:
            raise ValueError("keep needs keep_tiles: the rows' last-layer attention tiles")
        self._bind_caches(kv_caches)
        c, num_tokens = self._model.config, embeddings.shape[0]
        prune = keep is not None
        num_keep = len(keep) if prune else 0
        residual, positions = embeddings.contiguous(), positions.contiguous()
        x, *scratch = self._workspace(num_tokens)
        buffers = [residual, x, *scratch] + [residual.new_empty(num_keep, width)
                                            for width in (c.hidden_size, c.qkv_size)]
        out = residual.new_empty(num_keep if prune else num_tokens, c.hidden_size)
        # Every tensor whose address C gets stays referenced here until the call returns.
        block_tables, tiles = meta.block_tables.contiguous(), meta.tiles.contiguous()
        slot_mapping = meta.slot_mapping.contiguous()
        kept = [keep.contiguous(), keep_tiles.contiguous()] if prune else [None, None]
        step = _Step(num_tokens, block_tables.shape[1], tiles.shape[0], num_keep, meta.num_own_writes,
                     positions.data_ptr(), slot_mapping.data_ptr(), block_tables.data_ptr(), tiles.data_ptr(),
                     *(_ptr(t) for t in kept), self._model.rope_cos.data_ptr(), self._model.rope_sin.data_ptr())
        status = self._fn(self._kernels, self._shape, self._layers, len(self._layers),
                          self._model.norm.data_ptr(), step, _Buffers(*(b.data_ptr() for b in [*buffers, out])),
                          torch.get_num_threads())
        if status == -1:
            raise MemoryError("native attention could not allocate its scratch buffers")
        if status != 0:
            raise RuntimeError(f"native decoder failed with status {status}")
        return out

    def _workspace(self, num_tokens: int) -> list[torch.Tensor]:
        """x, h, qkv, attn, gate_up, act for num_tokens rows: views of one buffer kept across steps and
        grown on demand (a 2k-token prefill step's ~30 MB would otherwise be mapped and faulted in anew
        every step). Each view starts on a 64-byte boundary. Nothing returned to the caller lives here."""
        c = self._model.config
        gate_up = 0 if self._shape.fused_mlp else 2 * c.intermediate_size  # fused: never materialized
        widths = (c.hidden_size, c.hidden_size, c.qkv_size, c.num_heads * c.head_dim, gate_up, c.intermediate_size)
        sizes = [-(-num_tokens * w // 32) * 32 for w in widths]  # whole 64-byte lines of bf16
        if self._scratch.numel() < sum(sizes):
            self._scratch = torch.empty(sum(sizes) + 32, dtype=torch.bfloat16)
        base = (-self._scratch.data_ptr() // 2) % 32  # elements to the first 64-byte boundary
        views = []
        for width, size in zip(widths, sizes):
            views.append(self._scratch[base:base + num_tokens * width].view(num_tokens, width))
            base += size
        return views

    def _bind_caches(self, kv_caches: Sequence[KVCache]) -> None:
        """Point the layers at this KV cache. The runner passes the same list of never-moving tensors every
        step, so one identity check per step suffices (the list is kept, so its id is never reused)."""
        if kv_caches is self._bound_caches:
            return
        assert len(kv_caches) == len(self._layers) and all(
            t.is_contiguous() and t.dtype == torch.bfloat16 for kv in kv_caches for t in kv)
        for layer, (k, v) in zip(self._layers, kv_caches):
            layer.k_cache, layer.v_cache = k.data_ptr(), v.data_ptr()
        self._shape.block_size = kv_caches[0][0].shape[1]
        self._bound_caches = kv_caches
