"""A rank's place in a tensor-parallel group: how a model's dimensions split over the ranks, and the collectives
its layers call. With one rank every collective is the identity, so the model code has one path."""

from __future__ import annotations

import os
import secrets
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from hisparse.distributed.communicator import GlooCommunicator, SharedMemoryCommunicator


def split_sizes(total: int, parts: int) -> list[int]:
    """`total` split over `parts` ranks as evenly as it goes, the first ranks taking one more: the default model's 3
    KV heads over 2 ranks are [2, 1], its 1536 MLP columns [768, 768]."""
    return [total // parts + (1 if r < total % parts else 0) for r in range(parts)]


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    comm: SharedMemoryCommunicator | GlooCommunicator | None = field(default=None, repr=False)  # set once joined

    def share(self, total: int, rank: int | None = None) -> tuple[int, int]:
        """(start, length) of a rank's part of `total` (this rank's by default)."""
        sizes = split_sizes(total, self.size)
        rank = self.rank if rank is None else rank
        return sum(sizes[:rank]), sizes[rank]

    def all_reduce(self, x):
        return x if self.size == 1 else self.comm.all_reduce(x)

    def gather_last_dim(self, x):
        """The ranks' [rows, width_r] side by side on rank 0 (None on the others)."""
        return x if self.size == 1 else self.comm.gather_last_dim(x)

    def broadcast_object(self, obj=None):
        return obj if self.size == 1 else self.comm.broadcast_object(obj)

    def all_gather_object(self, obj) -> list:
        return [obj] if self.size == 1 else self.comm.all_gather_object(obj)


def join_group(tp: TensorParallel, init_addr: str, same_machine: bool,
               timeout: timedelta = timedelta(minutes=5)) -> None:
    """Join the ranks' torch.distributed group (gloo, rendezvous at init_addr HOST:PORT, served by rank 0) and
    give `tp` its communicator: shared memory when every rank is on this machine, gloo otherwise. The shared
    file is unlinked as soon as every rank has mapped it, so no crash can leave it behind."""
    dist.init_process_group("gloo", init_method=f"tcp://{init_addr}", rank=tp.rank, world_size=tp.size,
                            timeout=timeout)
    if not same_machine:
        tp.comm = GlooCommunicator(tp.rank, tp.size)
        return
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    box = [os.path.join(folder, f"hisparse-tp-{os.getpid()}-{secrets.token_hex(4)}") if tp.rank == 0 else None]
    if tp.rank == 0:
        tp.comm = SharedMemoryCommunicator(box[0], tp.rank, tp.size, create=True)
    dist.broadcast_object_list(box, src=0)
    if tp.rank != 0:
        tp.comm = SharedMemoryCommunicator(box[0], tp.rank, tp.size, create=False)
    dist.barrier()
    if tp.rank == 0:
        os.unlink(box[0])


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
