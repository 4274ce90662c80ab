"""All decoder layers of a step in one native call (csrc/decoder.c): bf16 and fp32 models on weights packed
for the dense GEMM of their dtype (or bf16 ones in an fp32 model: weight-only bf16), or quantized ones.

The C loop calls the same kernels as the model's layer-by-layer Python path (models/llama.py), in the same
order, so both give the same bits (tests compare them); it only removes the per-layer Python and torch
dispatch that dominated small decode steps. It knows no model class: the caller hands it the weights and
shape (`DecoderWeights`; the runner builds them from the model it holds). `NativeDecoder.build` returns
None where any piece is missing (a dense weight left unpacked, e.g. where the CPU lacks the GEMM of
its dtype, no compiler, COBATCH_NO_NATIVE=1): the model then runs its Python loop.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from cobatch.kernels.attention import KVCache, load_attention_kernel
from cobatch.kernels.bindings import KERNEL_TIMERS, Buffers, Layer, Shape, Step, kernel_seconds, load_kernels
from cobatch.kernels.fused_ops import fused_ops
from cobatch.kernels.linear import is_gate_up_packed, is_packed, native_gemm
from cobatch.kernels.quant_linear import is_quantized, native_quant_gemm, quant_type, quantized_shape


class PagedMetadata(Protocol):
    """What the C loop reads of a step's attention metadata (models/attention.py's AttentionMetadata)."""

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor | None  # [R, max_blocks] int64
    tiles: torch.Tensor | None  # [N, 4] int64
    num_own_writes: int


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer's tensors as the C loop reads them (projections packed by kernels/linear.py or
    quantized: kernels/quant_linear.py)."""

    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # rows q | k | v
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # rows gate | up (pack_weight), or pack_gate_up's layout
    down: torch.Tensor
    q_norm: torch.Tensor | None = None  # [hd]: Qwen3's RMSNorm of each q head before RoPE (with k_norm)
    k_norm: torch.Tensor | None = None
    rope: bool = True  # False: no RoPE on q and k (SmolLM3's NoPE layers)
    qkv_tail: torch.Tensor | None = None  # qkv's last rows in a second quantized format (qkv: the rows before)


@dataclass(frozen=True, slots=True)
class DecoderWeights:
    """A decoder stack's tensors and shape. Their owner must not repack or replace them while a
    NativeDecoder holds their addresses."""

    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor  # [H]
    rope_cos: torch.Tensor  # [max_pos, hd / 2]
    rope_sin: torch.Tensor  # [max_pos, hd / 2]
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# Layer's *_type (cobatch_kernels.h) of a weight packed for the dense GEMM of the activations' dtype, and of
# a bf16 one under fp32 activations (else the quantized qtype).
PACKED, PACKED_F32_WBF16 = -1, -2


def projection_type(weight: torch.Tensor, dtype: torch.dtype) -> int | None:
    """The C loop's type of a projection under `dtype` activations: PACKED, PACKED_F32_WBF16, a quantized
    format's qtype, or None (none of them)."""
    if is_quantized(weight):
        return quant_type(weight).qtype
    if not (is_packed(weight) or is_gate_up_packed(weight)):
        return None
    return PACKED_F32_WBF16 if (dtype, weight.dtype) == (torch.float32, torch.bfloat16) else PACKED


def _has_dense_kernel(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the GEMM for `dtype` activations on this packed weight is built and reads its layout."""
    kernel = native_gemm(dtype, weight.dtype)
    return kernel is not None and kernel.reads(weight)


def _tail_fields(tail: torch.Tensor | None) -> tuple[int | None, int, int]:
    """Layer's qkv_tail, qkv_tail_type, qkv_tail_rows."""
    if tail is None:
        return None, 0, 0
    return tail.data_ptr(), quant_type(tail).qtype, quantized_shape(tail)[0]


def _is_fused(weights: DecoderWeights) -> bool:
    return all(is_gate_up_packed(layer.gate_up) for layer in weights.layers)


def can_run(weights: DecoderWeights) -> bool:
    """Every projection packed for the activations' dtype (bf16 ones too under fp32) or quantized (gate/up
    fused in all layers or none), and every kernel it needs built here."""
    dtype, fused = weights.final_norm.dtype, _is_fused(weights)
    dense = [w for layer in weights.layers
             for w in (layer.qkv, layer.o, layer.down, layer.gate_up) if not is_quantized(w)]
    if any(layer.qkv_tail is not None and not (is_quantized(layer.qkv) and is_quantized(layer.qkv_tail))
           for layer in weights.layers):  # the C loop's second qkv GEMM is a quantized one's
        return False
    types = [projection_type(w, dtype) for layer in weights.layers
             for w in (layer.qkv, layer.o, layer.down, *(() if fused else (layer.gate_up,)))]
    if None in types or dtype not in (torch.bfloat16, torch.float32):
        return False
    return (fused_ops().native and load_attention_kernel() is not None
            and all(_has_dense_kernel(w, dtype) for w in dense)
            and (all(t < 0 for t in types) or native_quant_gemm() is not None))


class NativeDecoder:
    """The decoder stack of one model as one C call per step; holds its weights' pointers."""

    def __init__(self, weights: DecoderWeights, lib: ctypes.CDLL) -> None:
        w = weights
        self._weights, self._lib = w, lib
        fused_mlp, self._dtype = _is_fused(w), w.final_norm.dtype  # can_run checked all layers agree
        self._shape = Shape(w.hidden_size, w.intermediate_size, w.num_heads, w.num_kv_heads, w.head_dim, 0,
                            int(fused_mlp), int(self._dtype == torch.bfloat16), w.rms_norm_eps, w.head_dim ** -0.5)
        self._layers = (Layer * len(w.layers))(*(
            Layer(*(_ptr(t) for t in (layer.input_norm, layer.qkv, layer.qkv_bias, layer.o, layer.o_bias,
                                      layer.post_norm, layer.gate_up, layer.down, layer.q_norm, layer.k_norm)),
                  None, None,
                  *(projection_type(t, self._dtype) for t in (layer.qkv, layer.o, layer.gate_up, layer.down)),
                  int(not layer.rope), *_tail_fields(layer.qkv_tail))
            for layer in w.layers))
        self._bound_caches: Sequence[KVCache] | None = None
        self._scratch = torch.empty(0, dtype=self._dtype)  # the per-step activations (_workspace)

    @classmethod
    def build(cls, weights: DecoderWeights) -> NativeDecoder | None:
        """The native stack over `weights`, or None when it cannot run them (see the module docstring)."""
        lib = load_kernels() if can_run(weights) else None
        return None if lib is None else cls(weights, lib)

    def with_timers(self) -> NativeDecoder | None:
        """A twin on the library built with -DKERNEL_TIMERS (its own cached build): the same kernels, bits
        and quantized GEMM modes (chosen on the engine's build), plus each kernel's wall time
        (take_kernel_seconds). None where that build fails."""
        lib = load_kernels(timers=True)
        if lib is None:
            return None
        quant = native_quant_gemm()
        if quant is not None:
            quant.copy_modes_to(lib)
        return NativeDecoder(self._weights, lib)

    def take_kernel_seconds(self) -> dict[str, float]:
        """Seconds per kernel (KERNEL_TIMERS), summed over layers and calls since the last take, which
        zeroes them (the sums are the library's, shared by its decoders); empty without timers."""
        sums = kernel_seconds(self._lib)
        if sums is None:  # the engine's build
            return {}
        taken = dict(zip(KERNEL_TIMERS, sums))
        ctypes.memset(sums, 0, ctypes.sizeof(sums))
        return taken

    def __call__(self, embeddings: torch.Tensor, positions: torch.Tensor, meta: PagedMetadata,
                 kv_caches: Sequence[KVCache], keep: torch.Tensor | None = None,
                 keep_tiles: torch.Tensor | None = None) -> torch.Tensor:
        """embeddings [T, H] (overwritten), positions [T] -> the final hidden states (after the final norm)
        of the rows `keep` [R] (all rows, in order, when None). With keep, keep_tiles ([R, 4]: one attention
        tile per kept row, see csrc/cobatch_kernels.h, Step) lets the last layer compute only those rows past
        its K/V write."""
        assert meta.block_tables is not None and meta.tiles is not None, "needs the native attention's metadata"
        if keep is not None and keep_tiles is None:
            raise ValueError("keep needs keep_tiles: the rows' last-layer attention tiles")
        self._bind_caches(kv_caches)
        w, num_tokens = self._weights, embeddings.shape[0]
        prune = keep is not None
        num_keep = len(keep) if prune else 0
        residual, positions = embeddings.contiguous(), positions.contiguous()
        x, *scratch = self._workspace(num_tokens)
        buffers = [residual, x, *scratch] + [residual.new_empty(num_keep, width)
                                            for width in (w.hidden_size, w.qkv_size)]
        out = residual.new_empty(num_keep if prune else num_tokens, w.hidden_size)
        # Every tensor whose address C gets stays referenced here until the call returns.
        block_tables, tiles = meta.block_tables.contiguous(), meta.tiles.contiguous()
        slot_mapping = meta.slot_mapping.contiguous()
        kept = [keep.contiguous(), keep_tiles.contiguous()] if prune else [None, None]
        if prune and num_keep == 0:  # an empty tensor's data_ptr() is 0, which C reads as "keep every row"
            kept = [torch.zeros(1, dtype=torch.int64), torch.zeros(1, 4, dtype=torch.int64)]
        step = Step(num_tokens, block_tables.shape[1], tiles.shape[0], num_keep, meta.num_own_writes,
                    positions.data_ptr(), slot_mapping.data_ptr(), block_tables.data_ptr(), tiles.data_ptr(),
                    *(_ptr(t) for t in kept), w.rope_cos.data_ptr(), w.rope_sin.data_ptr())
        status = self._lib.decoder_forward(self._shape, self._layers, len(self._layers), w.final_norm.data_ptr(),
                                           step, Buffers(*(b.data_ptr() for b in [*buffers, out])),
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
        w = self._weights
        gate_up = 0 if self._shape.fused_mlp else 2 * w.intermediate_size  # fused: never materialized
        widths = (w.hidden_size, w.hidden_size, w.qkv_size, w.num_heads * w.head_dim, gate_up, w.intermediate_size)
        line = 64 // self._scratch.element_size()  # elements per 64-byte line
        sizes = [-(-num_tokens * width // line) * line for width in widths]  # whole lines
        if self._scratch.numel() < sum(sizes):
            self._scratch = torch.empty(sum(sizes) + line, dtype=self._dtype)
        base = (-self._scratch.data_ptr() // self._scratch.element_size()) % line  # to the first line boundary
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
            t.is_contiguous() and t.dtype == self._dtype for kv in kv_caches for t in kv)
        for layer, (k, v) in zip(self._layers, kv_caches):
            layer.k_cache, layer.v_cache = k.data_ptr(), v.data_ptr()
        self._shape.block_size = kv_caches[0][0].shape[1]
        self._bound_caches = kv_caches
