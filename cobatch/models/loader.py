"""Load a Llama-family model from a Hugging Face folder (safetensors) or a GGUF file.

Both sources are first turned into HF-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...), then
`build_model` fuses them into the decoder's layout (QKV and gate/up concatenated). A GGUF tensor in a
format the quantized kernel serves (Q8_0, Q4_0, Q4_1, Q2_K, Q3_K, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, IQ4_NL, IQ4_XS:
kernels/quant_linear.py) stays as its blocks, a uint8 [N, K / block, block_bytes] tensor, and the model
keeps it packed, never dense (so the Q6_K lm_head, attn_v and ffn_down of llama-quantize's Q4_K_M mix stay
Q6_K, and the Q5_1 matrices its Q5_K_M puts where K is no multiple of 256 stay Q5_1). In a file mostly in
those formats (or in the i-quants' grid types), a matrix in another quantized type becomes blocks of a
served one (models/requantize.py): IQ1_TRIT holding an IQ1_S matrix's values exactly (2-bit codes), IQ4_TAB an
IQ3_XXS or IQ3_S one's (and an IQ2_XXS one's where the CPU lacks VBMI: else IQ2_GRID, its own grid), IQ3_TAB16
an IQ2_XS, IQ2_S or IQ1_M one's, else Q8_0, requantized from the dequantized values of the rest (exactly from an
IQ4_NL matrix whose K is no multiple of 64), and so does a fused projection whose parts are in three formats or more (exactly from
Q4_0, Q5_0 and IQ4_NL parts): dense fp32 copies of them would hold 4-5x their bytes and be streamed every
step. A q | k | v in two formats keeps both: qkv_proj the rows in the first, qkv_tail_proj the rest
(_WeightFiller.qkv). Other files are dequantized with `gguf`, and so is the bundled model
(model_paths.is_bundled_model): it is the project's reference, served dense as its figures and its
token-for-token match with HF transformers are, and is Q4_1 only because that is how its package ships it.
`quantization` ("q8_0" | "q4_0") quantizes the dense projections and embeddings at load
(models/quantization.py).

Weight-only bf16: a model computed in fp32 on CPU keeps a projection or embedding table whose source
values are bf16 (a bf16 safetensors tensor, a GGUF BF16 tensor) in bf16 where the native fp32-on-bf16
GEMM reads it (kernels/linear.py, csrc/gemm_f32_wbf16.c): bf16 -> fp32 is exact, so the math is the same
fp32 math on the same values, at half the bytes a decode step streams. Norms, biases, the KV cache and
activations stay fp32; `weight_only_bf16=False` (or COBATCH_NO_NATIVE=1) converts everything, as before.
"""

from __future__ import annotations

import ctypes
import itertools
import json
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from cobatch.kernels.hugepages import move_to_huge_pages
from cobatch.kernels.linear import can_pack
from cobatch.kernels.quant_linear import FORMATS, QuantFormat, can_pack_blocks, is_quantized, pack_blocks
from cobatch.models.llama import DecoderLayer, LlamaForCausalLM
from cobatch.models import quantization as quant
from cobatch.models import requantize
from cobatch.models.model_config import (SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling, no_rope_every,
                                         yarn_mscale)
from cobatch.model_paths import is_bundled_model, is_gguf, resolve_model_path

__all__ = ["ModelConfig", "build_model", "load_model", "load_model_config", "resolve_model_path"]

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGUF's unquantized tensor types: kept as they are (BF16 as bf16, F16 / F32 in the model's dtype).
_DENSE_TYPES = frozenset(("F32", "F16", "BF16", "F64"))
# GGUF architectures whose q/k rows llama.cpp's converter permuted for its RoPE kernel.
_GGUF_PERMUTED_ARCHS = ("llama", "mistral", "smollm3")
# GGUF architectures whose NoPE layers the architecture implies (llama.cpp's n_no_rope_layer_step).
_GGUF_NO_ROPE_EVERY = {"smollm3": 4}


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               quantization: str | None = None,
               weight_only_bf16: bool = True) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Load the model at `path` (HF folder or .gguf file) in `dtype` on `device`; `quantization` ("q8_0",
    "q4_0") quantizes its dense projections and embeddings; weight_only_bf16: bf16 weights stay bf16
    under fp32 math where the kernel is (the module docstring)."""
    path = Path(path)
    if is_gguf(path):
        config, tensors = _load_gguf(path, dtype)
    else:
        config, tensors = load_model_config(path), _load_hf_tensors(path)
    model = build_model(config, tensors, dtype, device, quantization, weight_only_bf16)
    del tensors
    release_freed_heap()
    return model, config


def release_freed_heap() -> None:
    """Hand memory freed by loading back to the OS (glibc's malloc_trim).

    Dequantizing a GGUF and fusing weights allocates fp32 copies that are freed by now, but glibc keeps
    freed heap pages mapped: without this, ~290 MiB of the default model's load stays resident for the
    life of the server. A no-op where the C library has no malloc_trim.
    """
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def load_model_config(path: str | Path) -> ModelConfig:
    """Only the config: GGUF metadata, or config.json (+ generation_config.json's EOS ids)."""
    path = Path(path)
    if is_gguf(path):
        import gguf
        return _gguf_config(gguf.GGUFReader(path), path)
    cfg = json.loads((path / "config.json").read_text())
    _check_hf_supported(cfg)
    gen_path = path / "generation_config.json"
    gen_eos = json.loads(gen_path.read_text()).get("eos_token_id") if gen_path.exists() else None
    extra = tuple(gen_eos) if isinstance(gen_eos, list) else (() if gen_eos is None else (gen_eos,))
    return ModelConfig.from_hf_config(cfg, name=path.name, extra_eos=extra)


def _check_hf_supported(cfg: Mapping[str, object]) -> None:
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias"):
        raise ValueError("only SiLU MLPs without bias are supported "
                         f"(hidden_act={cfg.get('hidden_act')!r}, mlp_bias={cfg.get('mlp_bias')})")


# ---------------------------------------------------------------------------------------------- building

def build_model(config: ModelConfig, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device | str = "cpu", quantization: str | None = None,
                weight_only_bf16: bool = True) -> LlamaForCausalLM:
    """Fill a fresh decoder from HF-named tensors, fusing QKV and gate/up; weights given as GGUF blocks
    stay quantized, `quantization` quantizes the dense ones (projections, embeddings), and bf16 ones stay
    bf16 under fp32 math where weight_only_bf16 and the kernel allow (the module docstring)."""
    model = LlamaForCausalLM(config, dtype, device)
    get = _Getter(tensors)
    weight = _WeightFiller(quantization if str(device) == "cpu" else None, weight_only_bf16)
    with torch.no_grad():
        weight(model.embed_tokens, [get("model.embed_tokens.weight")])
        _fill(model.norm, get("model.norm.weight"))
        if not config.tie_word_embeddings:
            weight(model.lm_head, [get("lm_head.weight")])
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            attn = [f"{p}self_attn.{x}_proj" for x in "qkv"]
            _fill(layer.input_norm, get(p + "input_layernorm.weight"))
            _fill(layer.post_attention_norm, get(p + "post_attention_layernorm.weight"))
            if layer.q_norm is not None and layer.k_norm is not None:
                _fill(layer.q_norm, get(p + "self_attn.q_norm.weight"))
                _fill(layer.k_norm, get(p + "self_attn.k_norm.weight"))
            weight.qkv(layer, [get(n + ".weight") for n in attn])
            if layer.qkv_bias is not None:
                _fill(layer.qkv_bias, torch.cat([get(n + ".bias") for n in attn]))
            weight(layer.o_proj, [get(p + "self_attn.o_proj.weight")])
            if layer.o_bias is not None:
                _fill(layer.o_bias, get(p + "self_attn.o_proj.bias"))
            weight(layer.gate_up_proj, [get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
            weight(layer.down_proj, [get(p + "mlp.down_proj.weight")])
    if any(is_quantized(p) for p in model.parameters()):
        move_to_huge_pages(list(model.parameters()))  # streamed every decode step (kernels/hugepages.py)
    return model.eval()


class _WeightFiller:
    """Sets a projection or embedding from its parts (rows concatenated): kept quantized when every part
    is GGUF blocks of one format (or `quantization` names one), bf16 when the parts are bf16 under fp32
    math (weight_only_bf16, where the kernel reads it), dense in the model's dtype otherwise."""

    def __init__(self, quantization: str | None, weight_only_bf16: bool = True) -> None:
        if quantization is not None and quantization not in FORMATS:
            raise ValueError(f"unsupported quantization {quantization!r}; supported: {sorted(FORMATS)}")
        self.quantization, self.weight_only_bf16 = quantization, weight_only_bf16

    def qkv(self, layer: DecoderLayer, parts: list[torch.Tensor]) -> None:
        """q | k | v. Blocks in two formats, one run of parts after the other (llama-quantize's Q4_K_M: Q4_K q and
        k, a Q6_K v), stay each in its own: qkv_proj the first run's rows, qkv_tail_proj the second's (two GEMMs
        at their own bytes, where one format for all would be Q8_0's 8.5 bits a weight)."""
        runs = [list(run) for _, run in itertools.groupby(parts, key=_block_format)]
        formats = [_block_format(run[0]) for run in runs]
        if len(runs) != 2 or None in formats:
            self(layer.qkv_proj, parts)
            return
        in_features = layer.qkv_proj.shape[1]
        head, tail = (sum(t.shape[0] for t in run) for run in runs)
        if not all(can_pack_blocks(rows, in_features, fmt)  # type: ignore[arg-type]
                   for rows, fmt in ((head, formats[0]), (tail, formats[1]))):
            self(layer.qkv_proj, parts)
            return
        like = {"dtype": layer.qkv_proj.dtype, "device": layer.qkv_proj.device}
        layer.qkv_proj.data = torch.empty(head, in_features, **like)
        layer.qkv_tail_proj = torch.nn.Parameter(torch.empty(tail, in_features, **like), requires_grad=False)
        self(layer.qkv_proj, runs[0])
        self(layer.qkv_tail_proj, runs[1])

    def __call__(self, param: torch.nn.Parameter, parts: list[torch.Tensor]) -> None:
        formats = {_block_format(t) for t in parts}
        rows, in_features = param.shape
        fmt = next(iter(formats)) if len(formats) == 1 else None
        if len(formats) > 1 and None not in formats:  # blocks of several formats (Q4_K q, k; a Q6_K v)
            fmt = FORMATS["q8_0"]
            parts = [_as_q8_0(t) for t in parts]
        if fmt is not None and can_pack_blocks(rows, in_features, fmt):
            blocks = torch.cat(parts)
            if blocks.shape[0] != rows or blocks.shape[1] * fmt.block_size != in_features:
                raise ValueError(f"weight shape {tuple(blocks.shape)} ({fmt.name} blocks) does not match the "
                                 f"model's {tuple(param.shape)}")
            param.data = pack_blocks(blocks)
            return
        dense = torch.cat([_dense(t) for t in parts])
        target = FORMATS.get(self.quantization or "")
        if target is not None and can_pack_blocks(rows, in_features, target) and dense.shape == param.shape:
            param.data = pack_blocks(quant.quantize(dense, target.name))
            return
        if self.weight_only_bf16 and _keeps_bf16(param, dense):
            param.data = dense  # exact: its fp32 math is the same (the module docstring)
            return
        _fill(param, dense)


def _keeps_bf16(param: torch.Tensor, dense: torch.Tensor) -> bool:
    """Whether a bf16 weight for an fp32 CPU model can stay bf16: its shape fits the packed layout and the
    fp32-on-bf16 kernel is built here."""
    return (dense.dtype == torch.bfloat16 and param.dtype == torch.float32 and param.is_cpu
            and dense.shape == param.shape and can_pack(dense, torch.float32))


def _block_format(tensor: torch.Tensor) -> QuantFormat | None:
    """The format of a tensor of GGUF blocks [N, K / block, block_bytes] (_load_gguf), else None."""
    if tensor.dtype != torch.uint8 or tensor.dim() != 3:
        return None
    return next((f for f in FORMATS.values() if f.block_bytes == tensor.shape[-1]), None)


def _as_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    fmt = _block_format(blocks)
    if fmt is not None and fmt.name == "q8_0":
        return blocks
    if fmt.name not in quant.GGUF_TYPES:  # type: ignore[union-attr]  # IQ4_TAB: no GGUF type
        return quant.quantize(quant.dequantize(blocks, fmt.name), "q8_0")  # type: ignore[union-attr]
    data = blocks.reshape(blocks.shape[0], -1).numpy()
    return requantize.to_q8_0(data, quant.GGUF_TYPES[fmt.name])  # type: ignore[union-attr]


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    fmt = _block_format(tensor)
    return tensor if fmt is None else quant.dequantize(tensor, fmt.name)


class _Getter:
    """Looks tensors up by HF name, accepting checkpoints saved without the `model.` prefix."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __call__(self, name: str) -> torch.Tensor:
        for key in (name, name.removeprefix("model.")):
            if key in self.tensors:
                return self.tensors[key]
        raise KeyError(f"checkpoint has no tensor {name!r}")


def _fill(param: torch.Tensor, src: torch.Tensor) -> None:
    # copy_ would broadcast silently; a shape mismatch means a wrong config or a wrong mapping.
    if param.shape != src.shape:
        raise ValueError(f"weight shape {tuple(src.shape)} does not match the model's {tuple(param.shape)}")
    param.copy_(src)


# -------------------------------------------------------------------------------------- HF folders

def _load_hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if files:
        tensors: dict[str, torch.Tensor] = {}
        for file in files:  # sharded checkpoints: model-00001-of-0000N.safetensors ...
            tensors.update(load_file(file))
        return tensors
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"{path} has no *.safetensors (or pytorch_model*.bin) weights")
    tensors = {}
    for file in bins:
        tensors.update(torch.load(file, map_location="cpu", weights_only=True))
    return tensors


# -------------------------------------------------------------------------------------------- GGUF

def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    import gguf

    reader = gguf.GGUFReader(path)
    config = _gguf_config(reader, path)
    tensors: dict[str, torch.Tensor] = {}
    keep_blocks = not is_bundled_model(path) and _mostly_served(reader.tensors)
    for t in reader.tensors:
        name = _gguf_to_hf_name(t.name)
        if name is None:
            continue
        weight = _gguf_tensor(t, dtype, keep_blocks)
        if config.architecture in _GGUF_PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            weight = reverse_rope_permute(weight, heads)
        tensors[name] = weight
    return config, tensors


def _mostly_served(tensors: list) -> bool:
    """Whether most of a file's matrix bytes are in types the quantized kernel serves, or converts to one
    exactly (the grid types: requantize.TABLES). A file mostly in other types (MXFP4, NVFP4 ...) is served
    dense: requantizing most of it to Q8_0 would change the numerics of all of it."""
    matrices = [t for t in tensors if len(t.shape) == 2]
    served = sum(int(t.n_bytes) for t in matrices
                 if quant.format_of(t.tensor_type) is not None or t.tensor_type in requantize.TABLES)
    return served * 2 > sum(int(t.n_bytes) for t in matrices)


def _gguf_tensor(t: object, dtype: torch.dtype, keep_blocks: bool) -> torch.Tensor:
    """A GGUF tensor as GGUF blocks [N, K / block, block_bytes] (uint8, copied out of the file's mapping)
    where keep_blocks and the quantized kernel serves its type, as blocks of a served type where keep_blocks
    and it is a matrix of another quantized type, or of IQ4_NL with K no multiple of its 64-weight unit
    (requantize.to_served: IQ1_TRIT / IQ2_GRID / IQ4_TAB / IQ3_TAB16 exactly from the grid types, else Q8_0); a
    BF16 one as bf16 (build_model keeps or converts it: weight-only bf16); else dequantized into `dtype`."""
    import gguf

    fmt = quant.format_of(t.tensor_type) if keep_blocks else None  # type: ignore[attr-defined]
    row_bytes = t.data.shape[-1]  # type: ignore[attr-defined]
    if fmt is not None and t.data.ndim == 2 and row_bytes % fmt.block_bytes == 0:  # type: ignore[attr-defined]
        return torch.from_numpy(np.array(t.data)).view(t.data.shape[0], -1, fmt.block_bytes)  # type: ignore
    if t.tensor_type == gguf.GGMLQuantizationType.BF16:  # type: ignore[attr-defined]
        return torch.from_numpy(np.array(t.data)).view(torch.bfloat16)  # type: ignore[attr-defined]  # its bits
    if keep_blocks and t.data.ndim == 2 and t.tensor_type.name not in _DENSE_TYPES:  # type: ignore
        return requantize.to_served(t.data, t.tensor_type)  # type: ignore[attr-defined]
    array = gguf.quants.dequantize(t.data, t.tensor_type)  # type: ignore[attr-defined]
    if not array.flags.writeable:  # memory-mapped F32 tensors: torch wants a writable buffer
        array = np.array(array)
    return torch.from_numpy(array).to(dtype)  # per tensor, so fp32 copies never pile up


def _gguf_to_hf_name(name: str) -> str | None:
    stem, _, kind = name.rpartition(".")  # kind: weight | bias
    if stem in _GGUF_TOP_NAMES:
        return f"{_GGUF_TOP_NAMES[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{kind}"
    return None  # rope_freqs is read into the config (_gguf_rope_scaling)


def reverse_rope_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved pairs -> HF's rotate-half halves)."""
    rows = weight.shape[0]
    half_dim = rows // num_heads // 2
    w = weight.reshape(num_heads, half_dim, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape).contiguous()


def _gguf_config(reader: object, path: Path) -> ModelConfig:
    fields = reader.fields  # type: ignore[attr-defined]

    def get(key: str, default: object = None) -> object:
        return fields[key].contents() if key in fields else default

    arch = str(get("general.architecture"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    tensor_names = {t.name for t in reader.tensors}  # type: ignore[attr-defined]
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")  # type: ignore[attr-defined]
    hidden = int(get(f"{arch}.embedding_length"))  # type: ignore[arg-type]
    num_heads = int(get(f"{arch}.attention.head_count"))  # type: ignore[arg-type]
    eos = [get("tokenizer.ggml.eos_token_id"), get("tokenizer.ggml.eot_token_id")]
    has_bias = "blk.0.attn_q.bias" in tensor_names
    return ModelConfig(
        name=str(get("general.name") or path.stem),
        architecture=arch,
        vocab_size=int(embd.shape[1]),  # GGUF shapes are [in, out]: token_embd is [H, V]
        hidden_size=hidden,
        intermediate_size=int(get(f"{arch}.feed_forward_length")),  # type: ignore[arg-type]
        num_layers=int(get(f"{arch}.block_count")),  # type: ignore[arg-type]
        num_heads=num_heads,
        num_kv_heads=int(get(f"{arch}.attention.head_count_kv", num_heads)),  # type: ignore[arg-type]
        head_dim=int(get(f"{arch}.attention.key_length", hidden // num_heads)),  # type: ignore[arg-type]
        rms_norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),  # type: ignore[arg-type]
        rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),  # type: ignore[arg-type]
        max_position_embeddings=int(get(f"{arch}.context_length", 2048)),  # type: ignore[arg-type]
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=has_bias,
        o_proj_bias="blk.0.attn_output.bias" in tensor_names,
        bos_token_id=_opt(get("tokenizer.ggml.bos_token_id")),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),  # type: ignore[call-overload]
        rope_scaling=_gguf_rope_scaling(get, arch, reader.tensors),  # type: ignore[attr-defined]
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        no_rope_layers=no_rope_every(_GGUF_NO_ROPE_EVERY[arch], int(get(f"{arch}.block_count")))  # type: ignore
        if arch in _GGUF_NO_ROPE_EVERY else (),
    )


def _gguf_rope_scaling(get: object, arch: str, tensors: list) -> RopeScaling | None:
    # llama.cpp's converter writes Llama-3 scaling as a rope_freqs tensor of per-pair divisors.
    freqs = next((t for t in tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        values = np.asarray(freqs.data, dtype=np.float32).reshape(-1)
        return RopeScaling(rope_type="freq_factors", freq_factors=tuple(float(v) for v in values))
    kind = get(f"{arch}.rope.scaling.type")  # type: ignore[operator]
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"unsupported GGUF rope scaling {kind!r}; supported: linear, yarn (or none)")
    factor = float(get(f"{arch}.rope.scaling.factor"))  # type: ignore[operator]
    return _gguf_yarn(get, arch, factor) if kind == "yarn" else RopeScaling(rope_type="linear", factor=factor)


def _gguf_yarn(get: object, arch: str, factor: float) -> RopeScaling:
    """YaRN as llama.cpp reads it: the original context, beta_fast / beta_slow (32 / 1 unless written),
    and cos / sin scaled by attn_factor (1 unless written) times yarn_mscale(factor)."""
    key = f"{arch}.rope.scaling."
    original = get(key + "original_context_length") or get(f"{arch}.context_length")  # type: ignore[operator]
    return RopeScaling(rope_type="yarn", factor=factor, original_max_position_embeddings=int(original),
                       beta_fast=float(get(key + "yarn_beta_fast", 32.0)),  # type: ignore[operator]
                       beta_slow=float(get(key + "yarn_beta_slow", 1.0)),  # type: ignore[operator]
                       attention_factor=float(get(key + "attn_factor", 1.0)) * yarn_mscale(factor))  # type: ignore


def _opt(value: object) -> int | None:
    return None if value is None else int(value)  # type: ignore[call-overload]
