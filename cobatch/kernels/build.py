"""The kernels library: every csrc/*.c in one shared library, built by one call of the system C compiler at
first use, cached per sources, flags and CPU, loaded with ctypes; None wherever it cannot be built (then the
pure-torch paths run). bindings.py declares its entry points.

Why not torch.utils.cpp_extension: torch's headers make a build take a minute; these plain C files need
nothing but gcc (or cc) with OpenMP.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from cobatch.kernels.cpu import cpu_flags

_CSRC = Path(__file__).parent / "csrc"
# Not -ffast-math: linking with it pulls in crtfastmath, which sets FTZ/DAZ for the whole process
# (denormals become 0, e.g. top_p=5e-324 compares equal to 0). These flags allow the same
# vectorized reductions without touching the floating-point environment.
COMPILE_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_COMPILE_TIMEOUT_S = 240  # all sources in one call
_DISABLE_ENV = "COBATCH_NO_NATIVE"  # set to 1 to force the pure-torch path (A/B measurements)
_LIBRARY_NAME = "cobatch_kernels"


def native_disabled() -> bool:
    """COBATCH_NO_NATIVE=1 (A/B measurements), or not Linux: every native kernel stays off."""
    return os.environ.get(_DISABLE_ENV, "") not in ("", "0") or platform.system() != "Linux"


def load_library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library built and loaded; None when native code is disabled or the build fails. extra_flags
    (e.g. -DKERNEL_TIMERS for decoder.c's timers) make a build of their own."""
    if native_disabled():
        return None
    try:
        return ctypes.CDLL(str(build_library(extra_flags)))
    except (OSError, subprocess.SubprocessError):
        return None


def build_library(extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile every source into a cache path keyed by the sources (and header), flags and CPU; reuse it
    when present."""
    sources, flags = sorted(_CSRC.glob("*.c")), (*COMPILE_FLAGS, *extra_flags)
    target = _cache_dir() / f"{_LIBRARY_NAME}-{_build_key(flags)}.so"
    if target.exists():
        return target
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, *map(str, sources), "-o", str(built), "-lm"], check=True,
                       capture_output=True, timeout=_COMPILE_TIMEOUT_S)
        os.replace(built, target)  # atomic: concurrent builders never load a half-written file
    return target


def _build_key(flags: tuple[str, ...]) -> str:
    """-march=native code must not be reused on another CPU: the key covers the CPU's flags too."""
    digest = hashlib.sha256()
    for path in sorted([*_CSRC.glob("*.c"), *_CSRC.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(flags).encode() + b"\0")
    digest.update((" ".join(sorted(cpu_flags())) or platform.processor()).encode())
    return digest.hexdigest()[:16]


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cobatch"
