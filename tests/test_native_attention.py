"""The native paged-attention kernel against a plain torch reference and against the torch path.

Random ragged batches: decode rows, fresh prefills and prefills over cached context (chunked prefill /
prefix hit) in one step; GQA groups 1/3/4; head sizes on and off the AVX512-BF16 path; block sizes
1/4/16/32; lengths off the block and tile sizes. Cache slots outside every query's context hold NaN,
so a kernel that used them would fail. The cases hold the cache as it looks ([blocks, block_size, kv
heads, head_dim]) for the reference, and hand the kernel the same data written through its write_kv,
in the layout it reads.
"""

from __future__ import annotations

import pytest
import torch

from cobatch.models.attention import AttentionMetadata, make_tiles, paged_attention
from cobatch.kernels import bindings
from cobatch.kernels.attention import AttentionKernel, load_attention_kernel
from cobatch.kernels.build import load_library
from cobatch.runner.model_runner import _prepare_any, prepare_batch
from cobatch.sampling_params import SamplingParams
from cobatch.scheduler_output import ScheduledRow
from tests.runner_helpers import BlockAllocator, hf_greedy, runner_for, step, tiny_hf_model

KERNEL = load_attention_kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the torch path runs instead")

# (num_computed, num_new) per row: decode rows first, then a fresh prefill, a chunk over cached
# context, a prefix-cache hit resuming mid-block, a one-token prompt.
MIXED_ROWS = [(0, 1), (4, 1), (16, 1), (39, 1), (0, 37), (21, 19), (32, 17), (5, 3)]
HEADS = [(4, 4, 64), (9, 3, 64), (8, 2, 32), (4, 1, 80), (8, 2, 128), (4, 2, 40)]  # (nh, kvh, hd)


def kernel_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Caches as they look, [blocks, bs, kvh, hd], rewritten slot by slot in the kernel's layout."""
    assert KERNEL is not None
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_out, v_out = torch.empty_like(k_cache), torch.empty_like(v_cache)
    KERNEL.write_kv(k_out, v_out, k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim),
                    torch.arange(num_blocks * block_size))
    return k_out, v_out


def documented_layout(cache: torch.Tensor, is_k: bool) -> torch.Tensor:
    """The AVX-512 path's layout as csrc/paged_attention.c's header draws it, built with torch permutes:
    blocks head-major, quads of 4 keys (r); K columns c = 16 cb + 4L + j of e elements (p) stored as
    [cb][j][L][r][p]; bf16 V as [r / 2][d][r % 2]; fp32 V rows as they are."""
    num_blocks, block_size, kvh, hd = cache.shape
    e = 2 if cache.dtype == torch.bfloat16 else 1
    if is_k:  # natural dims: block, u, r, h, cb, L, j, p
        x = cache.view(num_blocks, block_size // 4, 4, kvh, hd // (16 * e), 4, 4, e).permute(0, 3, 1, 4, 6, 5, 2, 7)
    elif e == 2:  # block, u, pair, q, h, d
        x = cache.view(num_blocks, block_size // 4, 2, 2, kvh, hd).permute(0, 4, 1, 2, 5, 3)
    else:
        x = cache.permute(0, 2, 1, 3)
    return x.contiguous().view(cache.shape)


class Case:
    """A random cache with rows' contexts in shuffled blocks; every other slot is NaN."""

    def __init__(self, dtype: torch.dtype, heads: tuple[int, int, int], block_size: int,
                 rows: list[tuple[int, int]], seed: int = 0) -> None:
        num_heads, num_kv_heads, head_dim = heads
        gen = torch.Generator().manual_seed(seed)
        self.rows, self.block_size, self.scale = rows, block_size, head_dim ** -0.5
        lens = [c + n for c, n in rows]
        needed = [-(-n // block_size) for n in lens]
        num_blocks = sum(needed) + 1  # block 0: padding of the tables, never visible
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"))
        self.v_cache = torch.full(shape, float("nan"))
        perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        self.tables = torch.zeros(len(rows), max(needed), dtype=torch.int64)
        for r, (n, nb) in enumerate(zip(lens, needed)):
            self.tables[r, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
            pos = torch.arange(n)
            slot_block, slot_off = self.tables[r, pos // block_size], pos % block_size
            self.k_cache[slot_block, slot_off] = torch.randn(n, num_kv_heads, head_dim, generator=gen)
            self.v_cache[slot_block, slot_off] = torch.randn(n, num_kv_heads, head_dim, generator=gen)
        self.k_cache, self.v_cache = self.k_cache.to(dtype), self.v_cache.to(dtype)
        num_tokens = sum(n for _, n in rows)
        self.q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
        self.num_computed = torch.tensor([c for c, _ in rows])
        self.num_new = torch.tensor([n for _, n in rows])

    def tiles(self, tile_tokens: int = 16) -> torch.Tensor:
        return make_tiles(self.num_computed, self.num_new, tile_tokens)

    def kernel(self, tile_tokens: int = 16, q: torch.Tensor | None = None) -> torch.Tensor:
        assert KERNEL is not None
        q = self.q if q is None else q
        k_cache, v_cache = kernel_caches(self.k_cache, self.v_cache)
        return KERNEL(q, k_cache, v_cache, self.tables, self.tiles(tile_tokens), self.scale)

    def reference(self) -> torch.Tensor:
        """Per query token in fp64: softmax(q K^T * scale) V over positions 0 .. its own position."""
        num_heads, num_kv_heads = self.q.shape[1], self.k_cache.shape[2]
        k_all = self.k_cache.double().flatten(0, 1)  # [slots, kvh, hd]
        v_all = self.v_cache.double().flatten(0, 1)
        out = torch.empty(self.q.shape, dtype=torch.float64)
        token = 0
        for r, (computed, new) in enumerate(self.rows):
            for i in range(new):
                pos = torch.arange(computed + i + 1)
                slots = self.tables[r, pos // self.block_size] * self.block_size + pos % self.block_size
                k = k_all[slots].repeat_interleave(num_heads // num_kv_heads, dim=1)  # [ctx, nh, hd]
                v = v_all[slots].repeat_interleave(num_heads // num_kv_heads, dim=1)
                probs = (torch.einsum("hd,chd->hc", self.q[token].double(), k) * self.scale).softmax(-1)
                out[token] = torch.einsum("hc,chd->hd", probs, v)
                token += 1
        return out


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_kernel_matches_reference(dtype: torch.dtype, heads: tuple[int, int, int], block_size: int) -> None:
    case = Case(dtype, heads, block_size, MIXED_ROWS)
    got = case.kernel()
    assert got.dtype == dtype and got.shape == case.q.shape
    atol, want = TOLERANCE[dtype], case.reference()
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=atol)
    if dtype == torch.bfloat16:  # on average close to the output's own bf16 rounding (~4e-4 here)
        assert float((got.double() - want).abs().mean()) < 1e-3


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ramp", ["up", "scattered"])
def test_kernel_matches_reference_over_a_wide_score_range(dtype: torch.dtype, ramp: str) -> None:
    """Scores spanning hundreds of e-folds, whose max keeps growing along the context ("up": keys scaled
    by their slot, so later blocks win) or jumps at random blocks: the kernel's lazy rescaling must raise
    its reference max (and rescale what it has accumulated) whenever a score passes it by more than
    2^8 in weight; random unit-scale data never gets there after the first chunk."""
    case = Case(torch.float32, (9, 3, 64), 16, MIXED_ROWS + [(150, 1), (0, 90)])
    num_blocks = case.k_cache.shape[0]
    gen = torch.Generator().manual_seed(7)
    factor = (torch.arange(num_blocks) / 2 + 1 if ramp == "up"
              else torch.rand(num_blocks, generator=gen) * 60 + 1)
    case.k_cache = (case.k_cache * factor.view(-1, 1, 1, 1)).to(dtype)
    case.v_cache, case.q = case.v_cache.to(dtype), case.q.to(dtype)
    want = case.reference()
    assert float(want.isnan().sum()) == 0
    tol = TOLERANCE[dtype] + score_rounding(case)  # far below what a missed rescale costs (O(1))
    torch.testing.assert_close(case.kernel().double(), want, atol=tol, rtol=tol)


def score_rounding(case: Case) -> float:
    """A bound on fp32's rounding of the largest score (|q| |k| scale eps): an error e in a score is a
    relative error e in its weight, so scores of a few hundred cost a few 1e-5 in any summation order."""
    k_norm = case.k_cache.float().nan_to_num().norm(dim=-1).max()
    q_norm = case.q.float().norm(dim=-1).max()
    return float(torch.finfo(torch.float32).eps * q_norm * k_norm * case.scale)


@needs_kernel
@pytest.mark.parametrize("seed", range(4))
def test_kernel_random_ragged_batches(seed: int) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    rows = [(int(torch.randint(0, 90, (1,), generator=gen)), int(n))
            for n in torch.randint(1, 40, (6,), generator=gen)]
    for dtype in (torch.float32, torch.bfloat16):
        case = Case(dtype, (9, 3, 64), 4, rows, seed=seed)
        atol = TOLERANCE[dtype]
        torch.testing.assert_close(case.kernel(tile_tokens=7).double(), case.reference(), atol=atol, rtol=atol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 80), (8, 2, 128), (4, 2, 40)])
def test_row_bits_do_not_depend_on_tiling_or_batch(dtype: torch.dtype, heads: tuple[int, int, int]) -> None:
    """A query's numbers depend on its own context only: not on tile size, nor on the other rows (alone,
    a decode row is split over KV heads instead of being one work item)."""
    case = Case(dtype, heads, 16, MIXED_ROWS)
    batched = case.kernel(tile_tokens=16)
    for tile_tokens in (1, 5, 64):
        assert torch.equal(case.kernel(tile_tokens=tile_tokens), batched)
    first = 0
    for r, (_, new) in enumerate(MIXED_ROWS):
        alone = Case(dtype, heads, 16, MIXED_ROWS)
        alone.rows, alone.tables = MIXED_ROWS[r:r + 1], case.tables[r:r + 1]
        alone.num_computed, alone.num_new = case.num_computed[r:r + 1], case.num_new[r:r + 1]
        assert torch.equal(alone.kernel(q=case.q[first:first + new]), batched[first:first + new])
        first += new


@needs_kernel
def test_kernel_reads_q_with_a_token_stride() -> None:
    """q arrives as a slice of the fused QKV output: rows strided, heads contiguous."""
    case = Case(torch.bfloat16, (9, 3, 64), 16, MIXED_ROWS)
    qkv = torch.randn(case.q.shape[0], 15, 64).to(torch.bfloat16)
    qkv[:, :9] = case.q
    assert torch.equal(case.kernel(q=qkv[:, :9]), case.kernel())


@needs_kernel
def test_avx512_path_where_the_cpu_has_it() -> None:
    """The shapes above cover both paths: AVX-512 where the CPU has it, plain C for odd head sizes and
    blocks that do not hold whole quads."""
    assert KERNEL is not None
    flags = open("/proc/cpuinfo").read()
    assert not KERNEL.uses_avx512(torch.bfloat16, 80, 16) and not KERNEL.uses_avx512(torch.float32, 40, 16)
    assert not KERNEL.uses_avx512(torch.bfloat16, 64, 1) and not KERNEL.uses_avx512(torch.float32, 64, 6)
    if "avx512_bf16" in flags:
        assert KERNEL.uses_avx512(torch.bfloat16, 64, 16) and KERNEL.uses_avx512(torch.bfloat16, 128, 4)
    if "avx512bw" in flags:
        assert KERNEL.uses_avx512(torch.float32, 64, 32) and KERNEL.uses_avx512(torch.float32, 80, 16)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_build_without_avx2_matches_reference(dtype: torch.dtype) -> None:
    """A CPU without AVX2 (a build with -mno-avx2, which drops AVX-512 too) runs the natural layout's plain C
    loops, where this CPU runs them 8 lanes wide: the same results within the tolerance, every head shape."""
    lib = load_library(("-mno-avx2",))
    if lib is None:
        pytest.skip("the -mno-avx2 build failed")
    kernel = AttentionKernel(bindings.bind(lib))
    assert not kernel.uses_avx512(dtype, 64, 16)
    for heads in HEADS:
        case = Case(dtype, heads, 16, MIXED_ROWS)
        got = kernel(case.q, case.k_cache, case.v_cache, case.tables, case.tiles(), case.scale)
        atol = TOLERANCE[dtype]
        torch.testing.assert_close(got.double(), case.reference(), atol=atol, rtol=atol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,block_size", [((9, 3, 64), 16), ((8, 2, 128), 4), ((4, 2, 32), 32), ((4, 2, 40), 16)])
def test_write_kv_stores_the_documented_layout(dtype: torch.dtype, heads: tuple[int, int, int],
                                              block_size: int) -> None:
    """write_kv puts each key where the kernel's header says (the AVX-512 path's layout), or as the
    cache's shape says on the plain C path; slots it is not given stay as they were."""
    assert KERNEL is not None
    _, kvh, hd = heads
    gen = torch.Generator().manual_seed(1)
    k_nat, v_nat = (torch.randn(5, block_size, kvh, hd, generator=gen).to(dtype) for _ in range(2))
    k_out, v_out = kernel_caches(k_nat, v_nat)
    fast = KERNEL.uses_avx512(dtype, hd, block_size)
    flags = open("/proc/cpuinfo").read()
    assert fast == (hd != 40 and "avx512bw" in flags and (dtype == torch.float32 or "avx512_bf16" in flags))
    assert torch.equal(k_out, documented_layout(k_nat, True) if fast else k_nat)
    assert torch.equal(v_out, documented_layout(v_nat, False) if fast else v_nat)
    slots = torch.tensor([3, block_size + 1, 4 * block_size + block_size - 1])  # some slots, out of order
    new_k, new_v = (torch.randn(3, kvh, hd, generator=gen).to(dtype) for _ in range(2))
    KERNEL.write_kv(k_out, v_out, new_k, new_v, slots)
    k_nat.view(-1, kvh, hd)[slots], v_nat.view(-1, kvh, hd)[slots] = new_k, new_v
    assert torch.equal(k_out, documented_layout(k_nat, True) if fast else k_nat)
    assert torch.equal(v_out, documented_layout(v_nat, False) if fast else v_nat)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 40)])  # the AVX-512 path, the plain C path
@pytest.mark.parametrize("rows", [MIXED_ROWS, [(30, 1), (0, 9)], [(15, 1)]])  # one row: per-head items
def test_decode_rows_write_their_own_kv(dtype: torch.dtype, heads: tuple[int, int, int],
                                        rows: list[tuple[int, int]]) -> None:
    """num_own_writes: the kernel stores the leading one-token rows' K/V (read from their q rows, after
    the query heads) before reading them: the same output and the same cache, bit for bit, as writing
    them first. Their slots start as NaN, so a read before the write would show."""
    assert KERNEL is not None
    num_heads, kvh, hd = heads
    case = Case(dtype, heads, 16, rows, seed=3)
    tiles = case.tiles()
    k_full, v_full = kernel_caches(case.k_cache, case.v_cache)
    want = KERNEL(case.q, k_full, v_full, case.tables, tiles, case.scale)
    positions = torch.cat([torch.arange(c, c + n) for c, n in rows])
    row_of = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([n for _, n in rows]))
    slots = case.tables[row_of, positions // 16] * 16 + positions % 16
    new_k, new_v = (cache.view(-1, kvh, hd)[slots] for cache in (case.k_cache, case.v_cache))
    num_decode = next((i for i, (_, n) in enumerate(rows) if n != 1), len(rows))  # the leading one-token rows
    k_nat, v_nat = case.k_cache.clone(), case.v_cache.clone()
    k_nat.view(-1, kvh, hd)[slots[:num_decode]] = float("nan")
    v_nat.view(-1, kvh, hd)[slots[:num_decode]] = float("nan")
    k_cache, v_cache = kernel_caches(k_nat, v_nat)
    qkv = torch.cat([case.q.flatten(1), new_k.flatten(1), new_v.flatten(1)], dim=1)  # a fused QKV's rows
    q = qkv[:, :num_heads * hd].view(-1, num_heads, hd)
    got = KERNEL(q, k_cache, v_cache, case.tables, tiles, case.scale, num_own_writes=num_decode)
    assert num_decode > 0 and torch.equal(got, want)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32  # unused slots hold NaN: compare bits
    assert torch.equal(k_cache.view(bits), k_full.view(bits)) and torch.equal(v_cache.view(bits), v_full.view(bits))


def test_make_tiles() -> None:
    tiles = make_tiles(torch.tensor([7, 0, 3]), torch.tensor([1, 5, 2]), tile_tokens=2)
    # (row, first token, num tokens, context of the first token)
    assert tiles.tolist() == [[0, 0, 1, 8], [1, 1, 2, 1], [1, 3, 2, 3], [1, 5, 1, 5], [2, 6, 2, 4]]


# ---- the kernel against the torch path, through prepare_batch and paged_attention --------------------

def _scheduled_rows(case: Case) -> list[ScheduledRow]:
    params = SamplingParams(temperature=0.0, max_tokens=None)
    return [ScheduledRow(f"r{i}", list(range(c + n)), c + n, c, n, case.tables[i].tolist(), params,
                         needs_sample=True) for i, (c, n) in enumerate(case.rows)]


@needs_kernel
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 80)])
def test_kernel_matches_torch_path(dtype: torch.dtype, atol: float, heads: tuple[int, int, int]) -> None:
    case = Case(dtype, heads, 4, MIXED_ROWS)  # decode rows come first: prepare_batch keeps the order
    case.k_cache, case.v_cache = case.k_cache.nan_to_num(0.0), case.v_cache.nan_to_num(0.0)
    rows = _scheduled_rows(case)
    positions = torch.cat([torch.arange(c, c + n) for c, n in case.rows])
    slots = case.tables[torch.repeat_interleave(torch.arange(len(rows)), case.num_new), positions // 4] * 4 + positions % 4
    kv_heads, head_dim = case.k_cache.shape[2:]
    new_k = case.k_cache.view(-1, kv_heads, head_dim)[slots].clone()
    new_v = case.v_cache.view(-1, kv_heads, head_dim)[slots].clone()
    outs = []
    for kernel in (KERNEL, None):
        meta = prepare_batch(rows, 4, torch.device("cpu"), kernel).meta
        assert isinstance(meta, AttentionMetadata) and (meta.kernel is None) == (kernel is None)
        caches = kernel_caches(case.k_cache, case.v_cache) if kernel else (case.k_cache.clone(), case.v_cache.clone())
        outs.append(paged_attention(case.q, new_k, new_v, *caches, meta, case.scale))
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=atol, rtol=atol)


@needs_kernel
def test_decode_step_inputs_match_the_general_path() -> None:
    """A step of decode rows only builds its inputs from Python lists (_prepare_decode): the same tensors
    as the vectorized path, for rows at block boundaries, with spare blocks, some not sampling, some with
    speculative drafts (then every fed position samples)."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(60):
        rows = []
        for i in range(int(torch.randint(1, 40, (1,), generator=gen))):
            computed = int(torch.randint(0, 70, (1,), generator=gen))
            drafts = tuple(range(int(torch.randint(0, 5, (1,), generator=gen)) if trial % 2 else 0))
            spare = int(torch.randint(0, 3, (1,), generator=gen))
            table = torch.randint(0, 500, ((computed + len(drafts)) // 16 + 1 + spare,), generator=gen).tolist()
            rows.append(ScheduledRow(f"r{i}", list(range(computed + 1)), max(1, computed - 2), computed,
                                     1 + len(drafts), table, SamplingParams(), spec_token_ids=drafts,
                                     needs_sample=bool(drafts) or bool(torch.rand(1, generator=gen) < 0.8)))
        fast = prepare_batch(rows, 16, torch.device("cpu"), KERNEL, scratch_slot=10_000)
        general = _prepare_any(rows, 16, torch.device("cpu"), KERNEL, scratch_slot=10_000)
        for name in ("input_ids", "positions", "sample_indices", "sample_tiles"):
            assert torch.equal(getattr(fast, name), getattr(general, name)), name
        for name in ("slot_mapping", "block_tables", "tiles"):
            assert torch.equal(getattr(fast.meta, name), getattr(general.meta, name)), name
        assert fast.meta.num_decode_tokens == general.meta.num_decode_tokens
        assert len(fast.sample_indices) == sum(r.num_samples for r in rows)
        # the flag that lets the model skip its output gather holds exactly when sampling is the identity
        assert fast.samples_all_in_order == torch.equal(fast.sample_indices, torch.arange(len(fast.input_ids)))
        keep, keep_tiles = fast.keep()
        assert (keep is None and keep_tiles is None) if fast.samples_all_in_order else \
            (keep is fast.sample_indices and keep_tiles is fast.sample_tiles)


@needs_kernel
def test_kernel_and_torch_path_runners_match_hf() -> None:
    hf_model = tiny_hf_model("llama")
    prompts = [[5, 17, 99, 3, 250, 42, 7], [11, 12], [77]]
    reference = [hf_greedy(hf_model, p, 6) for p in prompts]
    for native in (True, False):
        runner = runner_for(hf_model, native_attention=native)
        assert (runner.attention_kernel is not None) == native
        alloc = BlockAllocator(runner.block_size)
        seqs = [alloc.seq(f"r{i}", p, len(p) + 6) for i, p in enumerate(prompts)]
        step(runner, [(s, None) for s in seqs])
        for _ in range(5):
            step(runner, [(s, 1) for s in seqs])
        assert [s.output for s in seqs] == reference
