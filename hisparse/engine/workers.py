"""The processes of a tensor-parallel engine: one per rank, each running a replica of the engine on its shard.

Every rank runs the same engine (scheduler, cache manager over its own KV heads, detokenizer) and is fed the
same commands in the same order, so every rank admits, schedules, evicts and finishes alike without being told
how; only rank 0 samples, and the tokens it draws reach the others in the step. Rank 0 (the process that made
the `LLMEngine`, the server's) starts the other ranks of its machine; another machine's are started by
`run_node` (`launch_server --node-rank N`). A rank's process ends with its engine: at rank 0's `close`, when its
launcher's process ends however it ends (the rank reads the end of its stdin pipe, which only the launcher's
process holds open), or at its own failure, which its launcher's watchdog reports in one line naming the rank
before it ends every rank of its machine. Signals are the launcher's to handle: a rank ignores SIGINT and
SIGTERM sent to the whole process group, so the server's graceful shutdown decides when the ranks stop.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

from hisparse.distributed.tensor_parallel import free_loopback_port, remove_shared_files

WATCH_SECONDS = 0.5  # how often the watchdog looks at the ranks
STOPPED_AFTER_SECONDS = 1.0  # a rank stopped (SIGSTOP, state T) this long is hung
CLOSE_GRACE_SECONDS = 10.0  # how long `close` waits for the ranks to leave before it kills them


def free_init_addr() -> str:
    """127.0.0.1:PORT with a port that was free a moment ago: where one machine's ranks meet."""
    return f"127.0.0.1:{free_loopback_port()}"


def cpu_shares(local_ranks: int) -> list[list[int]]:
    """The CPUs this process may run on, split over one machine's ranks (empty shares: more ranks than CPUs)."""
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // local_ranks
    return [cpus[r * share:(r + 1) * share] for r in range(local_ranks)]


def bind_cpus(cpus: list[int]) -> None:
    """Run the calling thread (and the threads it starts) on `cpus`, its torch and numba parallel loops with as
    many threads (numba's count is the calling thread's own): ranks on separate cores never spin against each
    other's OpenMP teams, and a team never has more threads than its cores (two spinning threads on one core
    made a batch-16 decode step 7x slower). No CPUs: one thread, no binding."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    set_threads(max(1, len(cpus)))


def set_threads(threads: int) -> None:
    """torch's parallel loops and numba's (the calling thread's count, at most numba's pool) on `threads`."""
    import numba
    import torch

    torch.set_num_threads(threads)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))


class WorkerGroup:
    """One machine's worker ranks, as its launcher (rank 0's engine, or `run_node`) sees them: started, watched,
    ended. Each is a fresh interpreter running `workers.main`, given its config on stdin, that imports nothing of
    the launcher's program (multiprocessing's spawn would run the launcher's main module again).
    The watchdog thread turns any rank's death or stop into one line on stderr and the end of the process (an
    engine whose rank is gone can never step again: each step needs every rank)."""

    def __init__(self, config, ranks: list[int], cpus: list[list[int]]) -> None:
        """cpus: each rank's CPUs (`cpu_shares`)."""
        self.config = config
        self.ranks = ranks
        self.closing = threading.Event()
        self.processes = []
        try:
            for rank, share in zip(ranks, cpus, strict=True):
                # Its thread count, set before its torch starts its thread team.
                env = {**os.environ, "OMP_NUM_THREADS": str(max(1, len(share)))}
                process = subprocess.Popen([sys.executable, "-c", "from hisparse.engine.workers import main; main()"],
                                           stdin=subprocess.PIPE, env=env)
                self.processes.append(process)
                process.stdin.write(pickle.dumps((config, rank, share)))
                process.stdin.flush()  # left open: its end tells the rank that this process is gone
        except BaseException:
            self.kill()
            raise
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
        print(f"hisparse: {reason}; stopping every rank", file=sys.stderr, flush=True)
        self.kill()
        remove_shared_files()
        os._exit(1)

    def kill(self) -> None:
        self.closing.set()  # what ends now is not a failure to report
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            if process.stdin is not None and not process.stdin.closed:
                process.stdin.close()

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


def _end_with_launcher(fd: int) -> None:
    """The launcher's end of the stdin pipe closes only when its process ends (or when it has ended this rank):
    then this rank ends too, whatever it was doing. Read from the file descriptor itself: a thread blocked in
    the buffered reader would hold its lock when the interpreter shuts down, which aborts the process."""
    while os.read(fd, 4096):
        pass
    os._exit(1)


def _state(pid: int) -> str:
    """A process's state letter from /proc (R running, S sleeping, T stopped, ...); "" where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def main() -> None:
    """A worker rank's process: its config, rank and CPUs come pickled on stdin, which stays open."""
    config, rank, cpus = pickle.load(sys.stdin.buffer)
    threading.Thread(target=_end_with_launcher, args=(sys.stdin.fileno(),), daemon=True).start()
    worker_main(config, rank, cpus)


def worker_main(config, rank: int, cpus: list[int]) -> None:
    """A worker rank: build this rank's engine (its shard), then follow rank 0's commands until told to stop."""
    for signum in (signal.SIGINT, signal.SIGTERM):  # sent to the whole process group: the launcher decides
        signal.signal(signum, signal.SIG_IGN)
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
    group = WorkerGroup(config, list(config.node_ranks), cpu_shares(config.ranks_per_node))
    return group.wait()

