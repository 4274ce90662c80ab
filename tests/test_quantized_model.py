"""The default model in Q8_0, Q4_0, Q4_1, Q5_1 and Q4_K GGUF files (scripts/quantize_gguf.py) and quantized at load from
an HF folder (`quantization="q8_0"`): its weights stay quantized (the model's tensor bytes are the
file's), and its greedy output, teacher-forced through the same weights dequantized to fp32, ranks every
token in that reference's top 5 (issue 20's criterion; most are its first choice)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest
import torch

from cobatch.kernels.quant_linear import is_quantized, native_quant_gemm, quant_type, quantized_rows, quantized_shape
from cobatch.llm import LLM
from cobatch.model_paths import is_bundled_model, resolve_model_path
from cobatch.models.loader import _mostly_served
from cobatch.runner.layer_loop import native_layer_loop
from cobatch.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(native_quant_gemm() is None, reason="the kernels library cannot be built here")

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "scripts" / "quantize_gguf.py"
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
NEW_TOKENS = 24
# no prefix cache: the reference (the same engine, dequantized) must not reuse the quantized run's K/V
ENGINE = dict(num_kv_blocks=64, max_model_len=256, block_size=16, max_num_batched_tokens=16,
              enable_prefix_caching=False)


@pytest.fixture(scope="session")
def quantized_gguf(pytestconfig: pytest.Config):
    """fmt -> the default model's GGUF in that format, written once per version of the script and its
    quantizer into pytest's cache (about 20 s each)."""
    digest = hashlib.sha256(SCRIPT.read_bytes() + (ROOT / "cobatch/models/quantization.py").read_bytes()
                            + (ROOT / "cobatch/models/iq2_grid.py").read_bytes()
                            + (ROOT / "cobatch/models/iq1_trit.py").read_bytes())
    folder = pytestconfig.cache.mkdir(f"quantized-gguf-{digest.hexdigest()[:12]}")

    def make(fmt: str, *tensor_types: str) -> Path:
        mix = hashlib.sha256(" ".join(tensor_types).encode()).hexdigest()[:8] if tensor_types else ""
        path = folder / f"smollm2-{fmt}{'-' + mix if mix else ''}.gguf"
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            overrides = [arg for t in tensor_types for arg in ("--tensor-type", t)]
            subprocess.run([sys.executable, str(SCRIPT), str(tmp), "--type", fmt, *overrides], check=True,
                           capture_output=True, timeout=600)
            tmp.rename(path)
        return path

    return make


@pytest.fixture(scope="module")
def hf_folder(hf_default_model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model as an fp32 Hugging Face folder (transformers' own load of the GGUF, saved)."""
    from safetensors.torch import save_file

    hf, tok = hf_default_model
    path = tmp_path_factory.mktemp("smollm2-hf")
    # save_pretrained refuses a model transformers loaded from a GGUF: write its three files directly
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(state, str(path / "model.safetensors"))
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    (path / "config.json").write_text(json.dumps(config))
    tok.save_pretrained(path)
    return path


def _model(llm: LLM) -> torch.nn.Module:
    return llm.engine.runner.model  # type: ignore[attr-defined]


def _dequantize_in_place(model: torch.nn.Module) -> None:
    """Every quantized weight replaced by its dense fp32 values (the reference: the same weights)."""
    for param in model.parameters():
        if is_quantized(param):
            rows = torch.arange(quantized_shape(param)[0])
            param.data = quantized_rows(rows, param.data, torch.float32)


def _ranks_under(reference: LLM, prompt: list[int], generated: list[int]) -> list[int]:
    """The rank of each generated token in the reference's distribution, given the same prefix."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = reference.generate([{"prompt_token_ids": prompt + generated}], params, use_tqdm=False)[0]
    return [entry.rank for entry in out.prompt_logprobs[len(prompt):]]  # type: ignore[index, union-attr]


def _check_against_dequantized(llm: LLM, formats: set[str]) -> None:
    quantized = {quant_type(p).name for p in _model(llm).parameters() if is_quantized(p)}
    assert quantized == formats
    tok = llm.tokenizer  # type: ignore[attr-defined]
    prompts = [tok.encode(t) for t in TEXTS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _dequantize_in_place(_model(llm))  # the same engine becomes the reference: dense fp32, the Python loop
    runner = llm.engine.runner  # type: ignore[attr-defined]
    runner.native_decoder = native_layer_loop(runner.model)  # the C loop held the quantized tensors
    assert runner.native_decoder is None
    assert not any(is_quantized(p) for p in _model(llm).parameters())
    for prompt, out in zip(prompts, outs):
        generated = list(out.outputs[0].token_ids)
        ranks = _ranks_under(llm, prompt, generated)
        assert max(ranks) <= 5, f"ranks under the dequantized reference: {ranks}"
        assert sum(r == 1 for r in ranks) >= 0.75 * len(ranks), ranks


def _matrix_bytes(path: Path) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if len(t.shape) > 1)


@pytest.mark.parametrize("fmt,formats", [("q8_0", {"q8_0"}), ("q4_0", {"q4_0"}), ("q4_1", {"q4_1"}),
                                         ("q5_1", {"q5_1"}), ("q4_k", {"q4_k", "q4_0"})])
def test_quantized_gguf_keeps_its_bytes_and_matches_its_dequantized_weights(quantized_gguf, fmt: str,
                                                                          formats: set[str]) -> None:
    """No dense copy kept: the loaded model's matrices hold exactly the file's matrix bytes (the packed
    layout reorders blocks, it adds nothing; the file is little more than its tensors; the norm vectors
    take the model's dtype, bf16 on a CPU with AVX512-BF16). Q4_K: SmolLM2's hidden size 576 is no
    multiple of 256, so only ffn_down is Q4_K (the rest falls back to Q4_0, as llama-quantize falls back)."""
    path = quantized_gguf(fmt)
    llm = LLM(str(path), **ENGINE)
    params = list(_model(llm).parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in params)
    assert sum(p.numel() * p.element_size() for p in params if p.dim() > 1) == _matrix_bytes(path)
    assert model_bytes >= 0.97 * path.stat().st_size
    _check_against_dequantized(llm, formats)


# As llama-quantize's mixes do: some attn_v and ffn_down in other types, a fused q | k | v of two formats.
MIX = (r"blk\.[0-4]\.attn_v=q5_0", r"blk\.10\.ffn_down=mxfp4", r"blk\.11\.ffn_down=tq1_0", r"blk\.29\.ffn_down=tq2_0",
       r"blk\.12\.ffn_down=iq2_xxs", r"blk\.16\.ffn_down=iq1_s",
       r"blk\.13\.ffn_down=q3_k",
       r"blk\.14\.ffn_down=q2_k",
       r"blk\.2[0-4]\.attn_k=q8_0",
       r"blk\.2[5-9]\.ffn_down=q5_0", r"blk\.[5-9]\.ffn_down=q6_k", r"blk\.1[5-9]\.ffn_down=q5_k",
       r"blk\.2[0-4]\.ffn_down=q5_1", r"blk\.[0-4]\.ffn_down=iq4_xs",
       r"blk\.[0-4]\.ffn_(gate|up)=iq4_nl")


def test_a_mixed_file_stays_quantized_each_matrix_as_q8_0_where_not_served(quantized_gguf) -> None:
    """An MXFP4 matrix becomes Q8_0 (requantized), and so does q | k | v of three runs of formats (Q4_0, Q8_0,
    Q4_0); q | k | v of two (Q4_0 q, k; a Q5_0 v) keeps both, v apart; a TQ1_0 one TQ2_0 (exactly), an
    IQ2_XXS one IQ2_GRID (IQ4_TAB without VBMI; exactly), an IQ1_S one IQ1_TRIT (exactly); a Q2_K, Q3_K, Q5_0,
    Q5_1, Q5_K, Q6_K, IQ4_XS or TQ2_0 ffn_down and an IQ4_NL gate | up stay as they are (their values exactly): no
    dense matrix, a little more than the file's bytes, greedy output ranked by its dequantized weights as the
    plain files' is."""
    path = quantized_gguf("q4_0", *MIX)
    llm = LLM(str(path), **ENGINE)
    model = _model(llm)
    assert all(is_quantized(p) for p in model.parameters() if p.dim() > 1)
    layer0 = model.layers[0]  # type: ignore[index]
    assert quant_type(layer0.qkv_proj).name == "q4_0" and quant_type(layer0.qkv_tail_proj).name == "q5_0"
    assert quant_type(model.layers[5].qkv_proj).name == "q4_0" and model.layers[5].qkv_tail_proj is None
    assert quant_type(model.layers[20].qkv_proj).name == "q8_0" and model.layers[20].qkv_tail_proj is None
    assert quant_type(model.layers[25].down_proj).name == "q5_0"
    assert quant_type(model.layers[5].down_proj).name == "q6_k"
    assert quant_type(model.layers[15].down_proj).name == "q5_k"
    assert quant_type(model.layers[20].down_proj).name == "q5_1"
    assert quant_type(model.layers[0].down_proj).name == "iq4_xs"
    assert quant_type(model.layers[13].down_proj).name == "q3_k"
    assert quant_type(model.layers[14].down_proj).name == "q2_k"
    assert quant_type(model.layers[10].down_proj).name == "q8_0"
    assert quant_type(model.layers[11].down_proj).name == "tq2_0"
    assert quant_type(model.layers[29].down_proj).name == "tq2_0"
    kernel = native_quant_gemm()
    iq2 = "iq2_grid" if kernel is not None and kernel.byte_lookups else "iq4_tab"
    assert quant_type(model.layers[12].down_proj).name == iq2
    assert quant_type(model.layers[16].down_proj).name == "iq1_trit"
    assert quant_type(model.layers[0].gate_up_proj).name == "iq4_nl"
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() > 1)
    assert model_bytes <= 1.2 * _matrix_bytes(path)
    reader = {t.name: t for t in gguf.GGUFReader(path).tensors}
    v = reader["blk.0.attn_v.weight"]  # Q5_0 in the file, kept apart: its values exactly
    v_dense = torch.from_numpy(gguf.quants.dequantize(v.data, v.tensor_type))
    assert quantized_shape(layer0.qkv_tail_proj)[0] == v_dense.shape[0]
    assert torch.equal(quantized_rows(torch.arange(v_dense.shape[0]), layer0.qkv_tail_proj.data, torch.float32),
                       v_dense)
    down = reader["blk.10.ffn_down.weight"]  # MXFP4: within Q8_0's rounding (and its fp16 scale's)
    down_dense = torch.from_numpy(gguf.quants.dequantize(down.data, down.tensor_type))
    served = quantized_rows(torch.arange(down_dense.shape[0]), model.layers[10].down_proj.data, torch.float32)
    block_max = down_dense.abs().reshape(down_dense.shape[0], -1, 32).amax(-1, keepdim=True)
    error = (served - down_dense).abs().reshape(block_max.shape[0], -1, 32)
    assert (error <= block_max * (1 / 254 + 1 / 1024)).all()
    # Q6_K, Q5_K, Q5_1, IQ4_XS, Q3_K, Q2_K, TQ1_0, TQ2_0, IQ2_XXS, IQ1_S
    for layer in (5, 15, 20, 0, 13, 14, 11, 29, 12, 16):
        down_k = reader[f"blk.{layer}.ffn_down.weight"]
        down_k_dense = torch.from_numpy(gguf.quants.dequantize(down_k.data, down_k.tensor_type))
        served_k = quantized_rows(torch.arange(down_k_dense.shape[0]), model.layers[layer].down_proj.data,
                                  torch.float32)
        assert torch.equal(served_k, down_k_dense)
    gate = reader["blk.0.ffn_gate.weight"]  # IQ4_NL: its values exactly
    gate_dense = torch.from_numpy(gguf.quants.dequantize(gate.data, gate.tensor_type))
    served_gate = quantized_rows(torch.arange(gate_dense.shape[0]), model.layers[0].gate_up_proj.data, torch.float32)
    assert torch.equal(served_gate, gate_dense)
    _check_against_dequantized(llm, {"q4_0", "q8_0", "q5_0", "q5_1", "q5_k", "q6_k", "iq4_xs", "iq4_nl",
                                     "q3_k", "q2_k", iq2, "iq1_trit", "tq2_0"})


def test_hf_folder_quantized_at_load_matches_its_dequantized_weights(hf_folder: Path) -> None:
    _check_against_dequantized(LLM(str(hf_folder), quantization="q8_0", **ENGINE), {"q8_0"})


def test_quantization_at_load_holds_q8_0_bytes(hf_folder: Path) -> None:
    """`quantization="q8_0"` on an fp32 folder: 34 bytes per 32 weights of every matrix, norms dense."""
    llm = LLM(str(hf_folder), quantization="q8_0", **ENGINE)
    model = _model(llm)
    matrices = [p for p in model.parameters() if p.dim() > 1]
    assert all(is_quantized(p) for p in matrices)
    weights = sum(quantized_shape(p)[0] * quantized_shape(p)[1] for p in matrices)
    assert sum(p.numel() for p in matrices) == weights * 34 // 32
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 1)
    assert dense_bytes < 0.001 * weights * 4


def test_the_bundled_model_is_served_dense() -> None:
    """The shipped file is Q4_1 (a served format) but it is the project's reference model: dequantized, by
    name or by path."""
    path = resolve_model_path(None)
    assert path.name.endswith("Q4_1.gguf") and is_bundled_model(path) and is_bundled_model(str(path))
    llm = LLM(None, **ENGINE)
    assert not any(is_quantized(p) for p in _model(llm).parameters())


def test_a_file_mostly_in_other_types_is_served_dense() -> None:
    """Requantizing most of a file to Q8_0 would hold more than its bytes: a file whose matrix bytes are
    mostly in types the kernel does not serve stays dense; a few such matrices do not decide it."""
    def tensor(kind: gguf.GGMLQuantizationType, n_bytes: int) -> SimpleNamespace:
        return SimpleNamespace(shape=[64, 64], n_bytes=n_bytes, tensor_type=kind)

    norm = SimpleNamespace(shape=[64], n_bytes=10**6, tensor_type=gguf.GGMLQuantizationType.F32)
    mxfp4, q4_1 = gguf.GGMLQuantizationType.MXFP4, gguf.GGMLQuantizationType.Q4_1
    assert _mostly_served([tensor(q4_1, 60), tensor(mxfp4, 40), norm])
    assert not _mostly_served([tensor(q4_1, 40), tensor(mxfp4, 60), norm])
