"""A rank's place in a group of ranks: how a model's dimensions split over them, and the collectives its layers
call. With one rank every collective is the identity, so the model code has one path.

Tensor parallel splits every layer over the ranks, which then all run the same tokens. A DSA model may instead run
its attention data-parallel (`dp_attention`: each rank its own requests, their whole latent cache and the whole
attention weights) and only its MLPs over the ranks: the MoE's experts split (`expert_parallel`) or each expert's
columns, the dense MLPs' columns, on every rank's tokens gathered (SGLang's --enable-dp-attention with
--dp-size equal to --tp-size, and --ep-size)."""

from __future__ import annotations

import logging
import os
import platform
import secrets
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from hisparse.distributed.communicator import ProcessGroupCommunicator, SharedMemoryCommunicator, shared_bytes

log = logging.getLogger("hisparse.distributed")
_shared_files: set[str] = set()  # created by this process and not yet unlinked


def free_loopback_port() -> int:
    """A 127.0.0.1 port that was free a moment ago (where one machine's ranks meet; the benchmarks' servers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def split_sizes(total: int, parts: int) -> list[int]:
    """`total` split over `parts` ranks as evenly as it goes, the first ranks taking one more: the default model's 3
    KV heads over 2 ranks are [2, 1], its 1536 MLP columns [768, 768]."""
    return [total // parts + (1 if r < total % parts else 0) for r in range(parts)]


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    dp_attention: bool = False  # each rank attends over its own requests' tokens (DSA models)
    expert_parallel: bool = False  # each rank holds its share of the MoE's experts, not of every expert's columns
    comm: SharedMemoryCommunicator | ProcessGroupCommunicator | None = field(default=None, repr=False)  # once joined

    def share(self, total: int) -> tuple[int, int]:
        """(start, length) of this rank's part of `total`."""
        sizes = split_sizes(total, self.size)
        return sum(sizes[:self.rank]), sizes[self.rank]

    def all_reduce(self, x):
        return x if self.size == 1 else self.comm.all_reduce(x)

    def gather_last_dim(self, x, total: int):
        """The ranks' [rows, width_r] side by side on rank 0 (None on the others): the split of `total` columns."""
        return x if self.size == 1 else self.comm.gather_last_dim(x, split_sizes(total, self.size))

    def all_gather_rows(self, x, counts: list[int]):
        """Every rank's rows (counts[r] of them) in rank order, on every rank."""
        return x if self.size == 1 else self.comm.all_gather_rows(x, counts)

    def broadcast_object(self, obj=None):
        return obj if self.size == 1 else self.comm.broadcast_object(obj)

    def all_gather_object(self, obj) -> list:
        return [obj] if self.size == 1 else self.comm.all_gather_object(obj)


def join_group(tp: TensorParallel, init_addr: str, same_machine: bool,
               timeout: timedelta = timedelta(minutes=5), cuda: bool = False) -> None:
    """Join the ranks' torch.distributed group (rendezvous at init_addr HOST:PORT, served by rank 0) and give `tp`
    its communicator. CUDA ranks (each on its own device, set before): NCCL. CPU ranks: gloo, and shared memory
    for the collectives when every rank is on this machine, it is x86 (the communicator relies on its store
    order) and /dev/shm has the room. The shared file is unlinked as soon as every rank has mapped it, and by
    `remove_shared_files` on the way out of a failed start."""
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{init_addr}", rank=tp.rank,
                            world_size=tp.size, timeout=timeout)
    if cuda:
        tp.comm = ProcessGroupCommunicator(tp.rank, tp.size, timeout)
        return
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    usable = same_machine and platform.machine() in ("x86_64", "AMD64", "i386", "i686")
    if usable and shutil.disk_usage(folder).free < 2 * shared_bytes(tp.size):
        log.warning("%s has less than %d MiB free: the ranks' collectives go through gloo", folder,
                    2 * shared_bytes(tp.size) >> 20)
        usable = False
    box = [usable]
    dist.broadcast_object_list(box, src=0)  # rank 0's view decides for all
    if not box[0]:
        tp.comm = ProcessGroupCommunicator(tp.rank, tp.size, timeout)
        return
    path = [os.path.join(folder, f"hisparse-tp-{os.getpid()}-{secrets.token_hex(4)}") if tp.rank == 0 else None]
    if tp.rank == 0:
        _shared_files.add(path[0])
        tp.comm = SharedMemoryCommunicator(path[0], tp.rank, tp.size, create=True)
    try:
        dist.broadcast_object_list(path, src=0)
        if tp.rank != 0:
            tp.comm = SharedMemoryCommunicator(path[0], tp.rank, tp.size, create=False)
        dist.barrier()
    finally:
        if tp.rank == 0:
            remove_shared_files()


def remove_shared_files() -> None:
    """Unlink the shared files this process made (mapped ranks keep their memory)."""
    while _shared_files:
        try:
            os.unlink(_shared_files.pop())
        except FileNotFoundError:
            pass


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
