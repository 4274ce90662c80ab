"""Named real Llama-family shapes, and random-weight Hugging Face checkpoints of them.

No model but SmolLM2-135M ships in a package here, yet speed and kernel paths depend on the shape
(head_dim, GQA ratio, intermediate size, vocabulary, qkv bias, tied embeddings, rope scaling), not on the
weights' values. So this writes a folder that loads like the real thing: config.json as the model's
own (values from its published config.json), generation_config.json, safetensors with HF tensor names,
and a tokenizer. The tokenizer is the default model's (SmolLM2's, 49152 tokens), the one available
offline: a model whose vocabulary is larger (Qwen2.5, Llama 3.2) never sees the ids past it in a text
prompt, and its outputs past it decode to nothing; for a smaller one (TinyLlama, Llama 2: 32000) the
tokenizer is cut to the model's vocabulary (its first tokens and the BPE merges that make them).

    .venv/bin/python -m benchmarks.shapes OUT_DIR --shape qwen2.5-0.5b [--layers 4] [--dtype bf16]
    .venv/bin/python -m benchmarks.shapes --list

Weights: normal(0, init_std) (0.02, as the models' initializer_range), biases the same, norms 1 (Qwen3's
q / k head norms 1 + normal(0, init_std), so that a swap of the two shows), so activations stay in the
trained models' range. Tests pass a larger init_std for peaked logits (greedy
comparisons without near-ties) and small variants of the shapes (tests/test_shapes.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import Iterator

from cobatch.models.model_config import ModelConfig, RopeScaling, no_rope_every

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
_SHARD_BYTES = 2 << 30  # safetensors shards of at most ~2 GiB, as save_pretrained shards


def config_json(shape: ModelConfig) -> dict[str, object]:
    """The config.json of `shape` (the keys transformers and cobatch's loader read)."""
    eos = list(shape.eos_token_ids)
    cfg: dict[str, object] = {
        "architectures": [_HF_CLASSES[shape.architecture]], "model_type": shape.architecture, "hidden_act": "silu",
        "hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers, "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads, "head_dim": shape.head_dim, "vocab_size": shape.vocab_size,
        "tie_word_embeddings": shape.tie_word_embeddings, "rope_theta": shape.rope_theta,
        "rope_scaling": _rope_scaling_json(shape.rope_scaling), "rms_norm_eps": shape.rms_norm_eps,
        "max_position_embeddings": shape.max_position_embeddings, "bos_token_id": shape.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos, "initializer_range": 0.02, "torch_dtype": "bfloat16",
    }
    if shape.architecture.startswith("qwen"):  # qwen2: q/k/v biases are implied
        cfg.update(use_sliding_window=False, sliding_window=shape.max_position_embeddings,
                   max_window_layers=shape.num_layers, attention_dropout=0.0)
    if shape.architecture != "qwen2":
        cfg.update(attention_bias=shape.attention_bias, mlp_bias=False)
    if shape.architecture == "smollm3":  # 1: the layer uses RoPE
        cfg.update(no_rope_layers=[int(i not in shape.no_rope_layers) for i in range(shape.num_layers)],
                   use_sliding_window=False)
    return cfg


def _rope_scaling_json(scaling: RopeScaling | None) -> dict[str, object] | None:
    if scaling is None:
        return None
    if scaling.rope_type == "linear":
        return {"rope_type": "linear", "factor": scaling.factor}
    return {"rope_type": scaling.rope_type, "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings}


def _shape(name: str, arch: str, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, head_dim: int,
           vocab: int, tied: bool, theta: float, max_pos: int, eps: float, bos: int, eos: tuple[int, ...],
           rope_scaling: RopeScaling | None = None) -> ModelConfig:
    return ModelConfig(name, arch, vocab, hidden, inter, layers, heads, kv_heads, head_dim, eps, theta, max_pos,
                       tied, arch == "qwen2", bos, eos, rope_scaling, qk_norm=arch == "qwen3",
                       no_rope_layers=no_rope_every(4, layers) if arch == "smollm3" else ())


_HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "smollm3": "SmolLM3ForCausalLM"}
_LLAMA3_ROPE = RopeScaling("llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=8192)

# From each model's published config.json (the -Instruct variants where the ids differ).
SHAPES: dict[str, ModelConfig] = {s.name: s for s in (
    _shape("smollm2-135m", "llama", 576, 1536, 30, 9, 3, 64, 49152, True, 100000.0, 8192, 1e-5, 1, (2,)),
    _shape("qwen2.5-0.5b", "qwen2", 896, 4864, 24, 14, 2, 64, 151936, True, 1e6, 32768, 1e-6, 151643, (151645,)),
    _shape("llama-3.2-1b", "llama", 2048, 8192, 16, 32, 8, 64, 128256, True, 500000.0, 131072, 1e-5, 128000,
           (128001, 128008, 128009), _LLAMA3_ROPE),
    _shape("tinyllama-1.1b", "llama", 2048, 5632, 22, 32, 4, 64, 32000, False, 10000.0, 2048, 1e-5, 1, (2,)),
    _shape("qwen2.5-1.5b", "qwen2", 1536, 8960, 28, 12, 2, 128, 151936, True, 1e6, 32768, 1e-6, 151643, (151645,)),
    # Qwen3: RMSNorm on each q and k head, head_dim 128 wider than hidden / heads (q_proj 1024 -> 2048), no bias.
    _shape("qwen3-0.6b", "qwen3", 1024, 3072, 28, 16, 8, 128, 151936, True, 1e6, 40960, 1e-6, 151643, (151645,)),
    _shape("qwen3-1.7b", "qwen3", 2048, 6144, 28, 16, 8, 128, 151936, True, 1e6, 40960, 1e-6, 151643, (151645,)),
    # SmolLM3: Llama's layout with no RoPE in every fourth layer (NoPE), GQA 4, head_dim 128.
    _shape("smollm3-3b", "smollm3", 2048, 11008, 36, 16, 4, 128, 128256, True, 5e6, 65536, 1e-6, 128000, (128012,)),
    # Multi-head attention (GQA ratio 1) with head_dim 128, untied: the older Llama 2 layout.
    _shape("llama-2-7b", "llama", 4096, 11008, 32, 32, 32, 128, 32000, False, 10000.0, 4096, 1e-5, 1, (2,)),
)}


def num_params(shape: ModelConfig) -> int:
    """Parameters of the full checkpoint (a tied lm_head counted once)."""
    return sum(math.prod(dims) for _, dims in tensor_shapes(shape))


def tensor_shapes(shape: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint, HF-named, in the order save_pretrained writes them."""
    h, i, hd = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q, kv = shape.num_heads * hd, shape.num_kv_heads * hd
    yield "model.embed_tokens.weight", (shape.vocab_size, h)
    for layer in range(shape.num_layers):
        p = f"model.layers.{layer}."
        yield p + "input_layernorm.weight", (h,)
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            yield f"{p}self_attn.{name}_proj.weight", (rows, h)
            if shape.attention_bias:
                yield f"{p}self_attn.{name}_proj.bias", (rows,)
        if shape.qk_norm:
            yield p + "self_attn.q_norm.weight", (hd,)
            yield p + "self_attn.k_norm.weight", (hd,)
        yield p + "self_attn.o_proj.weight", (h, q)
        yield p + "post_attention_layernorm.weight", (h,)
        yield p + "mlp.gate_proj.weight", (i, h)
        yield p + "mlp.up_proj.weight", (i, h)
        yield p + "mlp.down_proj.weight", (h, i)
    yield "model.norm.weight", (h,)
    if not shape.tie_word_embeddings:
        yield "lm_head.weight", (shape.vocab_size, h)


def write_checkpoint(shape: ModelConfig, out_dir: str | Path, *, num_layers: int | None = None,
                     dtype: str = "bfloat16", init_std: float = 0.02, seed: int = 0,
                     tokenizer_dir: str | Path | None = None) -> Path:
    """Write `shape` (truncated to num_layers when given) with random weights as an HF folder.

    tokenizer_dir: a folder whose tokenizer files are copied (tests reuse one); None: the default
    model's tokenizer, converted from its GGUF (a few seconds)."""
    import torch
    from safetensors.torch import save_file

    if num_layers is not None:
        shape = dataclasses.replace(shape, num_layers=num_layers)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**config_json(shape), "torch_dtype": dtype}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": shape.bos_token_id, "eos_token_id": list(shape.eos_token_ids), "do_sample": False}) + "\n")
    gen = torch.Generator().manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    shards = plan_shards(shape, torch_dtype.itemsize)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)])
    for file, names in zip(files, shards):  # one shard in memory at a time
        tensors = {name: _random_tensor(name, dims, init_std, gen).to(torch_dtype) for name, dims in names}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        weight_map = {name: file for file, names in zip(files, shards) for name, _ in names}
        total = sum(math.prod(dims) for _, dims in tensor_shapes(shape)) * torch_dtype.itemsize
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    _write_tokenizer(out, tokenizer_dir, shape.vocab_size)
    return out


def _random_tensor(name: str, dims: tuple[int, ...], init_std: float, gen: object) -> object:
    import torch

    if name.endswith(("q_norm.weight", "k_norm.weight")):  # Qwen3's head norms: each one matters
        return 1.0 + torch.empty(dims).normal_(0.0, init_std, generator=gen)  # type: ignore[arg-type]
    if name.endswith("norm.weight"):
        return torch.ones(dims)
    return torch.empty(dims).normal_(0.0, init_std, generator=gen)  # type: ignore[arg-type]


def plan_shards(shape: ModelConfig, itemsize: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The tensors split into files of at most ~2 GiB each, in order (as save_pretrained shards)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in tensor_shapes(shape):
        nbytes = math.prod(dims) * itemsize
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    return shards


def _write_tokenizer(out: Path, tokenizer_dir: str | Path | None, vocab_size: int) -> None:
    if tokenizer_dir is not None:
        for file in _TOKENIZER_FILES:
            if (Path(tokenizer_dir) / file).exists():
                shutil.copy(Path(tokenizer_dir) / file, out / file)
    else:
        save_default_tokenizer(out)
    _cut_vocabulary(out / "tokenizer.json", vocab_size)


def _cut_vocabulary(path: Path, vocab_size: int) -> None:
    """Keep a BPE tokenizer's first `vocab_size` tokens and the merges that make them, so that every
    id it emits is one the model has (llama.cpp's converter also refuses a larger tokenizer). A BPE
    merge's result is numbered after the merges before it, so the cut keeps a prefix of the merges."""
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    if len(vocab) <= vocab_size:
        return
    data["model"]["vocab"] = {token: i for token, i in vocab.items() if i < vocab_size}
    data["model"]["merges"] = [m for m in data["model"]["merges"]
                               if vocab["".join(m if isinstance(m, list) else m.split(" "))] < vocab_size]
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < vocab_size]
    path.write_text(json.dumps(data, ensure_ascii=False))


def save_default_tokenizer(out: str | Path) -> Path:
    """The default model's tokenizer (SmolLM2's, from its GGUF), saved as HF tokenizer files in `out`."""
    from transformers import AutoTokenizer

    from cobatch.model_paths import resolve_model_path

    gguf = resolve_model_path(None)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return Path(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="folder to write (created)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first K layers")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--init-std", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--list", action="store_true", help="print the named shapes and exit")
    args = parser.parse_args()
    if args.list or args.out is None:
        for s in SHAPES.values():
            print(f"{s.name:16} {s.architecture:6} hidden {s.hidden_size:5} inter {s.intermediate_size:6} "
                  f"layers {s.num_layers:3} heads {s.num_heads:3}/{s.num_kv_heads:<3} hd {s.head_dim:4} "
                  f"vocab {s.vocab_size:7} tied {s.tie_word_embeddings!s:5} {num_params(s) / 1e9:.2f}B params")
        return
    shape = SHAPES[args.shape]
    path = write_checkpoint(shape, args.out, num_layers=args.layers, dtype=args.dtype, init_std=args.init_std,
                            seed=args.seed)
    print(f"wrote {path} ({shape.name}, {args.layers or shape.num_layers} layers, {args.dtype})")


if __name__ == "__main__":
    main()
