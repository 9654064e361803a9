"""CpuShare: the engine steps on the cores other processes leave, read from /proc, at least one thread."""

from __future__ import annotations

import numba
import pytest
import torch

from hisparse.engine import cpu_share
from hisparse.engine.cpu_share import TICKS_PER_SECOND, CpuShare


@pytest.fixture
def machine(monkeypatch):
    """A fake clock and fake tick counters: machine['busy'] (every CPU's) and machine['own'] (this process's)."""
    state = {"now": 100.0, "busy": 0, "own": 0}
    monkeypatch.setattr(cpu_share.time, "monotonic", lambda: state["now"])
    monkeypatch.setattr(cpu_share, "_cpu_busy_ticks", lambda cpus: state["busy"])
    monkeypatch.setattr(cpu_share, "_own_ticks", lambda: state["own"])
    monkeypatch.setattr(cpu_share.os, "sched_getaffinity", lambda pid: {0, 1})
    saved = torch.get_num_threads(), numba.get_num_threads()
    yield state
    torch.set_num_threads(saved[0])
    numba.set_num_threads(saved[1])


def run_for(state, seconds, ours, others):
    """`seconds` pass with this process using `ours` cores and the rest of the machine `others`."""
    state["now"] += seconds
    state["own"] += int(ours * seconds * TICKS_PER_SECOND)
    state["busy"] += int((ours + others) * seconds * TICKS_PER_SECOND)


def test_a_busy_neighbour_takes_a_thread_and_gives_it_back(machine):
    share = CpuShare(max_threads=2, interval=1.0)
    run_for(machine, 1.0, ours=2.0, others=0.1)
    assert share.adjust() == 2
    run_for(machine, 1.0, ours=1.0, others=1.0)  # a neighbour on one core
    assert share.adjust() == 1 and torch.get_num_threads() == 1 and numba.get_num_threads() == 1
    run_for(machine, 0.5, ours=1.0, others=0.0)  # within the interval: nothing is read
    assert share.adjust() == 1
    run_for(machine, 1.0, ours=1.0, others=0.0)
    assert share.adjust() == 2 and torch.get_num_threads() == 2


def test_thread_counts_follow_the_cores_left():
    share = CpuShare(max_threads=2)
    share.cpus = {0, 1}
    assert [share.threads_for(others) for others in (0.0, 0.4, 0.6, 1.0, 1.9, 3.0)] == [2, 2, 1, 1, 1, 1]


def test_unreadable_proc_keeps_the_count(machine, monkeypatch):
    share = CpuShare(max_threads=2, interval=1.0)
    monkeypatch.setattr(cpu_share, "_own_ticks", lambda: None)
    run_for(machine, 2.0, ours=1.0, others=1.5)
    assert share.adjust() == 2


def test_the_real_counters_read():
    assert cpu_share._cpu_busy_ticks({0}) is not None and cpu_share._own_ticks() > 0
