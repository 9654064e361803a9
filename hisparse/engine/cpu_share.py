"""How many threads the engine's steps use on a CPU it shares with other processes.

An OpenMP team waits at the end of every parallel region for its slowest thread. Beside another busy process one
of our threads is regularly descheduled, and each of the thousands of small ops of a decode step waits for it: on
our 2 cores a c = 1 decode fell to 0.15x its quiet speed beside a process running torch matmuls on 2 threads,
with stretches of a second per token. One thread has no team to wait for. So every `interval` seconds this reads
how much CPU the rest of the machine used (the CPUs' busy time in /proc/stat less this process's own in
/proc/self/stat) and gives the engine the cores left over, at least one and at most its own count. Torch's team
and numba's loops (which run on it, or on TBB) follow.
"""

from __future__ import annotations

import math
import os
import time

import torch

from hisparse.engine.workers import set_threads

TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


def _cpu_busy_ticks(cpus: set[int]) -> int | None:
    """Busy ticks (all but idle and iowait) of these CPUs since boot, or None where /proc/stat cannot be read."""
    try:
        with open("/proc/stat") as stat:
            lines = [line.split() for line in stat if line.startswith("cpu") and line[3].isdigit()]
    except OSError:
        return None
    total = 0
    for fields in lines:
        if int(fields[0][3:]) in cpus:
            values = [int(v) for v in fields[1:]]
            total += sum(values) - values[3] - values[4]  # idle, iowait
    return total


def _own_ticks() -> int | None:
    """User and system ticks of every thread of this process."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))


class CpuShare:
    """Call `adjust()` before each step: it sets the thread count when the machine's load has changed."""

    def __init__(self, max_threads: int | None = None, interval: float = 1.0) -> None:
        self.cpus = os.sched_getaffinity(0)
        self.max_threads = max_threads or torch.get_num_threads()
        self.interval = interval
        self.threads = self.max_threads
        self._last = (time.monotonic(), _cpu_busy_ticks(self.cpus), _own_ticks())

    def threads_for(self, others: float) -> int:
        """The cores other processes leave: a core counts as taken once they use more than half of it."""
        return max(1, min(self.max_threads, math.floor(len(self.cpus) - others + 0.5)))

    def adjust(self) -> int:
        now = time.monotonic()
        then, busy_then, own_then = self._last
        if now - then < self.interval:
            return self.threads
        busy, own = _cpu_busy_ticks(self.cpus), _own_ticks()
        self._last = (now, busy, own)
        if None in (busy, own, busy_then, own_then):
            return self.threads
        others = max(0.0, (busy - busy_then) - (own - own_then)) / TICKS_PER_SECOND / (now - then)  # their cores
        threads = self.threads_for(others)
        if threads != self.threads:
            set_threads(threads)
            self.threads = threads
        return threads
