"""The prefill side's sending thread: copies stretches of a request's prompt rows into a decode instance's pools
while the engine goes on computing the next chunk.

A job is one request's positions [start, end) of every pool; the thread turns it into the transfer engine's
writes (`row_transfer.plan_writes`) and reports each job's outcome to a callback, in order per room.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hisparse.disaggregation.row_transfer import PoolSpec, plan_writes
from hisparse.disaggregation.transfer_engine import KVTransferEngine, TransferError

log = logging.getLogger("hisparse.disaggregation")


@dataclass(frozen=True)
class SendJob:
    room: int
    session_id: str  # the decode instance's transfer engine
    sources: list[PoolSpec]
    source_rows: np.ndarray  # [n, pools]: this side's rows of the job's positions
    destinations: list[PoolSpec]
    destination_rows: np.ndarray  # [n, pools]: the decode side's rows of the same positions
    end: int  # the position after the job's last


@dataclass(frozen=True)
class SendResult:
    job: SendJob
    error: str | None  # None: the decode side's memory holds the rows
    seconds: float
    nbytes: int


class KVSender:
    def __init__(self, transfer: KVTransferEngine, on_done: Callable[[SendResult], None]) -> None:
        self.transfer = transfer
        self.on_done = on_done
        self._jobs: queue.Queue[SendJob | None] = queue.Queue()
        self.dropped: set[int] = set()  # rooms that failed: their queued jobs are not written (any thread)
        self._thread = threading.Thread(target=self._run, name="hisparse-kv-sender", daemon=True)
        self._thread.start()

    def send(self, job: SendJob) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            start = time.perf_counter()
            nbytes, error = 0, None
            if job.room in self.dropped:
                self.on_done(SendResult(job, "the room has failed", 0.0, 0))
                continue
            try:
                plans = [plan_writes(src, job.source_rows[:, i], dst, job.destination_rows[:, i])
                         for i, (src, dst) in enumerate(zip(job.sources, job.destinations, strict=True))]
                sources, destinations, lengths = (np.concatenate(parts).tolist() for parts in zip(*plans, strict=True))
                nbytes = sum(lengths)
                self.transfer.write(job.session_id, sources, destinations, lengths)
            except (TransferError, ValueError) as failure:
                error = str(failure)
            except Exception as failure:  # a bug must fail the room, not end the thread
                log.exception("sending room %d failed", job.room)
                error = f"internal error: {type(failure).__name__}: {failure}"
            try:
                self.on_done(SendResult(job, error, time.perf_counter() - start, nbytes))
            except Exception:
                log.exception("reporting room %d's transfer failed", job.room)
