"""Host pool memory, on plain pages or on 2 MiB pages where the kernel lends them.

The swap-in reads a few hundred scattered rows per request per layer out of a host pool of gigabytes.
On 4 KiB pages almost every such row is a TLB miss, and on a virtual machine each miss walks two page
tables (the guest's and the host's). Transparent huge pages cut the walks: Linux backs a mapping with
2 MiB pages when asked (`madvise(MADV_HUGEPAGE)`; most distributions ship THP in this "madvise" mode).
But in that mode the kernel also compacts memory, in the faulting thread, to find each huge page a
fresh row lands on: once a machine has run for hours, first touch then cost 2 s per GiB on our 2-core VM
against 0.19 s on plain pages, and a 1536-token prompt's host writes 90 ms, a sixth of its prefill. The
swap-in gain is small where it runs, at the hot buffer's usual miss rate:
`python -m hisparse.bench.swap_in --backends cpu --host-pages small,huge --dtype bfloat16` gave a call on
huge pages 0.98x the time on small ones at batch 16 and 20% misses (0.76x at 100%). So the pools take
plain pages unless `hisparse_config.host_pages` asks for huge ones.

The pool is never zeroed by us: the kernel hands out zero pages on first touch, as it does for
`torch.empty` of this size. A pool for CUDA stays page-locked `torch.empty(pin_memory=True)`, which the
GPU reads directly.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

GIB = 1 << 30
HUGE_PAGE_BYTES = 2 << 20
PAGE_KINDS = ("huge", "small")


def available_host_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits_in_memory(needed: int, what: str) -> None:
    """ValueError when `needed` bytes exceed the memory the kernel says is available: found before the work,
    not as a MemoryError (or the OOM killer) in the middle of it."""
    available = available_host_memory()
    if available is not None and needed > available:
        raise ValueError(f"{what} need about {needed / GIB:.3g} GiB, more than the "
                         f"{available / GIB:.3g} GiB of memory available")


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, *, pin: bool = False, pages: str = "small") -> torch.Tensor:
    """An uninitialised host tensor; `pages="small"` is plain `torch.empty`: it asks for nothing (its memory
    may still land in a region another library advised); `pages="huge"` asks for 2 MiB pages (plain pages
    where refused)."""
    if pages not in PAGE_KINDS:
        raise ValueError(f"pages must be one of {', '.join(PAGE_KINDS)}, not {pages!r}")
    nbytes = math.prod(shape) * dtype.itemsize
    if pin or pages == "small" or nbytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype, pin_memory=pin)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP disabled ("never") or not built in: the mapping keeps small pages
        pass
    # frombuffer holds a reference to the mapping, which is unmapped when the last tensor view goes.
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)


@dataclass
class HugePageStatus:
    advised: bool  # every mapping under the tensor carries MADV_HUGEPAGE ("hg" in its VmFlags)
    huge_bytes: int  # bytes of those mappings the kernel backs with huge pages now


def huge_page_status(t: torch.Tensor) -> HugePageStatus:
    """What Linux says of the pages under `t` (/proc/self/smaps); (False, 0) where it cannot say.

    Whether the kernel backs an advised mapping with huge pages depends on its THP settings and on free
    contiguous memory, so a caller reports `huge_bytes` rather than assume it. A mapping merged with a
    neighbour counts whole, hence the cap at the tensor's size."""
    start = t.data_ptr()
    nbytes = t.numel() * t.element_size()
    end = start + nbytes
    advised, seen, total = True, False, 0
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(maxsplit=1)[0]
                if not head.endswith(":"):  # "lo-hi perms ...": a new mapping
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo < end and hi > start
                    seen |= inside
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
                elif inside and head == "VmFlags:":
                    advised &= "hg" in line.split()[1:]
    except OSError:
        return HugePageStatus(False, 0)
    return HugePageStatus(advised and seen, min(total, nbytes))
