"""The collectives a tensor-parallel step needs, two ways: through shared memory between the CPU ranks of one
machine, and through torch.distributed's process group (gloo between machines, NCCL between GPUs).

A decode step all-reduces twice per layer (60 times for the default model), so the collective's latency is
the step's: gloo over loopback takes 1.2-1.5 ms per all-reduce of a [1..16, 576] tensor on our 2 cores, a
shared-memory one 25-29 us (2 processes, one core each; `python -m hisparse.bench.tensor_parallel` prints
both). That is why vLLM's and SGLang's CPU backends all-reduce through shared memory within a node, as
`SharedMemoryCommunicator` does; gloo stays for the rendezvous and for CPU ranks on different machines, NCCL for
CUDA ranks (`ProcessGroupCommunicator`).

Every rank ends an all-reduce with the same bits (the shared-memory one sums in rank order on every rank; gloo's
ring reduces each piece once and hands it out), so the indexer that runs on each rank selects the same top-k
everywhere.
"""

from __future__ import annotations

import math
import os
import pickle
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

SLOT_BYTES = 8 << 20  # one rank's share of one buffer: larger tensors go through in pieces
SPIN_BEFORE_YIELD = 2000  # polls of a flag before the waiting rank gives its core away between polls
SPIN_BEFORE_SLEEP = 0.05  # seconds of waiting before it sleeps between polls (an idle server's workers)
HUNG_AFTER_SECONDS = 30.0  # a rank that has not reached a collective the others wait in this long is hung


class RankFailure(RuntimeError):
    """A rank stopped taking part in the collectives: the group cannot go on."""


def shared_bytes(world_size: int) -> int:
    """The size of the shared file `SharedMemoryCommunicator` maps for `world_size` ranks."""
    return 2 * world_size * 8 + 2 * world_size * SLOT_BYTES


class SharedMemoryCommunicator:
    """Collectives over one shared file in /dev/shm: per rank a slot in each of two buffers, and two counters.

    Op `seq` uses buffer seq % 2. A rank writes its slot, then sets ready[rank] = seq; it finishes the op by
    setting done[rank] = seq. Before writing for op `seq` a rank waits until every rank is done with op seq - 2,
    the last one that used the same buffer, so a fast rank never overwrites what a slow one still reads. x86
    stores become visible in program order (TSO), so a rank that sees a counter also sees the data written
    before it; the counters are aligned 8-byte words, written whole.
    """

    def __init__(self, path: str, rank: int, world_size: int, create: bool) -> None:
        self.rank, self.world_size = rank, world_size
        self.path = path
        size = shared_bytes(world_size)
        if create:
            with open(path, "wb") as f:
                f.truncate(size)
        shared = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        counters = shared[:2 * world_size * 8].view(torch.int64).numpy()
        self.ready, self.done = counters[:world_size], counters[world_size:]
        self.slots = shared[2 * world_size * 8:].view(2, world_size, SLOT_BYTES)
        self.seq = 0

    def _begin(self) -> torch.Tensor:
        """The next op's buffer, once every rank is done with the op before last."""
        self.seq += 1
        self._wait(self.done, self.seq - 2)
        return self.slots[self.seq % 2]

    def _wait(self, counters: np.ndarray, value: int, ranks: slice = slice(None), idle: bool = False) -> None:
        """Until every counter of `ranks` reaches `value`. RankFailure names the ranks that have not after
        HUNG_AFTER_SECONDS, unless `idle` (a worker waiting for rank 0's next command waits as long as it takes)."""
        spins, start = 0, None
        while counters[ranks].min() < value:
            spins += 1
            if spins > SPIN_BEFORE_YIELD:
                start = start or time.perf_counter()
                waited = time.perf_counter() - start
                if waited > SPIN_BEFORE_SLEEP:
                    time.sleep(0.0005)
                    if waited > HUNG_AFTER_SECONDS and not idle:
                        late = [r for r, c in enumerate(counters) if c < value]
                        raise RankFailure(f"rank {', '.join(map(str, late))} has not answered for {waited:.0f} s")
                else:
                    os.sched_yield()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks in rank order, in place (x must be contiguous)."""
        flat = x.view(-1)
        step = SLOT_BYTES // x.element_size()
        for start in range(0, flat.numel(), step):
            piece = flat[start:start + step]
            buffer = self._begin()[:, :piece.numel() * x.element_size()].view(x.dtype)
            buffer[self.rank].copy_(piece)
            self.ready[self.rank] = self.seq
            self._wait(self.ready, self.seq)
            piece.copy_(buffer[0])
            for r in range(1, self.world_size):
                piece.add_(buffer[r])
            self.done[self.rank] = self.seq
        return x

    def gather_last_dim(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Rank 0 gets the ranks' x [rows, widths[r]] side by side, [rows, sum of widths]; the others get None.
        Widths may differ (a vocabulary that does not split evenly)."""
        x = x.contiguous()
        size = x.element_size()
        step = max(1, SLOT_BYTES // (max(widths) * size))
        parts: list[list[torch.Tensor]] = [[] for _ in widths]
        for start in range(0, x.shape[0], step):
            piece = x[start:start + step]
            rows = piece.shape[0]
            buffer = self._begin()
            buffer[self.rank, :piece.numel() * size].view(x.dtype).copy_(piece.reshape(-1))
            self.ready[self.rank] = self.seq
            if self.rank == 0:
                self._wait(self.ready, self.seq)
                for r, width in enumerate(widths):
                    parts[r].append(buffer[r, :rows * width * size].view(x.dtype).view(rows, width).clone())
            self.done[self.rank] = self.seq
        if self.rank != 0:
            return None
        return torch.cat([torch.cat(p) if p else x.new_empty(0, w) for p, w in zip(parts, widths, strict=True)], -1)

    def all_gather_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's rows x [counts[r], ...] one after the other, in rank order, on every rank (DP attention:
        each rank's tokens, gathered for the layers that see every rank's tokens)."""
        x = x.contiguous()
        width = math.prod(x.shape[1:])
        size = x.element_size()
        step = max(1, SLOT_BYTES // max(1, width * size))
        out = x.new_empty(sum(counts), *x.shape[1:])
        flat = out.view(out.shape[0], -1)
        offsets = [sum(counts[:r]) for r in range(self.world_size)]
        for start in range(0, max(counts), step):
            piece = x[start:start + step].reshape(-1)
            buffer = self._begin()
            buffer[self.rank, :piece.numel() * size].view(x.dtype).copy_(piece)
            self.ready[self.rank] = self.seq
            self._wait(self.ready, self.seq)
            for r, count in enumerate(counts):
                rows = max(0, min(step, count - start))
                if rows:
                    flat[offsets[r] + start:offsets[r] + start + rows] = \
                        buffer[r, :rows * width * size].view(x.dtype).view(rows, width)
            self.done[self.rank] = self.seq
        return out

    def broadcast_object(self, obj=None):
        """Rank 0's obj on every rank (pickled; the others pass nothing)."""
        payload = pickle.dumps(obj) if self.rank == 0 else b""
        total, sent, received = len(payload), 0, bytearray()
        while True:
            buffer = self._begin()
            if self.rank == 0:
                chunk = payload[sent:sent + SLOT_BYTES - 8]
                buffer[0, :8].numpy()[:] = np.frombuffer(total.to_bytes(8, "little"), np.uint8)
                buffer[0, 8:8 + len(chunk)].numpy()[:] = np.frombuffer(chunk, np.uint8)
                self.ready[0] = self.seq
                sent += len(chunk)
                done = sent >= total
            else:
                self._wait(self.ready, self.seq, slice(0, 1), idle=True)
                total = int.from_bytes(bytes(buffer[0, :8].numpy()), "little")
                n = min(total - len(received), SLOT_BYTES - 8)
                received += bytes(buffer[0, 8:8 + n].numpy())
                done = len(received) >= total
            self.done[self.rank] = self.seq
            if done:
                return obj if self.rank == 0 else pickle.loads(bytes(received))

    def all_gather_object(self, obj) -> list:
        """Every rank's obj, in rank order, on every rank (small objects: one slot each)."""
        payload = pickle.dumps(obj)
        if len(payload) + 8 > SLOT_BYTES:
            raise ValueError(f"all_gather_object takes objects under {SLOT_BYTES} bytes pickled")
        buffer = self._begin()
        buffer[self.rank, :8].numpy()[:] = np.frombuffer(len(payload).to_bytes(8, "little"), np.uint8)
        buffer[self.rank, 8:8 + len(payload)].numpy()[:] = np.frombuffer(payload, np.uint8)
        self.ready[self.rank] = self.seq
        self._wait(self.ready, self.seq)
        out = []
        for r in range(self.world_size):
            n = int.from_bytes(bytes(buffer[r, :8].numpy()), "little")
            out.append(pickle.loads(bytes(buffer[r, 8:8 + n].numpy())))
        self.done[self.rank] = self.seq
        return out


class ProcessGroupCommunicator:
    """The same collectives through torch.distributed's process group: gloo for CPU ranks that do not share a
    machine, NCCL for CUDA ranks (tensors stay on their devices). Objects always go through a gloo group."""

    def __init__(self, rank: int, world_size: int, timeout: timedelta,
                 idle_timeout: timedelta = timedelta(days=365)) -> None:
        self.rank, self.world_size = rank, world_size
        # Workers wait for rank 0's next command in a broadcast for as long as the server is idle; the step's
        # other objects keep the group's timeout, which ends a step that a hung rank never joins.
        self.commands = dist.new_group(backend="gloo", timeout=idle_timeout)
        self.objects = dist.new_group(backend="gloo", timeout=timeout)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def gather_last_dim(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        padded = x.new_zeros(x.shape[0], max(widths))
        padded[:, :x.shape[-1]] = x
        parts = [torch.empty_like(padded) for _ in widths] if self.rank == 0 else None
        dist.gather(padded, parts, dst=0)
        if self.rank != 0:
            return None
        return torch.cat([p[:, :w] for p, w in zip(parts, widths, strict=True)], -1)

    def all_gather_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        padded = x.new_zeros(max(counts), *x.shape[1:])
        padded[:x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded)
        return torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)])

    def broadcast_object(self, obj=None):
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.commands)
        return box[0]

    def all_gather_object(self, obj) -> list:
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.objects)
        return out
