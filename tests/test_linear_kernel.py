"""Native small-M bf16 linear (csrc/linear_bf16.c via cobatch.models.linear) against F.linear and fp32."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cobatch.models import linear as linear_module
from cobatch.models.linear import MAX_ROWS, NativeLinear, linear, native_linear

KERNEL = native_linear()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no AVX512-BF16 or no compiler here")
BF16_EPS = 2.0 ** -7  # bf16 spacing relative to a value's magnitude (at most)
FP32_EPS = 2.0 ** -24


@pytest.fixture
def no_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls after this point must take the kernel: F.linear inside the module raises."""
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("fell back to F.linear")
    monkeypatch.setattr(linear_module, "F", type("NoF", (), {"linear": staticmethod(boom)}))


@pytest.fixture
def no_kernel_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls after this point must not reach the kernel."""
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("called the kernel")
    monkeypatch.setattr(NativeLinear, "__call__", boom)


def _operands(m: int, n: int, k: int, bias: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
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


SHAPES = [(960, 576), (576, 1536), (37, 70), (5, 31), (100, 32), (19, 97), (16, 1)]


@needs_kernel
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(n: int, k: int, bias: bool, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue("no_fallback")
    for m in (1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 18, 19, 33, 64, 70):  # both tilings and all their tails
        x, w, b = _operands(m, n, k, bias, seed=m * 1000 + n + k)
        _check(linear(x, w, b), x, w, b)


@needs_kernel
def test_leading_dims_and_nonfinite(request: pytest.FixtureRequest) -> None:
    x, w, b = _operands(6, 40, 64, True, seed=1)
    request.getfixturevalue("no_fallback")
    out = linear(x.view(2, 3, 64), w, b)
    assert out.shape == (2, 3, 40) and torch.equal(out.view(6, 40), linear(x, w, b))
    x[0, 5], x[1, 7] = float("nan"), float("inf")
    out = linear(x, w, b)
    assert out[0].isnan().all() and out[1].isinf().all() and out[2:].isfinite().all()


@needs_kernel
def test_rounds_like_torch(request: pytest.FixtureRequest) -> None:
    """Sums exact in fp32, so the only rounding is fp32 -> bf16: ties to even, overflow to inf, NaN."""
    a, b = 2.0 ** -7, 2.0 ** -8  # bf16 steps just above 1, and half of it
    pairs = [(1.0, b), (1.0 + a, b), (1.0, b + 2.0 ** -16), (-1.0 - a, -b), (3e38, 3e38), (-3e38, -3e38),
             (float("inf"), float("-inf")), (1e-40, 0.0), (2.0 ** -133, 2.0 ** -134)]  # last two: denormals out
    w = torch.tensor(pairs).bfloat16()  # [N, 2]: each row's two terms
    x = torch.ones(1, 2, dtype=torch.bfloat16)
    exact = (w.float() * x.float()).sum(dim=1)
    request.getfixturevalue("no_fallback")
    out = linear(x, w)[0]
    assert torch.equal(out[:-2].float().nan_to_num(7.0), exact[:-2].bfloat16().float().nan_to_num(7.0))
    assert (out[-2:] == 0).all()  # vdpbf16ps flushes denormals to zero (documented in the C file)


@needs_kernel
def test_rows_do_not_depend_on_the_batch() -> None:
    """Each output is one dot product in a fixed order, whatever M, the tiling or the thread count: a
    row's bits do not change with the batch it runs in (the engine's determinism relies on that)."""
    x, w, b = _operands(70, 300, 200, True, seed=2)
    full = linear(x, w, b)
    for m in (1, 3, 16, 17):
        assert torch.equal(linear(x[:m], w, b), full[:m])
    assert torch.equal(linear(x[40:41], w, b), full[40:41])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(linear(x, w, b), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("case", ["strided_x", "transposed_w", "fp32", "too_many_rows", "grad", "fp32_bias"])
def test_unsupported_operands_fall_back(case: str, request: pytest.FixtureRequest) -> None:
    x, w, b = _operands(4, 48, 64, True, seed=3)
    if case == "strided_x":
        x = torch.randn(4, 128).bfloat16()[:, ::2]
    elif case == "transposed_w":
        w = w.t().contiguous().t()
    elif case == "fp32":
        x, w, b = x.float(), w.float(), b.float()
    elif case == "too_many_rows":
        x = torch.randn(MAX_ROWS + 1, 64).bfloat16()
    elif case == "grad":
        w.requires_grad_(True)
    elif case == "fp32_bias":
        b = b.float()
    request.getfixturevalue("no_kernel_call")
    if case == "fp32_bias":  # F.linear itself rejects mixed dtypes: same error, not a wrong result
        with pytest.raises(RuntimeError):
            linear(x, w, b)
        return
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))


def test_no_kernel_means_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COBATCH_NO_NATIVE", "1")
    assert native_linear.__wrapped__() is None  # what the loader returns with native code off
    monkeypatch.setattr(linear_module, "native_linear", lambda: None)
    x, w, b = _operands(3, 20, 40, True, seed=4)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_stub_without_avx512_bf16(tmp_path: Path) -> None:
    """Built for a CPU without AVX512-BF16 the library says so (and native_linear() is then None)."""
    source = Path(linear_module.__file__).parent / "csrc" / "linear_bf16.c"
    target = tmp_path / "linear_stub.so"
    subprocess.run(["cc", "-O1", "-march=x86-64-v3", "-fopenmp", "-shared", "-fPIC", "-std=c11", str(source),
                    "-o", str(target)], check=True, capture_output=True, timeout=60)
    lib = ctypes.CDLL(str(target))
    assert lib.linear_bf16_available() == 0
