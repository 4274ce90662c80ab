"""Native fused ops (norm, SiLU-multiply, RoPE, head norm) against their eager-torch definitions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cobatch.kernels import fused_ops as fused_ops_module
from cobatch.kernels.fused_ops import EAGER, fused_ops
from cobatch.models.llama import rope_tables

NATIVE = fused_ops()
pytestmark = pytest.mark.skipif(not NATIVE.native, reason="native fused ops not built here")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def no_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls made after this point must take the native path: the eager helpers raise."""
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("fell back to the eager path")
    for name in ("rms_norm", "silu_mul_torch", "rope_torch"):
        monkeypatch.setattr(fused_ops_module, name, boom)


def _check(native: torch.Tensor, eager: torch.Tensor) -> None:
    if native.dtype == torch.bfloat16:  # same rounding steps: equal but for rare 1-ulp exp/rsqrt ties
        diff = (native.float() - eager.float()).abs()
        ulp = eager.float().abs().clamp_min(1e-30) * 2 ** -7
        assert (diff <= ulp).all() and (diff > 0).float().mean() < 0.01
    else:
        torch.testing.assert_close(native, eager, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("with_x", [True, False])
@pytest.mark.parametrize("hidden", [96, 100])  # 100: the vector rows' masked tail
def test_add_rms_norm(dtype: torch.dtype, rows: int, with_x: bool, hidden: int,
                      request: pytest.FixtureRequest) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=g).to(dtype) if with_x else None
    residual = (3 * torch.randn(rows, hidden, generator=g)).to(dtype)
    weight = torch.randn(hidden, generator=g).to(dtype)
    res_native, res_eager = residual.clone(), residual.clone()
    out_eager = EAGER.add_rms_norm(x, res_eager, weight, 1e-5)
    request.getfixturevalue("no_fallback")
    out_native = NATIVE.add_rms_norm(x, res_native, weight, 1e-5)
    assert torch.equal(res_native, res_eager)  # the residual add rounds identically
    _check(out_native, out_eager)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 200])
@pytest.mark.parametrize("inter", [160, 150])  # 150: the vector rows' masked tail
def test_silu_mul(dtype: torch.dtype, rows: int, inter: int, request: pytest.FixtureRequest) -> None:
    gate_up = (4 * torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows))).to(dtype)
    eager = EAGER.silu_mul(gate_up)
    request.getfixturevalue("no_fallback")
    _check(NATIVE.silu_mul(gate_up), eager)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 32, 48])  # 48: not a whole vector per half (scalar rows)
def test_rope_in_place_on_q_and_k_only(dtype: torch.dtype, head_dim: int, request: pytest.FixtureRequest) -> None:
    config = SimpleNamespace(head_dim=head_dim, rope_theta=10000.0, rope_scaling=None)
    cos, sin = rope_tables(config, 64, dtype, "cpu")  # type: ignore[arg-type]
    rows, width = 9, (4 + 2 * 2) * head_dim  # q | k | v
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(head_dim)).to(dtype)
    positions = torch.tensor([0, 1, 2, 63, 5, 5, 17, 30, 8])
    native, eager = x.clone(), x.clone()
    EAGER.rope(eager, cos, sin, positions, 6, head_dim)
    request.getfixturevalue("no_fallback")
    NATIVE.rope(native, cos, sin, positions, 6, head_dim)
    _check(native, eager)
    assert torch.equal(native[:, 6 * head_dim:], x[:, 6 * head_dim:])  # v untouched
    assert torch.equal(native[0], x[0]) and not torch.equal(native[1, :head_dim], x[1, :head_dim])  # pos 0: identity


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [128, 64, 40])
def test_head_rms_norm_on_the_named_heads_only(dtype: torch.dtype, head_dim: int,
                                              request: pytest.FixtureRequest) -> None:
    """Qwen3's k_norm: heads 4 and 5 of a q | k | v row (4 + 2 + 2 heads), each normed on its own."""
    g = torch.Generator().manual_seed(head_dim)
    x = (3 * torch.randn(7, 8 * head_dim, generator=g)).to(dtype)
    weight = torch.randn(head_dim, generator=g).to(dtype)
    native, eager = x.clone(), x.clone()
    EAGER.head_rms_norm(eager, 4, 2, head_dim, weight, 1e-6)
    request.getfixturevalue("no_fallback")
    NATIVE.head_rms_norm(native, 4, 2, head_dim, weight, 1e-6)
    _check(native, eager)
    k = x[:, 4 * head_dim:6 * head_dim].reshape(-1, head_dim).float()
    want = weight.float() * k / (k.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()  # per head, not per row
    torch.testing.assert_close(native[:, 4 * head_dim:6 * head_dim].float(), want.view(7, -1),
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    assert torch.equal(native[:, :4 * head_dim], x[:, :4 * head_dim])  # q and v untouched
    assert torch.equal(native[:, 6 * head_dim:], x[:, 6 * head_dim:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_matches_torch_max(dtype: torch.dtype, request: pytest.FixtureRequest) -> None:
    """First index of the max, ties and tails included; a NaN makes the row's max NaN; all -inf: -inf."""
    logits = torch.randn(7, 1000 + 13, generator=torch.Generator().manual_seed(9)).to(dtype)
    logits[0, 500] = logits[0, 20] = logits[0, 900] = 50.0  # ties in different lanes: the first wins
    logits[1, 17] = logits[1, 33] = 50.0  # ties in the same lane
    logits[2, -1] = 50.0  # in the tail
    logits[3, 4] = float("nan")
    logits[4] = float("-inf")
    logits[5, 0] = float("inf")
    logits[6, 40] = logits[6, 64] = 50.0  # a tie across the kernel's vector sets: the later one in set 0
    best, index = NATIVE.argmax(logits)
    want_best, want_index = logits.max(dim=-1)
    assert best.dtype == torch.float32 and index.dtype == torch.int64
    assert torch.equal(best[[0, 1, 2, 5, 6]], want_best[[0, 1, 2, 5, 6]].float())
    assert torch.equal(index[[0, 1, 2, 5, 6]], want_index[[0, 1, 2, 5, 6]])
    assert index[:3].tolist() == [20, 17, 1012] and index[6] == 40
    assert best[3].isnan() and best[4] == float("-inf")
    eager_best, eager_index = EAGER.argmax(logits)
    assert torch.equal(eager_index[[0, 1, 2, 5, 6]], index[[0, 1, 2, 5, 6]])
