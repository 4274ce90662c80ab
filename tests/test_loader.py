"""Loader: GGUF metadata, HF safetensors folders (sharded too), RoPE permutation and scaling."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from cobatch.models.llama import rope_inv_freq
from cobatch.models.loader import (_GGUF_LAYER_NAMES, load_model, load_model_config, resolve_model_path,
                                   reverse_rope_permute)
from cobatch.runner.model_runner import ModelRunner
from tests.runner_helpers import BlockAllocator, hf_greedy, step, tiny_hf_model

PROMPT = [3, 141, 59, 26, 5, 35, 89, 79]


def test_default_model_path_and_gguf_config() -> None:
    path = resolve_model_path(None)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.exists()
    c = load_model_config(path)
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size) == ("llama", 49152, 576, 1536)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 9, 3, 64)
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_scaling is None
    assert c.rope_theta == 100000.0 and c.max_position_embeddings == 8192
    assert c.rms_norm_eps == pytest.approx(1e-5) and c.bos_token_id == 1 and c.eos_token_ids == (2,)


def test_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model_path(str(tmp_path / "nope"))


def test_reverse_rope_permute_undoes_llama_cpp_permute() -> None:
    def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:  # convert_hf_to_gguf.py
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = torch.randn(3 * 8, 5)
    assert torch.equal(reverse_rope_permute(llama_cpp_permute(w, 3), 3), w)


def _round_trip(hf_model: torch.nn.Module, tmp_path: Path, **save_kwargs: object) -> list[int]:
    hf_model.save_pretrained(tmp_path, **save_kwargs)
    return _greedy(tmp_path)


def _greedy(path: Path) -> list[int]:
    """6 greedy tokens after PROMPT from the model loaded (fp32) at `path`."""
    model, config = load_model(path, torch.float32)
    runner = ModelRunner.from_model(model, config, num_kv_blocks=16, block_size=4)
    seq = BlockAllocator(4).seq("r", PROMPT, len(PROMPT) + 6)
    step(runner, [(seq, None)])
    for _ in range(5):
        step(runner, [(seq, 1)])
    return seq.output


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "smollm3"])
def test_safetensors_folder_round_trip(arch: str, tmp_path: Path) -> None:
    hf = tiny_hf_model(arch, seed=3, head_dim=16)
    assert _round_trip(hf, tmp_path) == hf_greedy(hf, PROMPT, 6)
    config = load_model_config(tmp_path)
    assert config.architecture == arch and config.attention_bias == (arch == "qwen2")
    assert config.qk_norm == (arch == "qwen3")
    assert config.no_rope_layers == ((1,) if arch == "smollm3" else ())
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (4, 2, 16, 256)


def test_qwen3_head_dim_wider_than_hidden_over_heads(tmp_path: Path) -> None:
    """Qwen3's own layout: head_dim 128 with hidden 64 / 4 heads (q_proj 64 -> 512), q / k head norms."""
    hf = tiny_hf_model("qwen3", seed=8)
    assert hf.config.head_dim == 128
    assert _round_trip(hf, tmp_path) == hf_greedy(hf, PROMPT, 6)
    model, _ = load_model(tmp_path, torch.float32)
    hf_norm = hf.model.layers[1].self_attn.k_norm.weight
    assert torch.equal(model.layers[1].k_norm, hf_norm) and not torch.equal(model.layers[1].q_norm, hf_norm)


def test_sharded_checkpoint_and_tied_embeddings(tmp_path: Path) -> None:
    hf = tiny_hf_model("llama", seed=4, tie_word_embeddings=True)
    assert _round_trip(hf, tmp_path, max_shard_size="40KB") == hf_greedy(hf, PROMPT, 6)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model, _ = load_model(tmp_path, torch.bfloat16)
    assert model.lm_head is model.embed_tokens and model.embed_tokens.dtype == torch.bfloat16


def test_llama3_rope_scaling_matches_hf(tmp_path: Path) -> None:
    scaling = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf = tiny_hf_model("llama", seed=5, rope_parameters=scaling)
    assert _round_trip(hf, tmp_path) == hf_greedy(hf, PROMPT, 6)
    config = load_model_config(tmp_path)
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == "llama3"
    ours = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    assert torch.allclose(ours, hf.model.rotary_emb.inv_freq)
    assert not torch.allclose(ours, rope_inv_freq(config.head_dim, config.rope_theta, None))


def test_smollm3_gguf_matches_hf(tmp_path: Path) -> None:
    """A SmolLM3 GGUF: q / k permuted as llama's, and NoPE in every fourth layer, which llama.cpp's
    smollm3 architecture implies rather than stores."""
    hf = tiny_hf_model("smollm3", seed=12, num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0])
    path = tmp_path / "smollm3.gguf"
    _write_llama_gguf(hf, path, None, arch="smollm3")
    assert load_model_config(path).no_rope_layers == (3,)
    assert _greedy(path) == hf_greedy(hf, PROMPT, 6)


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_yarn_rope_scaling_matches_hf(arch: str, tmp_path: Path) -> None:
    """YaRN (Qwen's long-context switch): the ramped frequencies and the cos / sin attention factor."""
    hf = tiny_hf_model(arch, seed=10, head_dim=16, rope_parameters=YARN)
    assert _round_trip(hf, tmp_path) == hf_greedy(hf, PROMPT, 6)
    config = load_model_config(tmp_path)
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == "yarn"
    ours = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    assert torch.allclose(ours, hf.model.rotary_emb.inv_freq)
    default = rope_inv_freq(config.head_dim, config.rope_theta, None)
    assert torch.equal(ours[0], default[0]) and torch.allclose(ours[-1], default[-1] / 4)  # kept / divided
    assert config.rope_scaling.attention_factor == pytest.approx(hf.model.rotary_emb.attention_scaling)
    assert config.rope_scaling.attention_factor == pytest.approx(1 + 0.1 * math.log(4))


def test_yarn_gguf_matches_hf(tmp_path: Path) -> None:
    """YaRN as llama.cpp's converter writes it for Qwen: rope.scaling.type / factor /
    original_context_length; llama.cpp's attention factor (0.1 ln(factor) + 1) is HF's."""
    hf = tiny_hf_model("qwen3", seed=11, head_dim=16, rope_parameters=YARN)
    path = tmp_path / "yarn.gguf"
    _write_llama_gguf(hf, path, None, arch="qwen3", extra={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                                                          "rope.scaling.original_context_length": 64})
    config = load_model_config(path)
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == "yarn"
    assert config.rope_scaling.attention_factor == pytest.approx(hf.model.rotary_emb.attention_scaling)
    assert _greedy(path) == hf_greedy(hf, PROMPT, 6)


def _llama_cpp_rope_freqs(scaling: dict, head_dim: int) -> list[float]:
    """Llama-3 scaling as llama.cpp's converter writes it: one divisor per frequency pair (rope_freqs)."""
    import math

    old, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    low, high = old / scaling["low_freq_factor"], old / scaling["high_freq_factor"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * scaling["rope_theta"] ** (i / head_dim)
        smooth = (old / wavelen - scaling["low_freq_factor"]) / (scaling["high_freq_factor"] - scaling["low_freq_factor"])
        out.append(1.0 if wavelen < high else factor if wavelen > low else 1 / ((1 - smooth) / factor + smooth))
    return out


def _write_llama_gguf(hf: torch.nn.Module, path: Path, rope_freqs: list[float] | None, arch: str = "llama",
                     extra: dict[str, object] | None = None) -> None:
    """The tiny HF model as a GGUF file the way llama.cpp's converter lays it out (llama: q/k rows permuted);
    extra: more `{arch}.` keys (str, float or int values)."""
    import gguf

    c, sd = hf.config, hf.state_dict()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads  # SmolLM3's has none
    permuted = arch in ("llama", "smollm3")
    permute = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads} if permuted else {}
    names = {hf_name: gguf_name for gguf_name, hf_name in _GGUF_LAYER_NAMES.items()}
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("embedding_length", c.hidden_size), ("block_count", c.num_hidden_layers),
                       ("feed_forward_length", c.intermediate_size), ("context_length", c.max_position_embeddings),
                       ("attention.head_count", c.num_attention_heads),
                       ("attention.head_count_kv", c.num_key_value_heads), ("attention.key_length", head_dim)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", float(c.rope_parameters["rope_theta"]))
    for key, value in (extra or {}).items():
        add = w.add_string if isinstance(value, str) else w.add_float32 if isinstance(value, float) else w.add_uint32
        add(f"{arch}.{key}", value)
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    for name, tensor in sd.items():
        if name in top:
            w.add_tensor(top[name], tensor.numpy())
            continue
        parts = name.split(".")  # model.layers.L.<module>.<kind>
        layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
        if parts[-2] in permute:  # convert_hf_to_gguf.py's permute for llama.cpp's RoPE
            n = permute[parts[-2]]
            tensor = tensor.reshape(n, 2, tensor.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(tensor.shape)
        w.add_tensor(f"blk.{layer}.{names[module]}.{kind}", tensor.contiguous().numpy())
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.array(rope_freqs, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_rope_freqs_llama3_scaling_matches_hf(tmp_path: Path) -> None:
    """A Llama-3.x GGUF keeps its RoPE scaling as the rope_freqs tensor: loaded, it gives HF's tokens."""
    scaling = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf = tiny_hf_model("llama", seed=6, rope_parameters=scaling)
    path = tmp_path / "llama3.gguf"
    _write_llama_gguf(hf, path, _llama_cpp_rope_freqs(scaling, hf.config.head_dim))
    config = load_model_config(path)
    assert config.rope_scaling is not None and config.rope_scaling.rope_type == "freq_factors"
    ours = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    assert torch.allclose(ours, hf.model.rotary_emb.inv_freq)
    assert _greedy(path) == hf_greedy(hf, PROMPT, 6)


def test_qwen3_gguf_matches_hf(tmp_path: Path) -> None:
    """A Qwen3 GGUF (llama.cpp's names: attn_q_norm / attn_k_norm, qwen3.attention.key_length) gives HF's
    tokens."""
    hf = tiny_hf_model("qwen3", seed=9)
    path = tmp_path / "qwen3.gguf"
    _write_llama_gguf(hf, path, None, arch="qwen3")
    config = load_model_config(path)
    assert (config.architecture, config.head_dim, config.qk_norm) == ("qwen3", 128, True)
    assert _greedy(path) == hf_greedy(hf, PROMPT, 6)


def test_unknown_rope_scaling_is_refused(tmp_path: Path) -> None:
    tiny_hf_model("llama").config.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "factor": 4.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported rope scaling 'longrope'"):
        load_model_config(tmp_path)


def test_dense_gguf_copy_holds_the_same_weights(tmp_path: Path) -> None:
    """scripts/dense_gguf.py (the llama.cpp comparison's model file): a bf16 copy of the built-in Q4_1 GGUF
    loads as the same model with exactly the bf16 weights cobatch serves."""
    import subprocess
    import sys

    out = tmp_path / "dense.gguf"
    subprocess.run([sys.executable, str(Path(__file__).parents[1] / "scripts" / "dense_gguf.py"), str(out)],
                   check=True, capture_output=True, timeout=300)
    reference, config = load_model(resolve_model_path(None), torch.bfloat16, "cpu")
    dense, dense_config = load_model(out, torch.bfloat16, "cpu")
    assert dense_config == config
    params = dict(reference.named_parameters())
    assert all(torch.equal(params[name], p) for name, p in dense.named_parameters())
