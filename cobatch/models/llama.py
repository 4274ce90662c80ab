"""Llama-family decoder (Llama 2/3, SmolLM, SmolLM3, TinyLlama, Mistral, Qwen2, Qwen3) over a flat ragged batch.

gpt-fast style: explicit arguments, no HF plumbing. Q/K/V and gate/up projections are fused at load time
(one matmul each); in bf16 or fp32 on CPU `pack_linear_weights` repacks them for the native GEMM
(kernels/linear.py); the residual add + RMSNorm, RoPE and SiLU-multiply are fused native ops
(kernels/fused_ops.py). `forward` runs the whole step's tokens `[T]` through the layers (or through the
caller's `layer_loop`: the runner passes the C one) and the final norm of the rows that sample;
`compute_logits` runs lm_head on them.
"""

from __future__ import annotations

import contextlib
import math
from typing import ContextManager, Protocol, Sequence

import torch
from torch import nn

from cobatch.kernels.attention import KVCache
from cobatch.kernels.fused_ops import FusedOps, fused_ops
from cobatch.kernels.hugepages import move_to_huge_pages
from cobatch.kernels.linear import (can_pack, can_pack_gate_up, embedding, is_gate_up_packed, linear, pack_gate_up,
                                    pack_weight, silu_mul_linear)
from cobatch.kernels.quant_linear import is_quantized, quantized_shape
from cobatch.models.attention import AttentionMetadata, paged_attention
from cobatch.models.model_config import ModelConfig, RopeScaling


class LayerLoop(Protocol):
    """Every decoder layer and the final norm in one call, in place of forward's Python loop, with the same
    values (the runner's C loop: kernels/decoder.py): embeddings [T, H] -> the rows `keep`'s final hidden
    states (all rows when None; keep_tiles: their last-layer attention tiles)."""

    def __call__(self, embeddings: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: Sequence[KVCache], keep: torch.Tensor | None,
                 keep_tiles: torch.Tensor | None) -> torch.Tensor: ...


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Uninitialized: the loader fills every parameter; skipping random init keeps loading fast.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


_NO_SCOPE = contextlib.nullcontext()  # stateless and reusable: the cost of a scope when not profiling


def scope(name: str, enabled: bool) -> ContextManager[object]:
    """A profiler scope (`bench steps --profile`) when enabled, else a no-op that costs ~0.1 us."""
    return torch.profiler.record_function(name) if enabled else _NO_SCOPE


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Per-pair rotation frequencies [hd / 2] (fp32), with linear, Llama-3 or per-pair scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    if scaling.rope_type == "freq_factors":
        if len(scaling.freq_factors) != len(inv_freq):
            raise ValueError(f"rope freq_factors has {len(scaling.freq_factors)} values for head_dim {head_dim}")
        return inv_freq / torch.tensor(scaling.freq_factors, dtype=torch.float32)
    return _llama3_inv_freq(inv_freq, scaling)


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    # YaRN: pairs that turn more than beta_fast times over the original context keep their frequency, those
    # that turn fewer than beta_slow times are divided by `factor`, and a linear ramp blends the band between
    # (its ends rounded outwards to whole pairs, as transformers' truncate=True and llama.cpp do).
    def pair_of(rotations: float) -> float:  # the (fractional) pair index that turns `rotations` times
        ratio = s.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(ratio) / (2 * math.log(theta))

    low = max(math.floor(pair_of(s.beta_fast)), 0)
    high = min(math.ceil(pair_of(s.beta_slow)), head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    return inv_freq / s.factor * ramp + inv_freq * (1 - ramp)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate the band between.
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(config: ModelConfig, max_positions: int, dtype: torch.dtype,
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_positions, hd / 2], computed in fp32 (YaRN: times its attention factor) and
    stored in the model dtype."""
    inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    scale = config.rope_scaling.attention_factor if config.rope_scaling is not None else 1.0
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    return cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SiLU-gated MLP, with fused QKV and gate/up weights."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str, index: int = 0) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.use_rope = index not in config.no_rope_layers  # SmolLM3: every fourth layer has none (NoPE)
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim, self.eps = config.head_dim, config.rms_norm_eps
        self.scale = config.head_dim ** -0.5
        self.input_norm = _param(h, dtype=dtype, device=device)
        self.qkv_proj = _param(config.qkv_size, h, dtype=dtype, device=device)  # rows: q | k | v
        self.qkv_bias = _param(config.qkv_size, dtype=dtype, device=device) if config.attention_bias else None
        # a GGUF's q | k | v in two quantized formats (llama-quantize's Q4_K_M: a Q6_K v): the last rows in the
        # second, kept apart (the loader sets it; qkv_proj then holds the rows before them)
        self.qkv_tail_proj: nn.Parameter | None
        self.register_parameter("qkv_tail_proj", None)
        self.o_proj = _param(h, config.num_heads * config.head_dim, dtype=dtype, device=device)
        self.o_bias = _param(h, dtype=dtype, device=device) if config.o_proj_bias else None
        self.post_attention_norm = _param(h, dtype=dtype, device=device)
        self.gate_up_proj = _param(2 * i, h, dtype=dtype, device=device)  # rows: gate | up
        self.down_proj = _param(h, i, dtype=dtype, device=device)
        # Qwen3: each q and k head RMS-normed before RoPE
        self.q_norm = _param(config.head_dim, dtype=dtype, device=device) if config.qk_norm else None
        self.k_norm = _param(config.head_dim, dtype=dtype, device=device) if config.qk_norm else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache, meta: AttentionMetadata,
                ops: FusedOps, profile: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings at layer 0), residual: the running sum
        before it (None at layer 0) -> this layer's (MLP output, residual), each [T, H].

        The residual add is fused into the next norm (vLLM's layout), so the stream is read once per norm.
        `profile` labels the parts for the profiler.
        """
        with scope("norm", profile):
            if residual is None:
                residual, x = x, None
            h = ops.add_rms_norm(x, residual, self.input_norm, self.eps)  # residual += x first
        with scope("qkv_proj+rope", profile):
            q, k, v = self.qkv_rope(h, positions, rope, ops)
        with scope("attention", profile):
            out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)  # [T, nh hd]
        with scope("o_proj", profile):
            attn = linear(out, self.o_proj, self.o_bias)
        with scope("norm", profile):
            h = ops.add_rms_norm(attn, residual, self.post_attention_norm, self.eps)
        with scope("mlp", profile):
            return linear(self.gate_up_silu(h, ops), self.down_proj), residual

    def gate_up_silu(self, x: torch.Tensor, ops: FusedOps) -> torch.Tensor:
        """silu(gate) * up: [T, H] -> [T, I]; one fused kernel where the weight is gate/up packed (then
        whatever `ops` is, since the activation runs inside the GEMM)."""
        if is_gate_up_packed(self.gate_up_proj):
            return silu_mul_linear(x, self.gate_up_proj)
        return ops.silu_mul(linear(x, self.gate_up_proj))

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x @ Wqkv.T (+ b): one GEMM, or one per format where the rows are in two (qkv_tail_proj)."""
        if self.qkv_tail_proj is None:
            return linear(x, self.qkv_proj, self.qkv_bias)
        w, bias = self.qkv_proj, self.qkv_bias
        head = quantized_shape(w)[0] if is_quantized(w) else w.shape[0]  # dense: a reference's dequantized copy
        return torch.cat([linear(x, self.qkv_proj, None if bias is None else bias[:head]),
                          linear(x, self.qkv_tail_proj, None if bias is None else bias[head:])], dim=-1)

    def qkv_rope(self, x: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 ops: FusedOps) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Fused QKV, (Qwen3: each q and k head RMS-normed,) RoPE on q and k in place: [T, H] -> q [T, nh, hd],
        k and v [T, kvh, hd] (views)."""
        num_tokens = x.shape[0]
        nh, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x)  # [T, (nh + 2 kvh) hd]: rows q | k | v
        if self.q_norm is not None and self.k_norm is not None:
            ops.head_rms_norm(qkv, 0, nh, hd, self.q_norm, self.eps)
            ops.head_rms_norm(qkv, nh, kvh, hd, self.k_norm, self.eps)
        if self.use_rope:
            ops.rope(qkv, rope[0], rope[1], positions, nh + kvh, hd)
        q = qkv[:, :nh * hd].view(num_tokens, nh, hd)
        k = qkv[:, nh * hd:(nh + kvh) * hd].view(num_tokens, kvh, hd)
        v = qkv[:, (nh + kvh) * hd:].view(num_tokens, kvh, hd)
        return q, k, v


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus embeddings and lm_head (tied to the embeddings when the model says so)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device, i) for i in range(config.num_layers))
        self.norm = _param(config.hidden_size, dtype=dtype, device=device)
        self.lm_head = (self.embed_tokens if config.tie_word_embeddings
                        else _param(config.vocab_size, config.hidden_size, dtype=dtype, device=device))
        cos, sin = rope_tables(config, config.max_position_embeddings, dtype, device)
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_pos, hd / 2]
        self.register_buffer("rope_sin", sin, persistent=False)
        self.ops: FusedOps = fused_ops()  # native fused norm/rope/SiLU where built; EAGER for A/B

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: Sequence[KVCache], profile: bool = False, keep: torch.Tensor | None = None,
                keep_tiles: torch.Tensor | None = None, layer_loop: LayerLoop | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> the final hidden states (after the last layer and the final norm)
        of the rows `keep` [R] (default: all, [T, H]). layer_loop (the runner's C loop) runs the layers and
        the final norm instead of the Python loop; it uses keep_tiles (one attention tile per kept row) to
        skip the other rows' work in the last layer past its K/V write; same values."""
        with scope("embed+rope_tables", profile):
            x = embedding(input_ids, self.embed_tokens, self.norm.dtype)  # [T, H]
        if layer_loop is not None:
            return layer_loop(x, positions, meta, kv_caches, keep, keep_tiles)  # final norm included
        residual: torch.Tensor | None = None
        rope = (self.rope_cos, self.rope_sin)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, rope, kv_cache, meta, self.ops, profile)
        if keep is not None:
            x, residual = x[keep], None if residual is None else residual[keep]
        # the last residual add and the final norm: one fused op, as the native loop ends
        if residual is None:  # no layers
            return self.ops.add_rms_norm(None, x.contiguous(), self.norm, self.config.rms_norm_eps)
        return self.ops.add_rms_norm(x, residual, self.norm, self.config.rms_norm_eps)

    def pack_linear_weights(self) -> int:
        """Repack every projection and lm_head (with the embeddings it is tied to) for the native GEMM,
        in place, where `can_pack` allows; returns how many weights were packed. Packing is a
        permutation: the model's memory stays the same (moved onto huge pages when anything was
        packed; the caller frees the old heap). Packed weights are what the C layer loop reads (the
        runner's choice). The gate/up weight takes pack_gate_up's layout where its size allows
        (kernels/linear.py). Each is packed for the model's dtype: a bf16 weight in an fp32 model
        (weight-only bf16, models/loader.py) for the fp32-on-bf16 kernel."""
        owners = [(layer, name) for layer in self.layers
                  for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")] + [(self, "lm_head")]
        packed, dtype = 0, self.norm.dtype
        for owner, name in owners:
            param = getattr(owner, name)
            if name == "gate_up_proj" and can_pack_gate_up(param.data, dtype):
                param.data = pack_gate_up(param.data, dtype)  # SiLU-multiply fused into its GEMM
                packed += 1
            elif can_pack(param.data, dtype):
                param.data = pack_weight(param.data, dtype)  # the same Parameter: a tied embedding follows
                packed += 1
        if packed:
            move_to_huge_pages(list(self.parameters()))  # streamed every decode step (kernels/hugepages.py)
        return packed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head on forward's final hidden states (the sampled rows): [R, H] -> logits [R, V] in the
        model dtype (the sampler converts to fp32 where it needs to: a greedy batch's argmax does not)."""
        return linear(hidden, self.lm_head)
