"""ModelConfig: the decoder's shape and constants, from a HF config.json or GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")
SUPPORTED_ROPE_SCALING = ("linear", "llama3", "freq_factors", "yarn")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling: "linear" (positions / factor), Llama-3's "llama3" band scaling,
    "freq_factors": one divisor per frequency pair, the form a GGUF file stores Llama-3 scaling in
    (its rope_freqs tensor), without the parameters it came from, or "yarn" (YaRN, as Qwen2.5 / Qwen3 turn
    it on for long contexts: frequencies between beta_fast and beta_slow rotations over the original
    context ramp from kept to divided by `factor`, and cos / sin are scaled by attention_factor)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] = ()
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0  # yarn: cos and sin times this (HF's attention_scaling)

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_SCALING:
            raise ValueError(f"unsupported rope scaling {self.rope_type!r}; "
                             f"supported: {SUPPORTED_ROPE_SCALING}, dynamic, or none")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and constants of a Llama-family decoder (llama, mistral, qwen2, qwen3, smollm3)."""

    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (qwen2 always; llama when config.attention_bias)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    rope_scaling: RopeScaling | None = None
    o_proj_bias: bool = False  # llama's attention_bias also puts a bias on o_proj; qwen2's doesn't
    qk_norm: bool = False  # qwen3: an RMSNorm over each q and k head before RoPE (q_norm, k_norm [head_dim])
    no_rope_layers: tuple[int, ...] = ()  # smollm3: the layers whose q and k get no RoPE (NoPE), by index

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; "
                             f"supported: {SUPPORTED_ARCHITECTURES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")

    @property
    def qkv_size(self) -> int:
        """Output width of the fused QKV projection."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, object], name: str = "",
                       extra_eos: tuple[int, ...] = ()) -> ModelConfig:
        """From a Hugging Face config.json dict (LlamaConfig / MistralConfig / Qwen2Config / Qwen3Config /
        SmolLM3Config)."""
        arch = str(cfg.get("model_type", ""))
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        bias = arch == "qwen2" or bool(cfg.get("attention_bias", False))
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        window = cfg.get("sliding_window")
        if window and (arch == "mistral" or cfg.get("use_sliding_window")):
            # No sliding-window attention here: stay within the window, where it is exact.
            max_pos = min(max_pos, int(window))
        return cls(
            name=name or str(cfg.get("_name_or_path", "") or arch),
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_theta(cfg)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bias,
            o_proj_bias=arch != "qwen2" and bias,
            bos_token_id=_opt_int(cfg.get("bos_token_id")),
            eos_token_ids=_merge_ids(cfg.get("eos_token_id"), extra_eos),
            rope_scaling=_hf_rope_scaling(cfg),
            qk_norm=arch == "qwen3",
            no_rope_layers=_hf_no_rope_layers(cfg),
        )


def _hf_no_rope_layers(cfg: Mapping[str, object]) -> tuple[int, ...]:
    """SmolLM3's no_rope_layers (1: the layer uses RoPE, 0: NoPE) as the indices of its NoPE layers; without
    the list, transformers' default: every no_rope_layer_interval-th layer (4) is NoPE."""
    if cfg.get("model_type") != "smollm3":
        return ()
    flags = cfg.get("no_rope_layers")
    if not isinstance(flags, list):
        interval, layers = int(cfg.get("no_rope_layer_interval") or 4), int(cfg["num_hidden_layers"])  # type: ignore
        return no_rope_every(interval, layers)
    return tuple(i for i, uses_rope in enumerate(flags) if not uses_rope)


def no_rope_every(interval: int, num_layers: int) -> tuple[int, ...]:
    """Every interval-th layer NoPE (layers interval - 1, 2 interval - 1, ...): SmolLM3's pattern."""
    return tuple(i for i in range(num_layers) if (i + 1) % interval == 0)


def _rope_theta(cfg: Mapping[str, object]) -> float:
    if "rope_theta" in cfg:
        return float(cfg["rope_theta"])  # type: ignore[arg-type]
    params = cfg.get("rope_parameters")  # transformers 5 moves it here
    if isinstance(params, Mapping) and "rope_theta" in params:
        return float(params["rope_theta"])
    return 10000.0


def _hf_rope_scaling(cfg: Mapping[str, object]) -> RopeScaling | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not isinstance(scaling, Mapping):
        return None
    rope_type = str(scaling.get("rope_type") or scaling.get("type") or "default")
    # Dynamic NTK changes the base only for sequences past max_position_embeddings, which bounds
    # max_model_len here (ModelRunner): within it, the frequencies are the default ones.
    if rope_type in ("default", "dynamic"):
        return None
    if rope_type == "yarn":
        return _hf_yarn(scaling, int(cfg.get("max_position_embeddings", 2048)))  # type: ignore[call-overload]
    return RopeScaling(
        rope_type=rope_type,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `factor` times the original: 0.1 mscale ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _hf_yarn(scaling: Mapping[str, object], max_positions: int) -> RopeScaling:
    """A HF config's YaRN parameters, with transformers' defaults: without a factor, the ratio of
    max_position_embeddings to the original; without an attention_factor, yarn_mscale's (DeepSeek's
    mscale / mscale_all_dim ratio where both are given)."""
    original = int(scaling.get("original_max_position_embeddings") or max_positions)  # type: ignore[call-overload]
    factor = float(scaling.get("factor") or max_positions / original)  # type: ignore[arg-type]
    attention = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention is None:
        attention = (yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))  # type: ignore
                     if mscale and mscale_all_dim else yarn_mscale(factor))
    return RopeScaling(rope_type="yarn", factor=factor, original_max_position_embeddings=original,
                       beta_fast=float(scaling.get("beta_fast") or 32.0),  # type: ignore[arg-type]
                       beta_slow=float(scaling.get("beta_slow") or 1.0),  # type: ignore[arg-type]
                       attention_factor=float(attention))  # type: ignore[arg-type]


def _opt_int(value: object) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return None if value is None else int(value)  # type: ignore[arg-type]


def _merge_ids(value: object, extra: tuple[int, ...]) -> tuple[int, ...]:
    ids = value if isinstance(value, list) else ([] if value is None else [value])
    merged: list[int] = []
    for token_id in [*ids, *extra]:
        if int(token_id) not in merged:  # type: ignore[call-overload]
            merged.append(int(token_id))  # type: ignore[call-overload]
    return tuple(merged)
