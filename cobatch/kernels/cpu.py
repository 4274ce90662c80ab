"""The CPU's feature flags (/proc/cpuinfo), read once: the kernels' build key and the runner's bf16 check."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The first CPU's flags ("avx512f", "avx512_bf16", ...); empty where /proc/cpuinfo cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()
