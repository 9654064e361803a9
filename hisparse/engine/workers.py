"""The processes of a tensor-parallel engine: one per rank, each running a replica of the engine on its shard.

Every rank runs the same engine (scheduler, cache manager over its own KV heads, detokenizer) and is fed the
same commands in the same order, so every rank admits, schedules, evicts and finishes alike without being told
how; only rank 0 samples, and the tokens it draws reach the others in the step. Rank 0 (the process that made
the `LLMEngine`, the server's) starts the other ranks of its machine; another machine's are started by
`run_node` (`launch_server --node-rank N`). A rank's process ends with its engine: at rank 0's `close`, at
rank 0's death (the kernel kills it: PR_SET_PDEATHSIG), or at its own failure, which its launcher's watchdog
reports in one line naming the rank before it ends every rank of its machine.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time

WATCH_SECONDS = 0.5  # how often the watchdog looks at the ranks
STOPPED_AFTER_SECONDS = 1.0  # a rank stopped (SIGSTOP, state T) this long is hung
CLOSE_GRACE_SECONDS = 10.0  # how long `close` waits for the ranks to leave before it kills them


def free_init_addr() -> str:
    """127.0.0.1:PORT with a port that was free a moment ago: where one machine's ranks meet."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def cpu_shares(local_ranks: int) -> list[list[int]]:
    """The CPUs this process may run on, split over one machine's ranks (empty shares: more ranks than CPUs)."""
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // local_ranks
    return [cpus[r * share:(r + 1) * share] for r in range(local_ranks)]


def bind_cpus(cpus: list[int]) -> None:
    """Run this process (the calling thread and those it starts) on `cpus`, torch's and numba's parallel loops
    with as many threads: ranks on separate cores never spin against each other's OpenMP teams, and a team never
    has more threads than its cores (two spinning threads on one core made a batch-16 decode step 7x slower). No
    CPUs: one thread, no binding."""
    import numba
    import torch

    if cpus:
        os.sched_setaffinity(0, cpus)
    threads = max(1, len(cpus))
    torch.set_num_threads(threads)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))


class WorkerGroup:
    """One machine's worker ranks, as its launcher (rank 0's engine, or `run_node`) sees them: started, watched,
    ended. Each is `python -m hisparse.engine.workers`, given its config on stdin: a fresh interpreter that
    imports nothing of the launcher's program (multiprocessing's spawn would run the launcher's main module again).
    The watchdog thread turns any rank's death or stop into one line on stderr and the end of the process (an
    engine whose rank is gone can never step again: each step needs every rank)."""

    def __init__(self, config, ranks: list[int], cpus: list[list[int]]) -> None:
        """cpus: each rank's CPUs (`cpu_shares`)."""
        self.config = config
        self.ranks = ranks
        self.closing = threading.Event()
        self.processes = []
        for rank, share in zip(ranks, cpus, strict=True):
            # Its thread count, set before its torch starts its thread team.
            env = {**os.environ, "OMP_NUM_THREADS": str(max(1, len(share)))}
            process = subprocess.Popen([sys.executable, "-c", "from hisparse.engine.workers import main; main()"],
                                       stdin=subprocess.PIPE, env=env)
            process.stdin.write(pickle.dumps((config, rank, share, os.getpid())))
            process.stdin.close()
            self.processes.append(process)
        self.watchdog = threading.Thread(target=self._watch, name="hisparse-rank-watchdog", daemon=True)
        self.watchdog.start()
        atexit.register(self.kill)

    def _watch(self) -> None:
        """A rank that exits with status 0 was told to stop; any other end fails the group, and so does a rank
        stopped for a second (a rank stuck while running shows as a collective that times out: `communicator`)."""
        live = dict(zip(self.ranks, self.processes, strict=True))
        stopped_since: dict[int, float] = {}
        while live and not self.closing.wait(WATCH_SECONDS):
            now = time.monotonic()
            for rank, process in list(live.items()):
                code = process.poll()
                if code is not None:
                    if code != 0 and not self.closing.is_set():
                        self.fail(f"rank {rank} died (exit code {code})")
                    del live[rank]
                elif _state(process.pid) == "T":
                    if now - stopped_since.setdefault(rank, now) >= STOPPED_AFTER_SECONDS:
                        self.fail(f"rank {rank} hung (stopped for {now - stopped_since[rank]:.0f} s)")
                else:
                    stopped_since.pop(rank, None)

    def fail(self, reason: str) -> None:
        """The end of a group that lost a rank: one line, every rank of this machine killed, the process gone."""
        if self.closing.is_set():
            return
        self.closing.set()
        print(f"hisparse: {reason}; stopping every rank", file=sys.stderr, flush=True)
        self.kill()
        os._exit(1)

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        """After the ranks were told to stop: wait for them to leave, kill any that do not."""
        self.closing.set()
        deadline = time.monotonic() + CLOSE_GRACE_SECONDS
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        atexit.unregister(self.kill)

    def wait(self) -> int:
        """Until every rank has ended (`run_node`): 0 when each left cleanly."""
        codes = [process.wait() for process in self.processes]
        self.closing.set()
        return max(abs(code) for code in codes)


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel sends this process SIGKILL when its launcher dies, however it dies (and if it died
    before this call, the process leaves now)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


def _state(pid: int) -> str:
    """A process's state letter from /proc (R running, S sleeping, T stopped, ...); "" where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def main() -> None:
    """A worker rank's process: its config, rank, CPUs and launcher's pid come pickled on stdin."""
    worker_main(*pickle.loads(sys.stdin.buffer.read()))


def worker_main(config, rank: int, cpus: list[int], parent: int) -> None:
    """A worker rank: build this rank's engine (its shard), then follow rank 0's commands until told to stop."""
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    from hisparse.engine.llm_engine import LLMEngine

    bind_cpus(cpus)
    try:
        engine = LLMEngine(config, rank=rank)
    except Exception:  # already reported to rank 0, which refuses the start with it
        sys.exit(1)
    engine.follow()


def run_node(config) -> int:
    """Machine `config.node_rank` (> 0) of a multi-machine engine: its ranks, until rank 0 ends them. Returns the
    exit status."""
    first = config.node_rank * config.ranks_per_node
    group = WorkerGroup(config, list(range(first, first + config.ranks_per_node)), cpu_shares(config.ranks_per_node))
    return group.wait()

