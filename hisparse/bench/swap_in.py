"""Swap-in throughput on this machine against the bandwidth of a plain memory copy.

A miss copies one token's K and V row of one layer from the host pool into the device pool, so at high
miss rates the swap-in is a scattered gather and the ceiling is the memory bandwidth: we compare the
fast CPU path's GB/s with a plain `copy_` of a large buffer measured in the same run. At low miss rates
the cost is the bookkeeping, so the table also gives the time per call.

Each call swaps in one layer for a batch: every request selects `top_k` positions from a context much
larger than its full hot buffer, exactly `miss rate x top_k` of them (in total over the batch) not in
the buffer. The host pool is larger than the caches and its rows are scattered, as in a real pool.

    python -m hisparse.bench.swap_in [--repeats 7] [--buffer 512] [--top-k 256] [--dtype float32,bfloat16]
                                     [--host-pages small] [--host-pages small,huge]

numba's threading layer is the one hisparse chose at import (torch's own OpenMP team, or TBB): to time another,
set it before the process starts, `NUMBA_THREADING_LAYER=tbb python -m hisparse.bench.swap_in`.

The host pool is allocated as the engine allocates it by default (`host_memory.host_empty`, plain pages;
`hisparse_config.host_pages`); `--host-pages small,huge` gives each kind its own pools and times their calls in
turn, row by row, and the table says how much of each pool the kernel actually backed with huge pages.

GB/s counts the bytes of the missed rows once (as the plain copy counts its buffer once); "miss rows/s"
is missed rows copied per second; us/call is the whole call of a swap-in bound once to its layer's tables
(`bound_swap_in`, as the engine binds each layer's), bookkeeping and the cpu path's value checks included.
The public `swap_in()` also checks its arguments' types and shapes and binds anew on every call: at batch
64, 0% misses, calls alternating, 470 against 360 us a call, 1540 against 1390 us at 100% misses.
At 100% misses the plain copy is timed again just before each row's calls, and "x copy" is the row's
GB/s over that copy's: on a shared machine the load drifts within a run, and one copy timed at the start
gave ratios from 0.41 to 0.56 for the same code. (Not a copy between calls: the copy leaves the caches
full of dirty lines, whose write-back the next call would pay.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

import numba
import torch

from hisparse.bench import MAX_REPEATS
from hisparse.cli_args import (
    OneLineParser,
    comma_list,
    float_in,
    int_in,
    one_of,
    positive_float,
    positive_int,
    run_main,
)
from hisparse.kernels.numba_threads import choose_threading_layer
from hisparse.kernels.swap_in import BACKENDS
from hisparse.memory.eviction import new_slot_tables, reset_row, resolve_policy
from hisparse.memory.host_memory import PAGE_KINDS, check_fits_in_memory, host_empty, huge_page_status
from hisparse.memory.swap_in import bound_swap_in

# The default model (SmolLM2-135M): 3 KV heads of dim 64; one row holds a token's K and V of one layer.
KV_HEADS, HEAD_DIM = 3, 64
ROW_VALUES = 2 * KV_HEADS * HEAD_DIM
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PROG = "python -m hisparse.bench.swap_in"


def row_bytes_of(dtype: torch.dtype) -> int:
    return ROW_VALUES * dtype.itemsize


def host_tokens_per_request(num_rows: int, dtype: torch.dtype, host_bytes: int) -> int:
    """Tokens of context each of `num_rows` requests gets in a host pool of `host_bytes`."""
    return host_bytes // row_bytes_of(dtype) // num_rows


def check_host_pool(num_rows: int, num_slots: int, dtype: torch.dtype, host_bytes: int) -> None:
    """ValueError unless the host pool gives each request at least twice its buffer (the selections need
    positions outside it)."""
    context = host_tokens_per_request(num_rows, dtype, host_bytes)
    if context < 2 * num_slots:
        raise ValueError(f"a {host_bytes / (1 << 20):g} MiB host pool holds {context} tokens per request at batch "
                         f"{num_rows}, too few for a buffer of {num_slots} (it needs {2 * num_slots})")


@dataclass
class Pools:
    """One layer's memory: a large scattered host pool and a device pool of full hot buffers."""

    host_kv: torch.Tensor
    device_kv: torch.Tensor
    host_rows: torch.Tensor
    device_rows: torch.Tensor
    slot_pos: torch.Tensor
    lru: torch.Tensor

    @property
    def row_bytes(self) -> int:
        return self.host_kv.shape[1] * self.host_kv.element_size()


def make_pools(num_rows: int, num_slots: int, dtype: torch.dtype, host_bytes: int, gen: torch.Generator,
               pages: str = "small") -> Pools:
    check_host_pool(num_rows, num_slots, dtype, host_bytes)
    host_size = host_bytes // row_bytes_of(dtype)
    context = host_size // num_rows
    host_kv = host_empty((host_size, ROW_VALUES), dtype, pages=pages)
    host_kv.fill_(0.5)  # touch every page before timing
    device_kv = torch.zeros(num_rows * num_slots, ROW_VALUES, dtype=dtype)
    host_rows = torch.randperm(host_size, generator=gen)[: num_rows * context].view(num_rows, context)
    device_rows = torch.arange(num_rows * num_slots).view(num_rows, num_slots)
    slot_pos, lru = new_slot_tables(num_rows, num_slots)
    for r in range(num_rows):
        reset_row(slot_pos, lru, r, range(num_slots))
    return Pools(host_kv, device_kv, host_rows, device_rows, slot_pos, lru)


def make_top_k(pools: Pools, batch: int, top_k: int, total_misses: int, gen: torch.Generator) -> torch.Tensor:
    """Selections with exactly `total_misses` positions outside the buffers, spread over the batch."""
    context = pools.host_rows.shape[1]
    out = torch.empty(batch, top_k, dtype=torch.int64)
    for b in range(batch):
        misses = total_misses // batch + (b < total_misses % batch)
        held = pools.slot_pos[b].long()
        outside = torch.ones(context, dtype=torch.bool)
        outside[held[held >= 0]] = False
        cold = outside.nonzero().squeeze(1)
        hits = held[torch.randperm(held.numel(), generator=gen)[: top_k - misses]]
        new = cold[torch.randperm(cold.numel(), generator=gen)[:misses]]
        out[b] = torch.cat((hits, new))[torch.randperm(top_k, generator=gen)]
    return out


def time_swap_in(pool_sets: list[Pools], backend: str, batch: int, top_k: int, total_misses: int, repeats: int,
                 gen: torch.Generator) -> list[float]:
    """Median seconds per call on each pool set. The sets' calls take turns, which goes first alternating,
    so that the load of a shared machine hits them alike; each call's selection is made from the state its
    set's last call left."""
    rows = torch.arange(batch)
    layers = [bound_swap_in(backend, resolve_policy("lru"), pools.slot_pos, pools.lru, pools.device_rows,
                            pools.host_rows, pools.host_kv, pools.device_kv) for pools in pool_sets]
    times: list[list[float]] = [[] for _ in pool_sets]
    for i in range(repeats + 1):
        turn = list(enumerate(pool_sets))
        for k, pools in turn if i % 2 else turn[::-1]:
            selection = make_top_k(pools, batch, top_k, total_misses, gen)
            start = time.perf_counter()
            res = layers[k](selection, rows)
            elapsed = time.perf_counter() - start
            assert int(res.misses.sum()) == total_misses
            if i:  # the first call compiles (numba) and warms the caches
                times[k].append(elapsed)
    return [statistics.median(t) for t in times]


class PlainCopy:
    """A plain `copy_` of a buffer larger than the caches: what this machine's memory moves, in GB/s."""

    def __init__(self, buffer_bytes: int) -> None:
        self.src = torch.empty(buffer_bytes, dtype=torch.uint8).fill_(1)
        self.dst = torch.empty_like(self.src).fill_(0)

    def gbps(self, repeats: int) -> float:
        """Median of `repeats` copies, after one untimed."""
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            self.dst.copy_(self.src)
            times.append(time.perf_counter() - start)
        return self.src.numel() / statistics.median(times[1:]) / 1e9


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int_in(1, MAX_REPEATS), default=7,
                        help=f"timed calls per figure (median; at most {MAX_REPEATS})")
    parser.add_argument("--buffer", type=positive_int, default=512, help="hot slots per request (S)")
    parser.add_argument("--top-k", type=positive_int, default=256, help="positions selected per request (K)")
    parser.add_argument("--dtype", type=comma_list(one_of(*DTYPES)), default="float32,bfloat16",
                        help="comma list of float32, bfloat16")
    parser.add_argument("--batches", type=comma_list(positive_int), default="1,16,64",
                        help="comma list of batch sizes")
    parser.add_argument("--miss-rates", type=comma_list(float_in(0.0, 1.0)), default="0.001,0.2,1.0",
                        help="comma list of miss fractions in [0, 1]")
    parser.add_argument("--host-gib", type=positive_float, default=1.0,
                        help="host pool size per dtype, GiB (at most the memory available)")
    parser.add_argument("--host-pages", type=comma_list(one_of(*PAGE_KINDS)), default="small",
                        help=f"comma list of {', '.join(PAGE_KINDS)}: host pool pages "
                             "(huge: 2 MiB where the kernel lends them)")
    parser.add_argument("--copy-mib", type=positive_int, default=256, help="plain-copy buffer, MiB")
    parser.add_argument("--backends", type=comma_list(one_of(*BACKENDS)), default="cpu,reference",
                        help=f"comma list of swap-in backends ({', '.join(BACKENDS)}; triton needs TRITON_INTERPRET=1 "
                             "here, on a GPU run hisparse.bench.swap_in_cuda)")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """What the flags get wrong together, as a ValueError, before any pool is allocated or call timed."""
    if args.top_k > args.buffer:
        raise ValueError("--top-k must not exceed --buffer")
    if "triton" in args.backends and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--backends triton on CPU tensors needs TRITON_INTERPRET=1; on a GPU run "
                         "python -m hisparse.bench.swap_in_cuda")
    host_bytes = int(args.host_gib * (1 << 30))
    for name in args.dtype:
        try:
            check_host_pool(max(args.batches), args.buffer, DTYPES[name], host_bytes)
        except ValueError as error:
            raise ValueError(f"--host-gib {args.host_gib:g}: {error} ({name} rows; raise --host-gib or lower "
                             "--batches or --buffer)") from None
    device_bytes = max(args.batches) * args.buffer * max(row_bytes_of(DTYPES[name]) for name in args.dtype)
    check_fits_in_memory(len(args.host_pages) * (host_bytes + device_bytes) + 2 * (args.copy_mib << 20),
                         f"{len(args.host_pages)} host pool(s) of {args.host_gib:g} GiB with their device pools and "
                         f"two copy buffers of {args.copy_mib} MiB")


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as error:
        parser.error(str(error))
    page_kinds, batches, rates, backends = args.host_pages, args.batches, args.miss_rates, args.backends
    gen = torch.Generator().manual_seed(0)

    copy = PlainCopy(args.copy_mib << 20)
    copy_gbps = copy.gbps(args.repeats)
    print(f"plain copy of {args.copy_mib} MiB (torch copy_): {copy_gbps:.2f} GB/s, "
          f"threads: torch {torch.get_num_threads()}, numba {numba.get_num_threads()} "
          f"(layer {choose_threading_layer()})")
    print(f"S={args.buffer} K={args.top_k} row={ROW_VALUES} values, host pool {args.host_gib:g} GiB, "
          f"median of {args.repeats}")
    for name in args.dtype:
        table_for(name, page_kinds, args, batches, rates, backends, copy, gen)


def table_for(name: str, page_kinds: list[str], args: argparse.Namespace, batches: list[int], rates: list[float],
              backends: list[str], copy: PlainCopy, gen: torch.Generator) -> None:
    """One dtype's table, a row per kind of host pages."""
    dtype = DTYPES[name]
    pool_sets = [make_pools(max(batches), args.buffer, dtype, int(args.host_gib * (1 << 30)), gen, pages)
                 for pages in page_kinds]
    print(f"{name} rows; host pool on 2 MiB pages: " + ", ".join(
        f"{huge_page_status(p.host_kv).huge_bytes / p.host_kv.nbytes:.0%} of the {pages}-page one"
        for pages, p in zip(page_kinds, pool_sets, strict=True)))
    print(f"{'backend':>9} {'dtype':>8} {'pages':>5} {'batch':>5} {'miss':>6} {'misses':>7} {'us/call':>9} "
          f"{'miss rows/s':>11} {'GB/s':>7} {'x copy':>6}")
    best_full: dict[tuple[str, str], tuple[float, int]] = {}  # (backend, pages): (x copy, batch)
    full_seconds: dict[tuple[str, int, str], float] = {}
    row_bytes = pool_sets[0].row_bytes
    for backend in backends:
        for batch in batches:
            for rate in rates:
                total_misses = round(rate * batch * args.top_k)
                copy_now = copy.gbps(3) if rate == 1.0 else None
                all_seconds = time_swap_in(pool_sets, backend, batch, args.top_k, total_misses, args.repeats, gen)
                for pages, seconds in zip(page_kinds, all_seconds, strict=True):
                    gbps = total_misses * row_bytes / seconds / 1e9
                    print(f"{backend:>9} {name:>8} {pages:>5} {batch:>5} {rate:>6.1%} {total_misses:>7} "
                          f"{seconds * 1e6:>9.0f} {total_misses / seconds:>11.3g} {gbps:>7.2f}"
                          + (f" {gbps / copy_now:>6.2f}" if copy_now else ""))
                    if copy_now:
                        full_seconds[backend, batch, pages] = seconds
                        if gbps / copy_now > best_full.get((backend, pages), (0.0, 0))[0]:
                            best_full[backend, pages] = (gbps / copy_now, batch)
    for (backend, pages), (ratio, batch) in best_full.items():
        print(f"{name}, {pages} pages: {backend} at 100% misses, best batch ({batch}): {ratio:.2f}x the plain copy's "
              f"GB/s (target 0.5)")
    if {"small", "huge"} <= set(page_kinds):
        for backend in backends:
            print(f"{name}: {backend} at 100% misses, time per call on huge / on small pages: " + ", ".join(
                f"batch {b} {full_seconds[backend, b, 'huge'] / full_seconds[backend, b, 'small']:.2f}"
                for b in batches if (backend, b, "huge") in full_seconds))


if __name__ == "__main__":
    sys.exit(run_main(main, prog=PROG))
