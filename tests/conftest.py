"""Shared fixtures: a tiny random-weight Llama with the default model's real tokenizer.

The tiny model keeps server and engine tests fast (milliseconds per step) while exercising the real
loading path (an HF folder: config.json + model.safetensors + tokenizer files).
"""

from __future__ import annotations

from pathlib import Path

import pytest

TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                  rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def save_tiny_model(path: Path, seed: int = 0) -> Path:
    """Write a random tiny Llama (vocab of the default tokenizer) and that tokenizer to `path`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from cobatch.model_paths import resolve_model_path

    gguf = resolve_model_path(None)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), **TINY_LLAMA)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF folder holding the tiny random Llama and the real SmolLM2 tokenizer."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def hf_default_model():
    """HF transformers' own load of the default GGUF in fp32 (the correctness reference) + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cobatch.model_paths import resolve_model_path

    path = resolve_model_path(None)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                              dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return hf, tok
