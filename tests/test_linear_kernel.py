"""Packed-weight bf16 GEMM (csrc/gemm_bf16.c via cobatch.kernels.linear) against F.linear and fp32, and what
it shares with the fp32 one (tests/test_linear_f32.py has the rest of that): shapes, batch invariance,
rows lookup, operand checks, in both dtypes."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F

from cobatch.kernels import linear as linear_module
from cobatch.kernels.fused_ops import fused_ops
from cobatch.kernels.linear import (PackedGemm, can_pack, can_pack_gate_up, embedding, is_gate_up_packed, is_packed,
                                   linear, native_gemm, pack_gate_up, pack_weight, packed_shape, silu_mul_linear,
                                   unpack_weight, use_amx)
from cobatch.kernels.cpu import cpu_flags

KERNEL = native_gemm()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no AVX512-BF16 or no compiler here")
# the dense dtypes, each where its packed GEMM is built (fp32: AVX-512F)
DENSE = [pytest.param(torch.bfloat16, marks=needs_kernel),
         pytest.param(torch.float32, marks=pytest.mark.skipif(native_gemm(torch.float32) is None,
                                                              reason="no AVX-512F or no compiler here"))]
AMX = use_amx(True)  # the bf16 kernel's tiles on AMX's tile unit (where the CPU has it)
BF16_EPS = 2.0 ** -7  # bf16 spacing relative to a value's magnitude (at most)
FP32_EPS = 2.0 ** -24


@pytest.fixture
def no_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls after this point must take the kernel: F.linear inside the module raises."""
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("fell back to F.linear")
    monkeypatch.setattr(linear_module, "F", type("NoF", (), {"linear": staticmethod(boom)}))


@pytest.fixture(params=["avx512", pytest.param("amx", marks=pytest.mark.skipif(not AMX, reason="no AMX-BF16"))])
def bf16_tile(request: pytest.FixtureRequest) -> Iterator[str]:
    """The bf16 kernel's tile for the test: AVX512-BF16's, then AMX's where the CPU has it."""
    use_amx(request.param == "amx")
    yield request.param
    use_amx(True)


@pytest.fixture
def no_kernel_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls after this point must not reach the kernel."""
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("called the kernel")
    monkeypatch.setattr(PackedGemm, "__call__", boom)


def _operands(m: int, n: int, k: int, bias: bool, seed: int,
              dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """Against the fp32 reference: bf16 rounding of the exact value plus fp32 summation error (which grows
    with K and the magnitude of the products, |x| @ |w|^T); against F.linear in bf16: each side's rounding
    and summation error, i.e. about one bf16 ulp."""
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    magnitude = F.linear(x.float().abs(), w.float().abs(), None if b is None else b.float().abs())
    summation = x.shape[-1] * FP32_EPS * magnitude
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert ((out.float() - ref).abs() <= BF16_EPS / 2 * ref.abs() + 2 * summation).all()
    torch_out = F.linear(x, w, b).float()
    assert ((out.float() - torch_out).abs() <= BF16_EPS * ref.abs() + 4 * summation).all()
    assert (out.float() == torch_out).float().mean() > 0.99  # both round the fp32 sum once: nearly all equal


def _packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return linear(x, pack_weight(w), b)


@pytest.mark.parametrize("n,columns", [(48, 48), (96, 48), (32, 16), (64, 16), (80, 16)])
def test_pack_layout_and_round_trip(n: int, columns: int) -> None:
    """Blocks of 3 panels (48 columns) side by side where N's panels divide by 3, else single panels."""
    w = torch.arange(n * 10, dtype=torch.float32).view(n, 10).bfloat16()
    packed = pack_weight(w)
    assert packed.shape == (n // columns, 5, columns, 2) and is_packed(packed) and not is_packed(w)
    for b, kk, c, t in [(0, 0, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1), (n // columns - 1, 4, columns - 1, 1),
                        (0, 3, columns // 2, 0)]:
        assert packed[b, kk, c, t] == w[columns * b + c, 2 * kk + t]
    assert torch.equal(unpack_weight(packed), w) and packed_shape(packed) == (n, 10)


@pytest.mark.parametrize("shape,dtype,ok", [((32, 64), torch.bfloat16, True), ((40, 64), torch.bfloat16, False),
                                            ((32, 63), torch.bfloat16, False), ((32, 64), torch.float16, False)])
def test_can_pack(shape: tuple[int, int], dtype: torch.dtype, ok: bool) -> None:
    """bf16 here; fp32 weights: tests/test_linear_f32.py."""
    assert can_pack(torch.zeros(shape, dtype=dtype)) == (ok and KERNEL is not None)


# panels 1..9 (tile widths 3 + tails of 1 and 2; blocks of 3 panels where the count divides by 3), K from
# one pair to the model's sizes
SHAPES = [(960, 576), (576, 1536), (16, 2), (32, 70), (48, 34), (64, 96), (80, 576), (96, 64), (112, 64),
          (144, 40)]


@needs_kernel
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(n: int, k: int, bias: bool, bf16_tile: str, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue("no_fallback")
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 33, 70, 257):  # every tile height, row chunks of 256
        x, w, b = _operands(m, n, k, bias, seed=m * 1000 + n + k)
        _check(_packed_linear(x, w, b), x, w, b)


@pytest.mark.parametrize("dtype", DENSE)
def test_leading_dims_and_nonfinite(dtype: torch.dtype, request: pytest.FixtureRequest) -> None:
    x, w, b = _operands(6, 48, 64, True, seed=1, dtype=dtype)
    request.getfixturevalue("no_fallback")
    out = _packed_linear(x.view(2, 3, 64), w, b)
    assert out.shape == (2, 3, 48) and torch.equal(out.view(6, 48), _packed_linear(x, w, b))
    assert torch.equal(_packed_linear(x.t().contiguous().t(), w, b), out.view(6, 48))  # strided x is copied
    x[0, 5], x[1, 7] = float("nan"), float("inf")
    out = _packed_linear(x, w, b)
    assert out[0].isnan().all() and out[1].isinf().all() and out[2:].isfinite().all()
    assert _packed_linear(x[:0], w, b).shape == (0, 48)


@needs_kernel
def test_rounds_like_torch(bf16_tile: str, request: pytest.FixtureRequest) -> None:
    """Sums exact in fp32, so the only rounding is fp32 -> bf16: ties to even, overflow to inf, NaN."""
    a, b = 2.0 ** -7, 2.0 ** -8  # bf16 steps just above 1, and half of it
    pairs = [(1.0, b), (1.0 + a, b), (1.0, b + 2.0 ** -16), (-1.0 - a, -b), (3e38, 3e38), (-3e38, -3e38),
             (float("inf"), float("-inf")), (1e-40, 0.0), (2.0 ** -133, 2.0 ** -134)]  # last two: denormals out
    w = torch.zeros(16, 2)
    w[:len(pairs)] = torch.tensor(pairs)
    w = w.bfloat16()  # [N, 2]: each row's two terms (zero rows pad N to a panel)
    x = torch.ones(1, 2, dtype=torch.bfloat16)
    exact = (w.float() * x.float()).sum(dim=1)
    request.getfixturevalue("no_fallback")
    out = _packed_linear(x, w)[0, :len(pairs)]
    assert torch.equal(out[:-2].float().nan_to_num(7.0), exact[:len(pairs) - 2].bfloat16().float().nan_to_num(7.0))
    assert (out[-2:] == 0).all()  # vdpbf16ps and tdpbf16ps flush denormals to zero (documented in the C file)


@needs_kernel
def test_amx_is_used_where_the_cpu_has_it() -> None:
    """A CPU that lists AMX-BF16 runs the bf16 kernel on it (Linux grants the tile state on request)."""
    assert AMX == ("amx_bf16" in cpu_flags())


@pytest.mark.parametrize("dtype", DENSE)
@pytest.mark.parametrize("n", [304, 288])  # single panels; blocks of 3 (prefetch from 16 rows, L2 then L1)
def test_rows_do_not_depend_on_the_batch(n: int, dtype: torch.dtype, bf16_tile: str) -> None:
    """Each output is one dot product in a fixed order, whatever M, the tiling or the thread count: a
    row's bits do not change with the batch it runs in (the engine's determinism relies on that)."""
    x, w, b = _operands(600, n, 200, True, seed=2, dtype=dtype)
    packed = pack_weight(w)
    full = linear(x, packed, b)
    for m in (1, 3, 9, 16, 17, 24, 256, 300):
        assert torch.equal(linear(x[:m], packed, b), full[:m])
    assert torch.equal(linear(x[40:41], packed, b), full[40:41])
    assert torch.equal(linear(x[299:599], packed, b), full[299:599])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.equal(linear(x, packed, b), full)
            assert torch.equal(linear(x[:5], packed, b), full[:5])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DENSE)
@pytest.mark.parametrize("vocab", [64, 96])  # single panels, blocks of 3
def test_embedding_reads_packed_rows(vocab: int, dtype: torch.dtype) -> None:
    _, w, _ = _operands(1, vocab, 24, False, seed=5, dtype=dtype)
    ids = torch.tensor([[0, 17, 63], [5, 5, vocab - 1]])
    assert torch.equal(embedding(ids, pack_weight(w)), F.embedding(ids, w))
    assert torch.equal(embedding(ids, w), F.embedding(ids, w))
    for bad in (vocab, -1):  # an id outside the table is an error, not a read out of bounds
        with pytest.raises(IndexError):
            embedding(torch.tensor([0, bad]), pack_weight(w))


@pytest.mark.parametrize("dtype", DENSE)
@pytest.mark.parametrize("case", ["other_dtype_input", "wrong_k", "other_dtype_bias"])
def test_packed_rejects_bad_operands(case: str, dtype: torch.dtype) -> None:
    x, w, b = _operands(4, 48, 64, True, seed=3, dtype=dtype)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    if case == "other_dtype_input":
        x = x.to(other)
    elif case == "wrong_k":
        x = x[:, :62]
    else:
        b = b.to(other)
    with pytest.raises(ValueError):
        _packed_linear(x, w, b)


def test_gate_up_layout_and_round_trip() -> None:
    """Gate block j (48 columns) then up block j, each laid out as pack_weight lays out 48 columns."""
    inter, k = 96, 10
    w = torch.arange(2 * inter * k, dtype=torch.float32).view(2 * inter, k).bfloat16()
    packed = pack_gate_up(w)
    assert packed.shape == (4, 1, 5, 48, 2) and is_gate_up_packed(packed) and not is_packed(packed)
    for j, half in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        assert torch.equal(packed[2 * j + half], pack_weight(w[half * inter + 48 * j:half * inter + 48 * (j + 1)]))
    assert torch.equal(unpack_weight(packed), w) and packed_shape(packed) == (2 * inter, k)


@pytest.mark.parametrize("shape,dtype,ok", [((192, 64), torch.bfloat16, True), ((96, 64), torch.bfloat16, True),
                                            ((128, 64), torch.bfloat16, False), ((192, 63), torch.bfloat16, False),
                                            ((192, 64), torch.float16, False)])
def test_can_pack_gate_up(shape: tuple[int, int], dtype: torch.dtype, ok: bool) -> None:
    """Whole 48-column blocks of gate and of up (2 x 64 columns are not), and the packed kernel's dtype."""
    assert can_pack_gate_up(torch.zeros(shape, dtype=dtype)) == (ok and KERNEL is not None)


@needs_kernel
@pytest.mark.parametrize("inter,k", [(48, 64), (96, 34), (144, 576), (1536, 576)])
def test_gate_up_silu_same_bits_as_linear_then_silu_mul(inter: int, k: int, bf16_tile: str) -> None:
    """The fused kernel rounds each gate/up product as the GEMM does and applies silu_mul's own code, so
    its bits are those of the two-step path for every tile height, the prefetch thresholds (16, 24 rows),
    row chunks of 256, and thread counts; a NaN input row stays NaN."""
    ops = fused_ops()
    for m in (1, 5, 8, 9, 17, 24, 300):
        x, w, _ = _operands(m, 2 * inter, k, False, seed=7 * m + inter + k)
        if m == 9:
            x[4, 1] = float("nan")
        expected = ops.silu_mul(linear(x, pack_weight(w)))
        got = silu_mul_linear(x, pack_gate_up(w))
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16))  # NaNs included
        if m == 9:
            assert got[4].isnan().all() and got[:4].isfinite().all()
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert torch.equal(silu_mul_linear(x, pack_gate_up(w)), expected)
    finally:
        torch.set_num_threads(threads)
    assert silu_mul_linear(x.view(5, 60, k), pack_gate_up(w)).shape == (5, 60, inter)
    with pytest.raises(ValueError):
        silu_mul_linear(x.float(), pack_gate_up(w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unpacked_weight_is_f_linear(dtype: torch.dtype, request: pytest.FixtureRequest) -> None:
    x, w, b = (t.to(dtype) for t in _operands(4, 40, 64, True, seed=3))
    request.getfixturevalue("no_kernel_call")
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))


def test_no_kernel_means_no_packing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COBATCH_NO_NATIVE", "1")
    # the loader unmemoized: this process has loaded the library already
    monkeypatch.setattr(linear_module, "load_kernels", linear_module.load_kernels.__wrapped__)
    assert native_gemm.__wrapped__() is None  # what the loader returns with native code off
    monkeypatch.setattr(linear_module, "native_gemm", lambda dtype=torch.bfloat16, weight_dtype=None: None)
    assert not can_pack(torch.zeros(32, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", DENSE)
@pytest.mark.parametrize("vocab_size", [256, 250])
def test_model_packs_in_place_and_keeps_its_outputs(vocab_size: int, dtype: torch.dtype) -> None:
    """pack_linear_weights packs every projection and the tied lm_head + embeddings (one Parameter), and
    the model computes the same function (within rounding of a different summation order). A vocab
    that is not a whole number of panels keeps its table unpacked (F.linear, F.embedding)."""
    from cobatch.models.llama import LlamaForCausalLM
    from cobatch.models.model_config import ModelConfig

    config = ModelConfig.from_hf_config({"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                                        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": vocab_size,
                                        "tie_word_embeddings": True, "max_position_embeddings": 64,
                                        "model_type": "llama"})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, dtype)
    for p in model.parameters():
        p.data.normal_(std=0.2)
    hidden = torch.randn(5, 64).to(dtype)
    before = model.compute_logits(hidden)
    ids = torch.tensor([3, 200])
    embeds = F.embedding(ids, model.embed_tokens)
    packs_table = vocab_size % 16 == 0
    assert model.pack_linear_weights() == 2 * 4 + packs_table
    assert model.lm_head is model.embed_tokens and is_packed(model.lm_head) == packs_table
    assert all(is_packed(layer.down_proj) and is_gate_up_packed(layer.gate_up_proj) for layer in model.layers)
    assert torch.equal(embedding(ids, model.embed_tokens), embeds)
    after = model.compute_logits(hidden)
    rtol, atol = (2 * BF16_EPS, 0.02) if dtype == torch.bfloat16 else (1e-5, 1e-5)
    assert torch.allclose(after, before, rtol=rtol, atol=atol)
    assert model.pack_linear_weights() == 0  # already packed: nothing to do


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize("suffix,march", [("bf16", "x86-64-v3"), ("f32", "x86-64-v2"), ("f32_wbf16", "x86-64-v2")])
def test_stub_without_its_instructions(tmp_path: Path, suffix: str, march: str) -> None:
    """Built for a CPU without what a GEMM needs (bf16: x86-64-v3, no AVX512-BF16; fp32 and weight-only
    bf16: x86-64-v2, no AVX2) each says so (and native_gemm(dtype) is then None); its entry points return -1."""
    source = Path(linear_module.__file__).parent / "csrc" / f"gemm_{suffix}.c"
    target = tmp_path / "gemm_stub.so"
    subprocess.run(["cc", "-O1", f"-march={march}", "-fopenmp", "-shared", "-fPIC", "-std=c11", str(source),
                    "-o", str(target)], check=True, capture_output=True, timeout=60)
    lib = ctypes.CDLL(str(target))
    assert getattr(lib, f"gemm_{suffix}_available")() == 0
    args = (None, None, None, None, ctypes.c_int64(1), ctypes.c_int64(16), ctypes.c_int64(2), 1)
    assert getattr(lib, f"gemm_{suffix}")(*args) == -1
