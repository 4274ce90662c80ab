"""How much of this process's CPUs other processes use: cumulative counters from /proc/stat and the process clock.

The thread policy (thread_policy.py) needs one number per window: the cores that something other than
this process kept busy (other processes, and the hypervisor's steal on a VM). /proc/stat counts every
CPU's busy time in USER_HZ ticks; this process's own CPU time, its compute threads' spinning included,
comes from the process clock. Only the CPUs this process may run on count (sched_getaffinity), so a
server pinned with taskset is judged on its own cores.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
# /proc/stat columns after the cpu name: user nice system idle iowait irq softirq steal (guest is in user).
_IDLE_COLUMNS = (3, 4)
_COUNTED_COLUMNS = 8


@dataclass(frozen=True, slots=True)
class CpuSample:
    """Cumulative counters at one instant (differences of two samples make a window)."""

    time_s: float  # time.monotonic()
    busy_s: float  # non-idle time summed over this process's CPUs (steal included)
    own_s: float  # this process's CPU time, all its threads


def others_busy_cores(start: CpuSample, end: CpuSample) -> float:
    """Cores kept busy by anything but this process between the two samples (>= 0)."""
    elapsed = end.time_s - start.time_s
    if elapsed <= 0:
        return 0.0
    return max(0.0, ((end.busy_s - start.busy_s) - (end.own_s - start.own_s)) / elapsed)


def usable_cpus() -> set[int]:
    """The CPUs this process may run on."""
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def read_cpu_sample(cpus: set[int], stat_path: str = "/proc/stat") -> CpuSample | None:
    """Now's counters over `cpus`; None where /proc/stat cannot be read (not Linux)."""
    try:
        with open(stat_path) as f:
            lines = f.readlines()
    except OSError:
        return None
    return CpuSample(time.monotonic(), _busy_ticks(lines, cpus) * _TICK_S, time.process_time())


def _busy_ticks(lines: list[str], cpus: set[int]) -> int:
    """Non-idle ticks of the `cpuN` lines for N in cpus."""
    busy = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        values = [int(v) for v in rest.split()[:_COUNTED_COLUMNS]]
        busy += sum(values) - sum(values[i] for i in _IDLE_COLUMNS)
    return busy
