"""Linear layers on weights kept in GGUF blocks (Q8_0, Q4_0, Q4_1, Q2_K, Q3_K, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K,
IQ4_NL, IQ4_XS; and IQ4_TAB, IQ4_XS's layout with its own table of 16 values, which holds IQ2_XXS, IQ1_S,
IQ3_XXS and IQ3_S weights exactly, IQ4_TAB16, its twin with a scale per 16 weights, and IQ3_TAB16, that
with 3-bit indices, which holds IQ2_XS, IQ2_S and IQ1_M: models/requantize.py; IQ2_GRID, IQ2_XXS's own grid
indices, where the CPU has AVX-512 VBMI: models/iq2_grid.py; and IQ1_TRIT, IQ1_S's weights as 2-bit codes:
models/iq1_trit.py; and TQ2_0, the ternary files' 2-bit codes, which also holds TQ1_0): csrc/gemm_quant.c.

A weight arrives as GGUF's blocks, a uint8 tensor [N, K / block, block_bytes] (one row of blocks per
output; `raw_blocks` views a GGUF tensor so). `pack_blocks` reorders those bytes once, at load, into
the kernel's panels of 16 rows: the packed tensor [N / 16, K / block, 16 block_bytes] holds the same
number of bytes (gemm_quant.c documents the layout; a Q8_0 code also has its sign bit flipped). Its last
dimension names the format (544, 288, 320, 1344, 1760, 2304, 352, 384, 2816, 3360, 576, 2176, 2240, 2432, 1152,
1120, 1888, 1056 bytes), so a packed weight is a plain uint8 Parameter and needs no side record: `is_quantized`,
`quant_type` and `quantized_shape` read it off the shape.

`quantized_linear(x, packed, bias)` runs the kernel on fp32 or bf16 x; `quantized_rows` dequantizes rows
(an embedding lookup; a tied lm_head reads the same table through the kernel). Weights stay quantized
only where the library is built (its AVX2 path, or plain C, serves CPUs without AVX-512 VNNI); with
COBATCH_NO_NATIVE=1 or no compiler the loader dequantizes them, as it does every other GGUF type.
"""

from __future__ import annotations

import ctypes
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from cobatch.kernels.bindings import load_kernels

PANEL_ROWS = 16  # output rows per packed panel (one AVX-512 vector of fp32 results)
# The calls single-stream mode takes when it is chosen (gemm_quant.c): on a Zen 4 it was faster at 1 and 2
# rows (1.2-1.45x at one) and slower from 4, where NZ panels per task give the tile more work per load.
SINGLE_STREAM_ROWS = 2
# gemm_quant_path()'s AVX-512 VNNI path: the one with a software prefetch to choose in single-stream mode.
VNNI_PATH = 2
# The batch wide-tile mode is timed at (gemm_quant.c, gemm_quant_set_wide_tiles): a batch of 16 decodes.
WIDE_TILE_ROWS = 16

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class QuantFormat:
    """One GGUF block format: its name, the C side's qtype, weights and bytes per block."""

    name: str
    qtype: int
    block_size: int
    block_bytes: int

    @property
    def panel_bytes(self) -> int:
        return PANEL_ROWS * self.block_bytes


FORMATS = {f.name: f for f in (QuantFormat("q8_0", 0, 32, 34), QuantFormat("q4_0", 1, 32, 18),
                               QuantFormat("q4_k", 2, 256, 144), QuantFormat("q5_0", 3, 32, 22),
                               QuantFormat("q6_k", 4, 256, 210), QuantFormat("q5_k", 5, 256, 176),
                               QuantFormat("q4_1", 6, 32, 20), QuantFormat("q5_1", 7, 32, 24),
                               QuantFormat("iq4_xs", 8, 256, 136),
                               # IQ4_NL: two 18-byte GGUF blocks a unit, so that its panels (576 bytes) are
                               # told apart from Q4_0's, whose layout each half shares
                               QuantFormat("iq4_nl", 9, 64, 36), QuantFormat("q3_k", 10, 256, 110),
                               QuantFormat("q2_k", 11, 256, 84),
                               # IQ4_XS's 136 bytes and 4 of its table's 16 (requantize.py): no GGUF type
                               QuantFormat("iq4_tab", 12, 256, 140),
                               # IQ4_TAB with an int8 scale per 16 weights: d | 16 scales | codes | share | 2
                               QuantFormat("iq4_tab16", 13, 256, 152),
                               # IQ2_XXS's grid indices and signs, IQ4_XS's d and scales (models/iq2_grid.py)
                               QuantFormat("iq2_grid", 14, 256, 72),
                               # IQ1_S's grid values + 1 as 2-bit codes, its scales and deltas (models/iq1_trit.py)
                               QuantFormat("iq1_trit", 15, 256, 70),
                               # IQ4_TAB16's fields with a 3-bit index as Q3_K's codes: d | 16 scales | hmask |
                               # qs | share (requantize.py)
                               QuantFormat("iq3_tab16", 16, 256, 118),
                               # ternary: GGUF's TQ2_0 as it is, qs [64] | d (TQ1_0 becomes it: requantize.py)
                               QuantFormat("tq2_0", 17, 256, 66))}
_BY_PANEL_BYTES = {f.panel_bytes: f for f in FORMATS.values()}


def is_quantized(weight: torch.Tensor) -> bool:
    """A weight packed by pack_blocks (quantized_linear reads it)."""
    return weight.dtype == torch.uint8 and weight.dim() == 3 and weight.shape[-1] in _BY_PANEL_BYTES


def quant_type(packed: torch.Tensor) -> QuantFormat:
    """The format of a packed weight."""
    return _BY_PANEL_BYTES[packed.shape[-1]]


def quantized_shape(packed: torch.Tensor) -> tuple[int, int]:
    """(N, K) of the weight a packed tensor holds."""
    return packed.shape[0] * PANEL_ROWS, packed.shape[1] * quant_type(packed).block_size


def can_pack_blocks(out_features: int, in_features: int, fmt: QuantFormat) -> bool:
    """Whether an [N, K] weight in `fmt` can take the packed layout (N a multiple of 16: every real shape)
    and the kernel is here to read it."""
    return (out_features % PANEL_ROWS == 0 and in_features % fmt.block_size == 0
            and native_quant_gemm() is not None)


def raw_blocks(data: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """A GGUF tensor's bytes [N, row_bytes] as its blocks [N, K / block, block_bytes]."""
    return data.view(data.shape[0], -1, fmt.block_bytes)


def pack_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF blocks [N, nb, block_bytes] (N % 16 == 0) -> the kernel's panels [N / 16, nb, 16 block_bytes]."""
    kernel = native_quant_gemm()
    assert kernel is not None, "quantized weights are kept only where the kernel is (can_pack_blocks)"
    return kernel.pack(blocks)


class QuantGemm:
    """The library's quantized entry points on torch tensors."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._fn, self._rows, self._pack = lib.gemm_quant, lib.quant_rows, lib.quant_pack
        self.path = lib.gemm_quant_path()  # VNNI_PATH, 1 AVX2, 0 plain C
        self.byte_lookups = bool(lib.gemm_quant_byte_lookups())  # IQ2_GRID at speed (else correct, slow)
        self._modes: dict[tuple[str, int | None], int] = {}  # the speed choices made, in order (copy_modes_to)

    def set_single_stream(self, max_rows: int, qtype: int | None = None) -> None:
        """Single-stream mode for calls of at most max_rows rows (0: off), in every format or one
        (gemm_quant.c says what)."""
        self._set_mode("gemm_quant_set_single_stream", qtype, max_rows)

    def set_single_prefetch(self, level: int, qtype: int | None = None) -> None:
        """Single-stream mode's software prefetch: 0 none, 1 into L1, 2 into L2; every format or one."""
        self._set_mode("gemm_quant_set_single_prefetch", qtype, level)

    def set_wide_tiles(self, on: int) -> None:
        """The VNNI path's 8-row micro-tiles (1) or 4-row ones (0)."""
        self._set_mode("gemm_quant_set_wide_tiles", None, on)

    def set_amx(self, on: bool) -> bool:
        """16-row groups of the K-quants, Q4_0, Q5_0 and IQ4_NL on AMX's tile unit (on, the default where the CPU
        has AMX-INT8 and Linux grants it) or on the VNNI tiles (off: A/B runs, tests); the bits are the same.
        Whether AMX is in use."""
        return bool(self._lib.gemm_quant_set_amx(int(on)))

    def copy_modes_to(self, lib: ctypes.CDLL) -> None:
        """Make the speed choices made here in another build of the library (KERNEL_TIMERS' twin): each
        build keeps its own."""
        for (entry, qtype), value in self._modes.items():
            _apply_mode(lib, entry, qtype, value)

    def _set_mode(self, entry: str, qtype: int | None, value: int) -> None:
        if qtype is None:  # every format: it replaces the per-format choices made before
            self._modes = {key: v for key, v in self._modes.items() if key[0] != entry}
        self._modes[(entry, qtype)] = value
        _apply_mode(self._lib, entry, qtype, value)

    def pack(self, blocks: torch.Tensor) -> torch.Tensor:
        """GGUF blocks [N, nb, block_bytes] -> packed [N / 16, nb, 16 block_bytes] (pack_blocks)."""
        n, nb, block_bytes = blocks.shape
        fmt = next((f for f in FORMATS.values() if f.block_bytes == block_bytes), None)
        if blocks.dtype != torch.uint8 or fmt is None or not can_pack_blocks(n, nb * fmt.block_size, fmt):
            raise ValueError(f"not packable GGUF blocks: {blocks.dtype} {tuple(blocks.shape)}")
        blocks = blocks.contiguous()
        out = torch.empty(n // PANEL_ROWS, nb, fmt.panel_bytes, dtype=torch.uint8)
        status = self._pack(blocks.data_ptr(), fmt.qtype, n, nb * fmt.block_size, out.data_ptr(),
                            torch.get_num_threads())
        assert status == 0, f"quant_pack failed with status {status}"
        return out

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """[..., K] -> [..., N] in x's dtype (fp32 or bf16)."""
        n, k = quantized_shape(packed)
        _check_operands(x, bias, n, k)
        x, bias = x.contiguous(), None if bias is None else bias.contiguous()  # kept alive across the call
        out = x.new_empty(*x.shape[:-1], n)
        if out.numel() > 0:
            status = self._fn(x.data_ptr(), packed.data_ptr(), quant_type(packed).qtype,
                              None if bias is None else bias.data_ptr(), out.data_ptr(), x.numel() // k, n, k,
                              int(x.dtype == torch.bfloat16), torch.get_num_threads())
            if status != 0:
                raise (MemoryError if status == -1 else RuntimeError)(f"gemm_quant failed with status {status}")
        return out

    def rows(self, ids: torch.Tensor, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the weight, dequantized: [*ids.shape, K] in dtype (fp32 or bf16)."""
        n, k = quantized_shape(packed)
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.numel(), k, dtype=dtype)
        if self._rows(packed.data_ptr(), quant_type(packed).qtype, flat.data_ptr(), flat.numel(), n, k,
                      out.data_ptr(), int(dtype == torch.bfloat16)) != 0:
            raise IndexError(f"token id out of range [0, {n})")
        return out.view(*ids.shape, k)


def _check_operands(x: torch.Tensor, bias: torch.Tensor | None, n: int, k: int) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16) or x.shape[-1] != k or not x.is_cpu:
        raise ValueError(f"quantized linear takes fp32 or bf16 CPU input [..., {k}], got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    if bias is not None and (bias.dtype != x.dtype or bias.shape != (n,)):
        raise ValueError(f"quantized linear takes a bias [{n}] in the input's dtype")


def _apply_mode(lib: ctypes.CDLL, entry: str, qtype: int | None, value: int) -> None:
    if qtype is None:
        getattr(lib, entry)(value)
    else:
        getattr(lib, f"{entry}_for")(qtype, value)


@lru_cache(maxsize=1)
def native_quant_gemm() -> QuantGemm | None:
    """The kernel (AVX-512 VNNI, AVX2 or plain C, as the CPU has); None when native code is off or unbuilt."""
    lib = load_kernels()
    return None if lib is None else QuantGemm(lib)


def quantized_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T + bias for a packed quantized W."""
    kernel = native_quant_gemm()
    assert kernel is not None, "quantized weights exist only where the kernel does"
    return kernel(x, packed, bias)


def quantized_rows(ids: torch.Tensor, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """F.embedding(ids, W) for a packed quantized W: rows [*ids.shape, K] in dtype."""
    kernel = native_quant_gemm()
    assert kernel is not None, "quantized weights exist only where the kernel does"
    return kernel.rows(ids, packed, dtype)


def tune_single_stream(weights: Sequence[torch.Tensor], rounds: int = 5) -> set[str]:
    """Turn gemm_quant's single-stream mode on where it is faster on these packed weights, format by format:
    one row (a one-stream decode) through each format's matrices in turn, as a decode step streams them from
    memory; on the VNNI path with its software prefetch (into L1 or L2) or with the hardware prefetcher
    alone. Which a CPU's prefetchers prefer differs between CPUs and formats (a Zen 4 streamed Q8_0 fastest
    without software prefetch and Q2_K / Q3_K fastest with it into L2); the results' bits do not. Returns
    the formats it is on for."""
    kernel = native_quant_gemm()
    if kernel is None:
        return set()
    by_format: dict[QuantFormat, list[torch.Tensor]] = {}
    for w in weights:
        by_format.setdefault(quant_type(w), []).append(w)
    on = set()
    for fmt, group in by_format.items():
        def mode(max_rows: int, prefetch: int, qtype: int = fmt.qtype) -> Callable[[], None]:
            def apply() -> None:
                kernel.set_single_stream(max_rows, qtype)
                kernel.set_single_prefetch(prefetch, qtype)
            return apply

        modes = {"off": mode(0, 1), "on": mode(SINGLE_STREAM_ROWS, 1)}
        if kernel.path == VNNI_PATH:
            modes["on without software prefetch"] = mode(SINGLE_STREAM_ROWS, 0)
            modes["on, prefetching into L2"] = mode(SINGLE_STREAM_ROWS, 2)
        name = f"{fmt.name} single-stream mode (up to {SINGLE_STREAM_ROWS} rows)"
        if _keep_fastest(kernel, modes, group, 1, rounds, name) != "off":
            on.add(fmt.name)
    return on


def tune_wide_tiles(weights: Sequence[torch.Tensor], rounds: int = 3) -> bool:
    """Turn gemm_quant's wide tiles (8 rows instead of 4: gemm_quant.c) on where a batch of WIDE_TILE_ROWS
    rows through every matrix runs faster with them. The bits do not depend on it. Returns whether it is on."""
    kernel = native_quant_gemm()
    if kernel is None or not weights:
        return False
    modes = {"off": lambda: kernel.set_wide_tiles(0), "on": lambda: kernel.set_wide_tiles(1)}
    name = f"wide tiles (at {WIDE_TILE_ROWS} rows)"
    return _keep_fastest(kernel, modes, weights, WIDE_TILE_ROWS, rounds, name) == "on"


def _keep_fastest(kernel: QuantGemm, modes: dict[str, Callable[[], None]], weights: Sequence[torch.Tensor],
                  rows: int, rounds: int, name: str) -> str:
    """Time `rows` rows through every weight in turn in each mode (set by its callable), alternately, the best
    of `rounds` each (a noisy moment hits them all); keep the fastest, log it, return its name."""
    # any values time alike; constants leave torch's global random state as the caller seeded it
    x = {k: torch.full((rows, k), 0.5) for k in {quantized_shape(w)[1] for w in weights}}
    best = dict.fromkeys(modes, math.inf)
    for _ in range(rounds):
        for label, set_mode in modes.items():
            set_mode()
            start = time.perf_counter()
            for w in weights:
                kernel(x[quantized_shape(w)[1]], w)
            best[label] = min(best[label], time.perf_counter() - start)
    chosen = min(best, key=best.__getitem__)
    modes[chosen]()
    logger.info("quantized GEMM: %s: %s (a pass: %s)", name, chosen,
                " | ".join(f"{label} {1e3 * t:.2f} ms" for label, t in best.items()))
    return chosen
