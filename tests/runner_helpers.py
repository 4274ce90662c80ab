"""Helpers for runner tests: tiny random HF models and a hand-driven stand-in for the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cobatch.models.loader import build_model
from cobatch.models.model_config import ModelConfig
from cobatch.runner.model_runner import ModelRunner
from cobatch.sampling_params import SamplingParams
from cobatch.scheduler_output import RunnerOutput, ScheduledRow, SchedulerOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=None)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            initializer_range=0.2)  # a wide init makes greedy logits peaky, so argmax ties are rare


def tiny_hf_model(arch: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A tiny random HF LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM / SmolLM3ForCausalLM in fp32
    (biases and Qwen3's head norms randomized too; SmolLM3's second layer NoPE)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM, SmolLM3Config, SmolLM3ForCausalLM)

    torch.manual_seed(seed)
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                             "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                             "smollm3": (SmolLM3Config, SmolLM3ForCausalLM)}[arch]
    if arch == "smollm3":  # layer 1 NoPE (the default, every 4th, would leave 2 layers all RoPE); its
        # default token ids are past a tiny vocabulary
        overrides = {"no_rope_layers": [1, 0], "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
                     **overrides}
    model = model_cls(config_cls(**{**TINY, **overrides})).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):  # HF zero-initializes biases: make them matter
                param.normal_(std=0.5)
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # Qwen3's head norms start at 1: the same
                param.normal_(mean=1.0, std=0.5)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return model


def runner_for(hf_model: torch.nn.Module, num_kv_blocks: int = 64, block_size: int = 4,
               num_swap_blocks: int = 0, native_attention: bool = True) -> ModelRunner:
    """Our runner around the same weights as `hf_model`."""
    config = ModelConfig.from_hf_config(hf_model.config.to_dict())
    model = build_model(config, hf_model.state_dict(), torch.float32)
    return ModelRunner.from_model(model, config, num_kv_blocks, block_size, num_swap_blocks=num_swap_blocks,
                                  native_attention=native_attention)


def hf_greedy(hf_model: torch.nn.Module, prompt: list[int], num_tokens: int) -> list[int]:
    """The reference: HF generate, greedy."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False,
                                min_new_tokens=num_tokens)
    return out[0, len(prompt):].tolist()


@dataclass
class Seq:
    """A request as the test drives it: tokens, computed count, consecutive block ids."""

    request_id: str
    token_ids: list[int]
    block_table: list[int]
    params: SamplingParams = GREEDY
    num_computed_tokens: int = 0
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def output(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def row(self, num_new: int | None = None) -> ScheduledRow:
        num_new = num_new or len(self.token_ids) - self.num_computed_tokens
        return ScheduledRow(self.request_id, self.token_ids, self.num_prompt_tokens, self.num_computed_tokens,
                            num_new, self.block_table, self.params,
                            needs_sample=self.num_computed_tokens + num_new == len(self.token_ids))


class BlockAllocator:
    """Hands each request a run of consecutive block ids (enough for its whole life)."""

    def __init__(self, block_size: int) -> None:
        self.block_size, self.next_block = block_size, 0

    def seq(self, request_id: str, prompt: list[int], max_len: int,
            params: SamplingParams = GREEDY) -> Seq:
        n = -(-max_len // self.block_size)
        blocks = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return Seq(request_id, list(prompt), blocks, params)


def step(runner: ModelRunner, plan: list[tuple[Seq, int | None]],
         swap_out: tuple[tuple[int, int], ...] = (),
         swap_in: tuple[tuple[int, int], ...] = ()) -> RunnerOutput:
    """Run one step of (seq, num_new_tokens) rows, then update the seqs like the scheduler would."""
    rows = [seq.row(n) for seq, n in plan]
    out = runner.execute(SchedulerOutput(tuple(rows), swap_out, swap_in))
    sampled = iter(out.sampled_token_ids)
    for (seq, _), row in zip(plan, rows):
        seq.num_computed_tokens += row.num_new_tokens
        if row.needs_sample:
            seq.token_ids.append(next(sampled))
    return out
