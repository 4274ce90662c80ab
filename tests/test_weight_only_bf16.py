"""Weight-only bf16: bf16 weights kept bf16 (packed) under fp32 math (csrc/gemm_f32_wbf16.c via
kernels/linear.py; the loader's choice: models/loader.py). The kernel against a float64 reference and
against the fp32 kernel on the upcast weight (the same bits: bf16 -> fp32 is exact), batch and thread
invariance, the fused SiLU gate/up variant, the rows lookup; a bf16 HF folder and a BF16 GGUF loaded in
fp32 keep their weights bf16, generate HF fp32's greedy tokens, and the C layer loop gives the Python
loop's bits; COBATCH_NO_NATIVE and weight_only_bf16=False convert them to fp32 as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cobatch.kernels import bindings
from cobatch.kernels import linear as linear_module
from cobatch.kernels.bindings import load_kernels
from cobatch.kernels.build import load_library
from cobatch.kernels.cpu import cpu_flags
from cobatch.kernels.fused_ops import fused_ops
from cobatch.kernels.linear import (PackedGemm, PackedGemmSilu, can_pack, embedding, is_gate_up_packed, is_packed,
                                   linear, native_gemm, pack_gate_up, pack_weight, silu_mul_linear, unpack_weight)
from cobatch.models.llama import LlamaForCausalLM
from cobatch.models.loader import load_model
from cobatch.runner.model_runner import ModelRunner
from tests.runner_helpers import BlockAllocator, hf_greedy, step, tiny_hf_model
from tests.test_native_decoder import _forward, _mixed_step

F32 = torch.float32
KERNEL = native_gemm(F32, torch.bfloat16)
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no AVX-512F or no compiler here")
FP32_EPS = 2.0 ** -24


def _operands(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    return torch.randn(m, k, generator=g), w, torch.randn(n, generator=g)


# M: every tile height, a 1-row rest, a prefetch-balanced rest, a chunk and a half; N: panels 1..9 (single
# panels whatever the count); K: one pair, pairs off any tile, K blocks (1030: 2 of 516, 2050: 3 of 684)
@pytest.mark.parametrize("m", [*range(1, 10), 16, 17, 25, 130])
@pytest.mark.parametrize("n,k", [(16, 2), (48, 64), (80, 130), (144, 576), (32, 1030), (96, 2050)])
def test_matches_float64_and_the_fp32_kernel_bits(m: int, n: int, k: int) -> None:
    """Within a sequential fp32 sum's error bound of the float64 value, and bit for bit what gemm_f32
    computes on W.float(): the same sum in the same order."""
    x, w, b = _operands(m, n, k)
    out = linear(x, pack_weight(w, F32), b)
    ref = F.linear(x.double(), w.double(), b.double())
    bound = (k + 1) * FP32_EPS * F.linear(x.double().abs(), w.double().abs(), b.double().abs())
    assert out.dtype == F32 and ((out.double() - ref).abs() <= bound).all()
    assert torch.equal(out, linear(x, pack_weight(w.float()), b))
    assert torch.equal(linear(x, pack_weight(w, F32)), linear(x, pack_weight(w.float())))  # no bias


def test_single_panels_and_round_trip() -> None:
    """packed[p, kk, c, t] = W[16 p + c, 2 kk + t]: bf16's K pairs in single panels (gemm_f32's streams),
    also where the bf16 kernel would take blocks of 3; the kernel reads nothing else."""
    w = torch.arange(96 * 6, dtype=F32).view(96, 6).bfloat16()
    packed = pack_weight(w, F32)
    assert packed.shape == (6, 3, 16, 2) and packed.dtype == torch.bfloat16
    assert packed[1, 2, 3, 1] == w[16 + 3, 5] and torch.equal(unpack_weight(packed), w)
    assert KERNEL.reads(packed) and not KERNEL.reads(pack_weight(w)) and not KERNEL.reads(pack_weight(w.float()))
    assert can_pack(w, F32) and not can_pack(w[:, :5], F32) and not can_pack(w[:40], F32)


def test_a_row_does_not_depend_on_its_batch_or_the_threads() -> None:
    x, w, b = _operands(130, 144, 1030, seed=1)
    packed, threads = pack_weight(w, F32), torch.get_num_threads()
    full = linear(x, packed, b)
    for i in (0, 7, 64, 129):
        assert torch.equal(linear(x[i:i + 1], packed, b), full[i:i + 1])
    assert torch.equal(linear(x[3:20], packed, b), full[3:20])
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(linear(x, packed, b), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("m,inter,k", [(1, 48, 64), (9, 96, 130), (130, 144, 1030)])
def test_gate_up_silu_same_bits_as_linear_then_silu_mul(m: int, inter: int, k: int) -> None:
    x, w, _ = _operands(m, 2 * inter, k, seed=2)
    fused = pack_gate_up(w, F32)
    assert is_gate_up_packed(fused) and fused.dtype == torch.bfloat16 and KERNEL.reads(fused)
    expected = fused_ops().silu_mul(linear(x, pack_weight(w, F32)))
    assert torch.equal(silu_mul_linear(x, fused), expected)
    assert torch.equal(expected, fused_ops().silu_mul(linear(x, pack_weight(w.float()))))


def test_avx2_build_gives_the_same_bits() -> None:
    """A CPU with AVX2 but no AVX-512 (a build with -mno-avx512f) runs the same fused multiply-adds in the
    same order on two 8-lane halves per panel: the same bits, for every tile height and rest, K blocks,
    bias, and the fused SiLU gate/up variant; its fp32 kernel too, on the upcast weight."""
    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("no AVX2 here")
    lib = load_library(("-mno-avx512f",))
    if lib is None:
        pytest.skip("the -mno-avx512f build failed")
    lib = bindings.bind(lib)
    assert lib.gemm_f32_wbf16_available() == 1 and lib.gemm_f32_available() == 1
    avx2, avx2_silu = PackedGemm(lib, F32, torch.bfloat16), PackedGemmSilu(lib, F32, torch.bfloat16)
    avx2_f32, avx2_f32_silu = PackedGemm(lib, F32), PackedGemmSilu(lib, F32)
    for m, n, k in [(1, 16, 2), (5, 48, 130), (9, 80, 1030), (17, 144, 2050), (130, 96, 64)]:
        x, w, b = _operands(m, n, k, seed=m)
        packed = pack_weight(w, F32)
        assert torch.equal(avx2(x, packed, b), linear(x, packed, b))
        assert torch.equal(avx2(x, packed), linear(x, packed))
        assert torch.equal(avx2_f32(x, pack_weight(w.float()), b), linear(x, packed, b))
    x, w, _ = _operands(9, 2 * 96, 130, seed=3)
    fused = pack_gate_up(w, F32)
    assert torch.equal(avx2_silu(x, fused), silu_mul_linear(x, fused))
    assert torch.equal(avx2_f32_silu(x, pack_gate_up(w.float())), silu_mul_linear(x, fused))


def test_rows_lookup_widens_to_fp32() -> None:
    w = torch.randn(96, 130).bfloat16()
    ids = torch.tensor([[0, 95], [17, 17]])
    rows = embedding(ids, pack_weight(w, F32), F32)
    assert rows.dtype == F32 and torch.equal(rows, F.embedding(ids, w.float()))
    assert torch.equal(embedding(ids, w, F32), rows)  # an unpacked table (untied embeddings)
    with pytest.raises(IndexError):
        embedding(torch.tensor([0, 96]), pack_weight(w, F32), F32)


def _bf16_folder(path: Path, arch: str, **overrides: object) -> torch.nn.Module:
    """A tiny random model saved in bf16 (an HF folder); returns HF's model on the upcast weights."""
    hf = tiny_hf_model(arch, **overrides).to(torch.bfloat16)
    hf.save_pretrained(path, safe_serialization=True)
    return hf.float()


def _weight_bytes(model: LlamaForCausalLM) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _greedy(runner: ModelRunner, prompt: list[int], num_tokens: int) -> list[int]:
    seq = BlockAllocator(runner.block_size).seq("a", prompt, 64)
    for i in range(num_tokens):
        step(runner, [(seq, None)])
    return seq.output


# llama: tied embeddings, gate/up packed with SiLU fused (I = 96); qwen2: qkv biases, untied, plain gate/up
@pytest.mark.parametrize("arch,overrides", [("llama", {"intermediate_size": 96}),
                                            ("qwen2", {"tie_word_embeddings": False})])
def test_bf16_folder_keeps_bf16_weights_and_hf_fp32_tokens(tmp_path: Path, arch: str, overrides: dict) -> None:
    """Loaded in fp32, every projection and embedding stays bf16 (packed but an untied embedding table),
    norms and biases fp32: ~half the weight bytes of the fp32 copies; HF fp32's greedy tokens on the same
    (upcast) weights, and the C loop gives the Python loop's bits and those of the fp32 copies."""
    hf = _bf16_folder(tmp_path, arch, **overrides)
    model, config = load_model(tmp_path, F32)
    copies, _ = load_model(tmp_path, F32, weight_only_bf16=False)
    runner, fp32_runner = (ModelRunner.from_model(m, config, 64, 4) for m in (model, copies))
    layer = model.layers[0]
    assert layer.qkv_proj.dtype == torch.bfloat16 and is_packed(layer.qkv_proj)
    assert is_gate_up_packed(layer.gate_up_proj) == (arch == "llama") and layer.gate_up_proj.dtype == torch.bfloat16
    assert model.embed_tokens.dtype == torch.bfloat16 and model.norm.dtype == F32 and runner.dtype == F32
    assert all(p.dtype == F32 for p in copies.parameters())
    assert _weight_bytes(model) < 0.55 * _weight_bytes(copies)
    assert runner.native_decoder is not None and fp32_runner.native_decoder is not None
    prompt = [5, 9, 33, 2, 71, 100, 4]
    assert _greedy(runner, prompt, 6) == hf_greedy(hf, prompt, 6)
    out = _mixed_step(runner)
    _mixed_step(fp32_runner)
    hidden, kv = _forward(runner, out, native=True)
    for other, native in ((runner, False), (fp32_runner, True), (fp32_runner, False)):
        ref_hidden, ref_kv = _forward(other, out, native)
        assert torch.equal(hidden, ref_hidden) and torch.equal(kv, ref_kv)


@pytest.fixture(scope="module")
def bf16_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model written as a BF16 GGUF (scripts/dense_gguf.py)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("gguf") / "smollm2-bf16.gguf"
    subprocess.run([sys.executable, "scripts/dense_gguf.py", str(out), "--dtype", "bf16"], check=True,
                   cwd=Path(__file__).parents[1], capture_output=True)
    return out


def test_bf16_gguf_keeps_bf16_weights_and_the_fp32_copies_bits(bf16_gguf: Path) -> None:
    """GGUF BF16 tensors stay bf16 under fp32 math; a mixed step (decode rows, a chunk, a fresh prompt)
    gives the bits of the same file converted to fp32 (the exact widening), through the C loop."""
    model, config = load_model(bf16_gguf, F32)
    copies, _ = load_model(bf16_gguf, F32, weight_only_bf16=False)
    assert model.layers[0].down_proj.dtype == torch.bfloat16 and model.embed_tokens.dtype == torch.bfloat16
    assert copies.layers[0].down_proj.dtype == F32
    runner, fp32_runner = (ModelRunner.from_model(m, config, 64, 4) for m in (model, copies))
    assert runner.native_decoder is not None
    out = _mixed_step(runner)
    _mixed_step(fp32_runner)
    hidden, kv = _forward(runner, out, native=True)
    ref_hidden, ref_kv = _forward(fp32_runner, out, native=True)
    assert torch.equal(hidden, ref_hidden) and torch.equal(kv, ref_kv)


def test_no_native_means_fp32_copies(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """COBATCH_NO_NATIVE=1: no kernel, so the loader converts bf16 weights to fp32 (the old behaviour)."""
    monkeypatch.setenv("COBATCH_NO_NATIVE", "1")
    monkeypatch.setattr(linear_module, "load_kernels", load_kernels.__wrapped__)  # uncached: reads the env
    monkeypatch.setattr(linear_module, "native_gemm", native_gemm.__wrapped__)
    assert linear_module.native_gemm(F32, torch.bfloat16) is None
    _bf16_folder(tmp_path, "llama")
    model, _ = load_model(tmp_path, F32)
    assert all(p.dtype == F32 for p in model.parameters())


def test_roofline_probes_the_kernel_the_model_runs(tmp_path: Path) -> None:
    """bench roofline's GEMM peak on a weight-only bf16 model times fp32 activations on its bf16 weights
    (it fed bf16 x to them before, which no kernel here reads)."""
    from cobatch.bench.roofline import measure_machine

    _bf16_folder(tmp_path, "llama", intermediate_size=96)
    model, config = load_model(tmp_path, F32)
    ModelRunner.from_model(model, config, 64, 4)  # packs
    assert measure_machine(model, reps=1, m=16, bandwidth_bytes=1 << 20).gemm_flops_per_s > 0
