"""Engine and scheduler configuration: frozen dataclasses, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Batching = Literal["continuous", "static"]
SchedulingPolicy = Literal["fcfs", "priority"]
PreemptionMode = Literal["recompute", "swap"]
DType = Literal["auto", "float32", "bfloat16", "float16"]


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _positive(name: str, value: int | float | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


def _check_speculation(num_speculative_tokens: int, lookup_min: int, lookup_max: int) -> None:
    if num_speculative_tokens < 0:
        raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
    if not 1 <= lookup_min <= lookup_max:
        raise ValueError(f"need 1 <= ngram_prompt_lookup_min <= ngram_prompt_lookup_max, got "
                         f"{lookup_min} and {lookup_max}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """What the scheduler needs: limits, policies, and the measured pool sizes."""

    num_kv_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    num_swap_blocks: int = 0
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    batching: Batching = "continuous"
    scheduling_policy: SchedulingPolicy = "fcfs"
    preemption_mode: PreemptionMode = "recompute"
    # Keep this share of blocks free when admitting, so running requests can grow
    # a little before anyone has to be preempted (vLLM's watermark).
    watermark: float = 0.01
    tpot_slo_ms: float | None = None
    # N-gram speculative decoding (spec_decode.py): drafts per greedy decode row, 0 = off. Not with
    # static batching or a TPOT SLO (whose step-time model is fit on plain steps).
    num_speculative_tokens: int = 0
    ngram_prompt_lookup_min: int = 2
    ngram_prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        for name in ("num_kv_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len", "tpot_slo_ms"):
            _positive(name, getattr(self, name))
        _check_speculation(self.num_speculative_tokens, self.ngram_prompt_lookup_min,
                           self.ngram_prompt_lookup_max)
        if self.num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be >= 0, got {self.num_swap_blocks}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        _one_of("batching", self.batching, ("continuous", "static"))
        _one_of("scheduling_policy", self.scheduling_policy, ("fcfs", "priority"))
        _one_of("preemption_mode", self.preemption_mode, ("recompute", "swap"))
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


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """User-facing engine options (vLLM's names); pool sizes are measured from these at start-up."""

    model: str | None = None  # None: the built-in default model (SmolLM2-135M-Instruct GGUF)
    dtype: DType = "auto"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None
    swap_space: float = 1.0  # GiB of host memory for swapped-out KV blocks
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    batching: Batching = "continuous"
    scheduling_policy: SchedulingPolicy = "fcfs"
    preemption_mode: PreemptionMode = "recompute"
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    tpot_slo_ms: float | None = None
    num_speculative_tokens: int = 0  # n-gram speculative decoding: drafts per greedy row, 0 = off
    ngram_prompt_lookup_min: int = 2
    ngram_prompt_lookup_max: int = 4
    seed: int = 0
    num_threads: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_blocks", "kv_cache_memory_gb", "max_num_seqs",
                     "max_num_batched_tokens", "max_model_len", "tpot_slo_ms", "num_threads"):
            _positive(name, getattr(self, name))
        _check_speculation(self.num_speculative_tokens, self.ngram_prompt_lookup_min,
                           self.ngram_prompt_lookup_max)
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0, got {self.swap_space}")
        _one_of("dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        _one_of("batching", self.batching, ("continuous", "static"))
        _one_of("scheduling_policy", self.scheduling_policy, ("fcfs", "priority"))
        _one_of("preemption_mode", self.preemption_mode, ("recompute", "swap"))

    def scheduler_config(self, num_kv_blocks: int, num_swap_blocks: int,
                         max_model_len: int) -> SchedulerConfig:
        """The scheduler's view, once the pools are sized and the model length is known."""
        default_budget = max(2048, max_model_len) if not self.enable_chunked_prefill else 2048
        return SchedulerConfig(
            num_kv_blocks=num_kv_blocks,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or default_budget,
            max_model_len=max_model_len,
            num_swap_blocks=num_swap_blocks,
            enable_chunked_prefill=self.enable_chunked_prefill,
            enable_prefix_caching=self.enable_prefix_caching,
            batching=self.batching,
            scheduling_policy=self.scheduling_policy,
            preemption_mode=self.preemption_mode,
            tpot_slo_ms=self.tpot_slo_ms,
            num_speculative_tokens=self.num_speculative_tokens,
            ngram_prompt_lookup_min=self.ngram_prompt_lookup_min,
            ngram_prompt_lookup_max=self.ngram_prompt_lookup_max,
        )
