"""Native CPU kernels (csrc/*.c): built with the system C compiler at first use, cached per source and
machine, loaded with ctypes; `None` wherever they cannot be built (then the pure-torch paths run).

`build_library` is the shared build step; the paged attention kernel's wrapper lives here, the packed
bf16 GEMM's in models/linear.py, the fused elementwise ops' (and greedy argmax) in models/fused_ops.py,
the C layer loop's (which calls the other three) in models/native_decoder.py.

Why not torch.utils.cpp_extension: torch's headers make a build take a minute; these plain C files build
in ~19 s together (once per source and CPU) and need nothing but gcc (or cc) with OpenMP.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

_CSRC = Path(__file__).parent / "csrc"
# Not -ffast-math: linking with it pulls in crtfastmath, which sets FTZ/DAZ for the whole process
# (denormals become 0, e.g. top_p=5e-324 compares equal to 0). These flags allow the same
# vectorized reductions without touching the floating-point environment.
_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_COMPILE_TIMEOUT_S = 120
_DISABLE_ENV = "COBATCH_NO_NATIVE"  # set to 1 to force the pure-torch path (A/B measurements)
# q, q_stride, k_cache, v_cache, block_tables, max_blocks, tiles, num_tiles, out, num_heads,
# num_kv_heads, head_dim, block_size, scale, num_own_writes
_ARGTYPES = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p,
             ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_int64])
# k, k_stride, v, v_stride, k_cache, v_cache, slot_mapping, num_tokens, num_kv_heads, head_dim, block_size
_WRITE_ARGTYPES = ([ctypes.c_void_p, ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3 + [ctypes.c_int64]
                   + [ctypes.c_int] * 3)


class AttentionKernel:
    """Paged attention over a ragged batch for fp32 and bf16 caches (csrc/paged_attention.c: layouts).

    The caches it reads are its own: shaped [blocks, block_size, kv heads, head_dim], but on its AVX-512
    path each block's elements are pre-arranged for it (`uses_avx512`; the file header draws the
    layout), so every write to them goes through `write_kv`. Whole blocks can still be copied, swapped
    and shared as they are."""

    tile_tokens = 16  # consecutive query tokens of one sequence that share each K/V read

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {torch.float32: lib.paged_attention_f32, torch.bfloat16: lib.paged_attention_bf16}
        for fn in self._fns.values():
            fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
        self._writes = {torch.float32: lib.paged_write_kv_f32, torch.bfloat16: lib.paged_write_kv_bf16}
        for fn in self._writes.values():
            fn.argtypes, fn.restype = _WRITE_ARGTYPES, None
        self._is_fast = lib.paged_attention_is_fast
        self._is_fast.argtypes, self._is_fast.restype = [ctypes.c_int] * 3, ctypes.c_int

    def supports(self, dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and dtype in self._fns

    def uses_avx512(self, dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
        """Whether this dtype, head size and block size run the AVX-512 path on the kernel layout (else
        the plain C one, on [blocks, block_size, kv heads, head_dim] as it looks)."""
        return bool(self._is_fast(dtype == torch.bfloat16, head_dim, block_size))

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store new tokens' K/V ([T, kvh, hd], token stride free) at their cache slots, in the layout
        the kernel reads."""
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        for x in (k, v):
            assert x.dtype == k_cache.dtype and x.stride(2) == 1 and x.stride(1) == head_dim
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype
        slots = slot_mapping.contiguous()
        assert slots.dtype == torch.int64 and len(slots) == len(k) == len(v)
        self._writes[k_cache.dtype](k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(),
                                    v_cache.data_ptr(), slots.data_ptr(), len(slots), num_kv_heads, head_dim,
                                    block_size)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, tiles: torch.Tensor, scale: float,
                 num_own_writes: int = 0) -> torch.Tensor:
        """q [T, nh, hd] (token stride free), caches [blocks, bs, kvh, hd], block_tables [S, nb],
        tiles [N, 4] (seq, first token, tokens, context of the first) -> [T, nh, hd]. num_own_writes: the
        first tiles are one-token rows whose new K/V follow their q heads in q's rows ([q | k | v], as a
        fused QKV projection lays them out): the kernel writes them first (csrc: write_own_key)."""
        num_tokens, num_heads, head_dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            assert num_own_writes == 0, "own writes read K/V from q's rows: q must be a view of them"
            q = q.contiguous()
        _, block_size, num_kv_heads, _ = k_cache.shape
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.is_contiguous()
        assert block_tables.dtype == torch.int64 and tiles.dtype == torch.int64 and tiles.is_contiguous()
        assert num_heads % num_kv_heads == 0 and q.dtype == k_cache.dtype == v_cache.dtype
        out = q.new_empty(num_tokens, num_heads, head_dim)
        status = self._fns[q.dtype](
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.shape[1], tiles.data_ptr(), tiles.shape[0], out.data_ptr(), num_heads,
            num_kv_heads, head_dim, block_size, scale, num_own_writes)
        if status != 0:
            raise MemoryError("native attention could not allocate its scratch buffers")
        return out


@lru_cache(maxsize=1)
def load_attention_kernel() -> AttentionKernel | None:
    """The kernel, building it if needed; None when disabled, not on x86-64/Linux, or the build fails."""
    lib = load_library("paged_attention")
    try:
        return AttentionKernel(lib) if lib is not None else None
    except AttributeError:
        return None


def native_disabled() -> bool:
    """COBATCH_NO_NATIVE=1 (A/B measurements), or not Linux: every native kernel stays off."""
    return os.environ.get(_DISABLE_ENV, "") not in ("", "0") or platform.system() != "Linux"


def load_library(name: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """csrc/<name>.c built and loaded; None when native code is disabled or the build fails. extra_flags
    (e.g. -DKERNEL_TIMERS for decoder.c's timers) make a build of their own."""
    if native_disabled():
        return None
    try:
        return ctypes.CDLL(str(build_library(_CSRC / f"{name}.c", extra_flags)))
    except (OSError, subprocess.SubprocessError):
        return None


def build_library(source_path: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile to a cache path keyed by source, flags and CPU; reuse it when present."""
    source, flags = source_path.read_bytes(), (*_FLAGS, *extra_flags)
    key = hashlib.sha256(source + " ".join(flags).encode() + _cpu_signature().encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source_path.stem}-{key}.so"
    if target.exists():
        return target
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, str(source_path), "-o", str(built), "-lm"], check=True,
                       capture_output=True, timeout=_COMPILE_TIMEOUT_S)
        os.replace(built, target)  # atomic: concurrent builders never load a half-written file
    return target


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cobatch"


def _cpu_signature() -> str:
    """-march=native code must not be reused on another CPU: key the build by the CPU's flags."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()
