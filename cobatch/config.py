"""Engine and scheduler configuration: frozen dataclasses, validated at construction.

Every option is declared once, with its help and its bound in the field's metadata: `config_cli` derives
the command-line flags from EngineConfig's fields, and `_validate_fields` checks both configs from the
same declarations. The options the scheduler shares with the user live in `SchedulingOptions`.
"""

from __future__ import annotations

import functools
import logging
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Literal, TypeVar

logger = logging.getLogger(__name__)

Batching = Literal["continuous", "static"]
SchedulingPolicy = Literal["fcfs", "priority"]
PreemptionMode = Literal["recompute", "swap", "auto"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
ThreadPolicyMode = Literal["adaptive", "fixed"]
Quantization = Literal["q8_0", "q4_0"]

_T = TypeVar("_T")
Check = Callable[[str, object], None]  # raises ValueError for a bad value of the named field


def _positive(name: str, value: object) -> None:
    if value is not None and value <= 0:  # type: ignore[operator]
        raise ValueError(f"{name} must be positive, got {value}")


def _non_negative(name: str, value: object) -> None:
    if value < 0:  # type: ignore[operator]
        raise ValueError(f"{name} must be >= 0, got {value}")


def _quantization(name: str, value: object) -> None:
    if value is not None and value not in typing.get_args(Quantization):
        raise ValueError(f"{name} must be one of {typing.get_args(Quantization)} or None, got {value!r}")


def _option(default: _T, help: str, check: Check | None = None) -> _T:
    """A config field with its command-line help and the check its value must pass."""
    return field(default=default, metadata={"help": help, "check": check})


@functools.cache
def literal_choices(cls: type) -> dict[str, tuple[str, ...]]:
    """The allowed values of each Literal-typed field of a config class."""
    hints = typing.get_type_hints(cls)
    return {name: typing.get_args(hint) for name, hint in hints.items()
            if typing.get_origin(hint) is Literal}


def _validate_fields(config: SchedulingOptions) -> None:
    """Each field's own check, from its declaration; Literal fields against their allowed values."""
    for f in fields(config):
        check = f.metadata.get("check")
        if check is not None:
            check(f.name, getattr(config, f.name))
    for name, allowed in literal_choices(type(config)).items():
        if getattr(config, name) not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {getattr(config, name)!r}")
    if config.ngram_prompt_lookup_min > config.ngram_prompt_lookup_max:
        raise ValueError(f"need 1 <= ngram_prompt_lookup_min <= ngram_prompt_lookup_max, got "
                         f"{config.ngram_prompt_lookup_min} and {config.ngram_prompt_lookup_max}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulingOptions:
    """The options the user sets and the scheduler reads as they are (vLLM's names)."""

    block_size: int = _option(16, "tokens per KV-cache block", _positive)
    max_num_seqs: int = _option(64, "most sequences in one step (the batch size)", _positive)
    enable_chunked_prefill: bool = _option(True, "split long prompts over steps within the token budget")
    enable_prefix_caching: bool = _option(True, "reuse the KV blocks of an identical prompt prefix")
    batching: Batching = _option("continuous", "continuous, or static: admit a batch only when the "
                                 "previous one has fully finished (the baseline policy)")
    scheduling_policy: SchedulingPolicy = _option("fcfs", "admission and preemption order: arrival, "
                                                  "or the requests' priority")
    preemption_mode: PreemptionMode = _option("recompute", "a preempted request's KV: freed and "
                                              "recomputed, swapped to host memory, or auto: per "
                                              "victim, whichever the fitted step-time model and the "
                                              "measured copy time predict cheaper (recompute when "
                                              "the swap pool is full)")
    tpot_slo_ms: float | None = _option(None, "admit while the predicted decode step stays within "
                                        "this time per output token (ms; default: no SLO)", _positive)
    # N-gram speculative decoding (spec_decode.py). Not with static batching or a TPOT SLO (whose
    # step-time model is fit on plain steps).
    num_speculative_tokens: int = _option(0, "n-gram speculative decoding: draft tokens per greedy row "
                                          "(0: off)", _non_negative)
    ngram_prompt_lookup_min: int = _option(2, "shortest tail n-gram looked up for drafts", _positive)
    ngram_prompt_lookup_max: int = _option(4, "longest tail n-gram looked up for drafts", _positive)


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig(SchedulingOptions):
    """What the scheduler needs: the shared options, the measured pool sizes and the model length."""

    num_kv_blocks: int = field(metadata={"help": "KV-cache blocks (measured by the runner)",
                                         "check": _positive})
    max_num_batched_tokens: int = _option(2048, "token budget of one step", _positive)
    max_model_len: int = _option(2048, "longest prompt + output", _positive)
    num_swap_blocks: int = _option(0, "host-memory blocks for swapped-out KV", _non_negative)
    # Keep this share of blocks free when admitting, so running requests can grow
    # a little before anyone has to be preempted (vLLM's watermark).
    watermark: float = _option(0.01, "share of blocks kept free when admitting")

    def __post_init__(self) -> None:
        _validate_fields(self)
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len}) so any prompt fits one step")
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        if blocks_per_seq > self.num_kv_blocks:
            raise ValueError(
                f"the KV cache holds {self.num_kv_blocks} blocks of {self.block_size} tokens "
                f"({self.num_kv_blocks * self.block_size} tokens), fewer than one sequence of "
                f"max_model_len={self.max_model_len} needs ({blocks_per_seq} blocks): "
                "raise the KV cache size or lower max_model_len")

    @property
    def max_concurrency(self) -> float:
        """How many max_model_len sequences the KV cache holds at once."""
        return self.num_kv_blocks * self.block_size / self.max_model_len


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig(SchedulingOptions):
    """User-facing engine options (vLLM's names); pool sizes are measured from these at start-up."""

    model: str | None = _option(None, "HF folder or .gguf file (default: the bundled "
                                "SmolLM2-135M-Instruct GGUF)")
    dtype: DType = _option("auto", "weights and activations (auto: bf16 on CUDA or a CPU with native "
                           "bf16 matmuls, else float32)")
    device: str = _option("auto", "torch device (auto: cuda when available, else cpu)")
    quantization: Quantization | None = _option(None, "quantize the dense projections and embeddings to "
                                                "this GGUF block format at load (CPU; a GGUF's Q8_0, Q4_0, "
                                                "Q4_1, Q2_K, Q3_K, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, IQ4_NL and "
                                                "IQ4_XS weights stay quantized without it)", _quantization)
    num_kv_blocks: int | None = _option(None, "KV-cache blocks (default: from --kv-cache-memory-gb)",
                                        _positive)
    kv_cache_memory_gb: float | None = _option(None, "GiB for the KV cache (default: min(2, 30% of the "
                                               "memory available at start-up))", _positive)
    swap_space: float = _option(1.0, "GiB of host memory for swapped-out KV blocks", _non_negative)
    max_num_batched_tokens: int | None = _option(None, "token budget of one step (default: 2048, or "
                                                 "max_model_len if larger without chunked prefill)",
                                                 _positive)
    max_model_len: int | None = _option(None, "longest prompt + output (default: the model's, at most the KV "
                                        "cache's tokens)", _positive)
    seed: int = _option(0, "seed of the sampler for requests without a seed of their own")
    num_threads: int | None = _option(None, "torch CPU threads (default: torch's choice); with the "
                                      "adaptive thread policy, the most it uses", _positive)
    thread_policy: ThreadPolicyMode = _option("adaptive", "CPU compute threads: adaptive (fewer while other "
                                              "processes keep the CPUs busy, since each parallel "
                                              "region waits for a descheduled thread; all again when "
                                              "they are free) or fixed (always --num-threads)")

    def __post_init__(self) -> None:
        _validate_fields(self)

    def scheduler_config(self, num_kv_blocks: int, num_swap_blocks: int,
                         max_model_len: int) -> SchedulerConfig:
        """The scheduler's view, once the pools are sized and the model length is known. With no
        --max-model-len, a model whose length (e.g. Llama 3.2's 131072) one sequence of could not hold in
        the KV cache is served at the KV cache's length, with a warning, rather than refused."""
        kv_cache_tokens = num_kv_blocks * self.block_size
        if self.max_model_len is None and max_model_len > kv_cache_tokens:
            logger.warning("max_model_len %d: the model's %d tokens do not fit the KV cache (%d blocks of %d); "
                           "--kv-cache-memory-gb or --num-kv-blocks raise it", kv_cache_tokens, max_model_len,
                           num_kv_blocks, self.block_size)
            max_model_len = kv_cache_tokens
        default_budget = max(2048, max_model_len) if not self.enable_chunked_prefill else 2048
        shared = {f.name: getattr(self, f.name) for f in fields(SchedulingOptions)}
        return SchedulerConfig(**shared, num_kv_blocks=num_kv_blocks, num_swap_blocks=num_swap_blocks,
                               max_model_len=max_model_len,
                               max_num_batched_tokens=self.max_num_batched_tokens or default_budget)
