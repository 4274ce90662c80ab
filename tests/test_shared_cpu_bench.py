"""benchmarks/shared_cpu.py's accounting: whose CPU a measurement saw (the neighbour is not background)."""

from __future__ import annotations

import os
import time

from benchmarks.shared_cpu import CpuMeter, busy_neighbour


def test_meter_gives_the_neighbours_cpu_to_it_not_to_the_background():
    with busy_neighbour(True) as pid:
        assert pid is not None
        meter = CpuMeter({"server": os.getpid(), "neighbour": pid})  # this process stands in for a server
        start = meter.read()
        time.sleep(1.0)
        cores = meter.cores(start, meter.read())
    # The spin loop gets some share however busy the shared machine is; what it takes is its own, so the
    # parts never add up to more cores than there are (the background is what is left).
    assert cores["neighbour"] > 0.05, cores
    assert cores["server"] < 0.2 and cores["client"] < 0.2, cores
    assert sum(cores.values()) <= len(os.sched_getaffinity(0)) + 0.2, cores
    assert set(cores) == {"server", "client", "neighbour", "background"}
