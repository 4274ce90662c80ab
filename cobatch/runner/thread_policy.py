"""How many compute threads a step runs with: fewer while other processes use the CPUs, all when they are free.

Why: the decoder's parallel regions (torch's intra-op threads, MKL, the native kernels' OpenMP) end
in barriers, and a barrier waits for its slowest thread. With one other busy process on 2 cores, one
of 2 compute threads is descheduled for a whole time slice at a time, and each of a step's hundreds
of barriers waits for it: a served stream fell ~95x (docs/BENCHMARKS.md "Shared CPU"). One thread
fewer than the cores others leave free never waits on a peer.

The policy watches, window by window, how many cores something other than this process kept busy
(cpu_usage.py) and keeps `floor(free + 0.5)` threads, free = usable CPUs - that. Asymmetric
hysteresis, because the costs are: a thread too many under contention costs up to ~95x, a thread too
few on a free machine at most the parallel speed-up. So it drops at the first contended window and
comes back only after `up_after_s` of windows that leave the extra thread a core (`floor(free + 0.2)`).
An idle engine samples too (each idle poll: one long window), so a neighbour that left while nothing
ran does not cost the next requests their thread.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from cobatch.runner.cpu_usage import CpuSample, others_busy_cores, read_cpu_sample, usable_cpus

logger = logging.getLogger(__name__)

_DOWN_SLACK = 0.5  # a thread is kept while others leave it at least half a core
_UP_SLACK = 0.2  # one is added back only when others leave it 80% of a core
_EPSILON_S = 1e-6  # clock readings a window apart are not cut off by float rounding


class ThreadPolicy:
    """Decides the thread count from the others' busy cores per window (pure: fed samples)."""

    def __init__(self, max_threads: int, num_cpus: int, window_s: float = 0.2, up_after_s: float = 1.0) -> None:
        assert max_threads >= 1 and num_cpus >= 1
        self.max_threads, self.num_cpus = max_threads, num_cpus
        self.window_s, self.up_after_s = window_s, up_after_s
        self.num_threads = max_threads
        self.others_cores = 0.0  # as of the last window
        self._start: CpuSample | None = None  # the open window's first sample
        self._free_since: float | None = None  # since when every window left room for more threads

    def is_due(self, now_s: float) -> bool:
        """Whether a sample now would close a window (the caller reads /proc only then)."""
        return self._start is None or now_s - self._start.time_s >= self.window_s - _EPSILON_S

    def observe(self, sample: CpuSample) -> int:
        """Take a sample; the thread count to run with from now on."""
        start, self._start = self._start, sample
        if start is None or sample.time_s - start.time_s < self.window_s - _EPSILON_S:
            if start is not None:
                self._start = start  # window still open: keep its first sample
            return self.num_threads
        self.others_cores = others_busy_cores(start, sample)
        free = self.num_cpus - self.others_cores
        fit = self._clamp(math.floor(free + _DOWN_SLACK))
        room = self._clamp(math.floor(free + _UP_SLACK))
        if fit < self.num_threads:
            self.num_threads, self._free_since = fit, None
        elif room > self.num_threads:
            self._free_since = self._free_since if self._free_since is not None else start.time_s
            if sample.time_s - self._free_since >= self.up_after_s - _EPSILON_S:
                self.num_threads, self._free_since = room, None
        else:
            self._free_since = None
        return self.num_threads

    def _clamp(self, threads: int) -> int:
        return max(1, min(self.max_threads, threads))


class ThreadGovernor:
    """Applies a ThreadPolicy before each step: samples the CPUs once a window, sets the threads on a change."""

    def __init__(self, policy: ThreadPolicy, cpus: set[int], set_threads: Callable[[int], None]) -> None:
        self.policy, self.cpus, self._set_threads = policy, cpus, set_threads
        self.num_threads: int | None = None  # as last applied (None: not yet, on the step's thread)

    @classmethod
    def for_this_process(cls, max_threads: int, set_threads: Callable[[int], None]) -> ThreadGovernor:
        """Up to `max_threads`, judged on the CPUs this process may run on."""
        cpus = usable_cpus()
        return cls(ThreadPolicy(max_threads, len(cpus)), cpus, set_threads)

    def before_step(self) -> int:
        """Call on the thread that runs the step (thread counts are per thread), before each step and
        once in a while when idle; the count it runs with."""
        threads = self.policy.num_threads
        if self.policy.is_due(time.monotonic()):
            sample = read_cpu_sample(self.cpus)
            threads = self.policy.observe(sample) if sample is not None else threads
        if threads != self.num_threads:
            if self.num_threads is not None:
                logger.info("compute threads %d -> %d (other processes kept %.1f of %d CPUs busy)",
                            self.num_threads, threads, self.policy.others_cores, self.policy.num_cpus)
            self._set_threads(threads)
            self.num_threads = threads
        return threads
