"""The swap-in on a CUDA device: the Triton kernel checked against the reference, then timed against a
plain host -> device copy of the same bytes. The one script to run when a GPU is at hand.

    python -m hisparse.bench.swap_in_cuda [--policies lru,fifo,score_lru,lrfu] [--batches 1,16,64]
        [--miss-rates 0.001,0.2,1.0] [--repeats 20] [--host-gib 1] [--device cuda] [--out FILE.json]

Check: for each policy, several swap-ins of a batch run with the slot tables, the page table and the
device pool in device memory and the host pool in pinned host memory (the kernel reads it directly), and
the same steps run through the plain-Python reference on CPU copies of the same state; page tables,
misses, evictions, hits, slot tables, eviction order, the policy's state and the device rows must be identical.
Timing (lru, the default model's bfloat16 rows of 768 B): the kernel's median time per call over
--repeats calls (CUDA events), as GB/s of the missed rows, next to a plain `copy_` of a contiguous pinned
buffer of the same size to the device, timed just before each row of the table (as
`hisparse.bench.swap_in` does for the CPU path). `--device cpu` runs everything through the Triton
interpreter (TRITON_INTERPRET=1) at a small size: the tests use it; its times say nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch

from hisparse.bench import MAX_REPEATS
from hisparse.bench.swap_in import (
    ROW_VALUES,
    Pools,
    check_host_pool,
    host_tokens_per_request,
    make_pools,
    make_top_k,
)
from hisparse.cli_args import (
    OneLineParser,
    comma_list,
    device_flag,
    float_in,
    int_in,
    one_of,
    output_file,
    positive_float,
    run_main,
)
from hisparse.kernels.swap_in import TRITON_POLICIES
from hisparse.memory.eviction import get_policy
from hisparse.memory.host_memory import check_fits_in_memory
from hisparse.memory.swap_in import swap_in

CHECK_BUFFER, CHECK_TOP_K, CHECK_STEPS = 512, 256, 6
CHECK_HOST_BYTES = 64 << 20  # each check's host pool
# The largest batch whose check pool (batch + 1 requests) still holds twice a buffer per request.
MAX_CHECK_BATCH = host_tokens_per_request(1, torch.bfloat16, CHECK_HOST_BYTES) // (2 * CHECK_BUFFER) - 1
PROG = "python -m hisparse.bench.swap_in_cuda"


def to_device(pools: Pools, device: str) -> Pools:
    """A copy of the pools with everything but the host pool on `device`, the host pool pinned on a GPU."""
    on_gpu = torch.device(device).type == "cuda"
    host_kv = pools.host_kv.pin_memory() if on_gpu else pools.host_kv.clone()
    def copy(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, copy=True)

    return Pools(host_kv, copy(pools.device_kv), copy(pools.host_rows), copy(pools.device_rows),
                 copy(pools.slot_pos), copy(pools.lru))


def next_ranked_for(top_k: torch.Tensor, context: int, gen: torch.Generator) -> torch.Tensor:
    """Runners-up for a policy that reads them: random positions, some listed twice, a fifth -1."""
    ranked = torch.randint(0, context, (top_k.shape[0], 2 * top_k.shape[1]), generator=gen)
    return ranked.masked_fill(torch.rand(ranked.shape, generator=gen) < 0.2, -1)


def check_policy(name: str, device: str, batch: int, gen: torch.Generator) -> int:
    """Run CHECK_STEPS swap-ins on `device` (triton) and on the CPU (reference) from one state; raise on the
    first difference. Returns the misses seen (so a check that never missed is visible)."""
    reference = make_pools(batch + 1, CHECK_BUFFER, torch.bfloat16, CHECK_HOST_BYTES, gen)
    kernel = to_device(reference, device)
    want_policy = get_policy(name, num_rows=batch + 1, num_slots=CHECK_BUFFER)
    got_policy = get_policy(name, num_rows=batch + 1, num_slots=CHECK_BUFFER, device=device)
    rows = torch.randperm(batch + 1, generator=gen)[:batch]
    context = reference.host_rows.shape[1]
    misses = 0
    for step in range(CHECK_STEPS):
        top_k = make_top_k(reference, batch + 1, CHECK_TOP_K, round(0.3 * (batch + 1) * CHECK_TOP_K), gen)[rows]
        ranked = next_ranked_for(top_k, context, gen) if want_policy.num_next_ranks(CHECK_TOP_K) else None
        want = swap_in(top_k, rows, reference.slot_pos, reference.lru, reference.device_rows, reference.host_rows,
                       reference.host_kv, reference.device_kv, policy=want_policy, backend="reference",
                       next_ranked=ranked)
        got = swap_in(top_k.to(device), rows.to(device), kernel.slot_pos, kernel.lru, kernel.device_rows,
                      kernel.host_rows, kernel.host_kv, kernel.device_kv, policy=got_policy,
                      backend="triton", next_ranked=None if ranked is None else ranked.to(device))
        pairs = {"page_table": (want.page_table, got.page_table), "misses": (want.misses, got.misses),
                 "evictions": (want.evictions, got.evictions), "hits": (want.hits, got.hits),
                 "slot_pos": (reference.slot_pos, kernel.slot_pos),
                 "lru": (reference.lru, kernel.lru), "device_kv": (reference.device_kv, kernel.device_kv)}
        pairs.update({f"state {key}": (want_policy.state[key], got_policy.state[key]) for key in want_policy.state})
        for what, (a, b) in pairs.items():
            if not torch.equal(a, b.cpu()):
                raise AssertionError(f"{name}, batch {batch}, step {step}: triton and reference differ in {what}")
        misses += int(want.misses.sum())
    return misses


def timer(device: str) -> Callable[[Callable[[], object]], float]:
    """Seconds one call of a function takes on `device` (CUDA events on a GPU)."""
    if torch.device(device).type == "cuda":
        def timed(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return timed

    def timed_cpu(fn):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return timed_cpu


def time_rows(device: str, batches: list[int], rates: list[float], repeats: int, host_bytes: int,
              gen: torch.Generator) -> list[dict]:
    """Kernel time per call and GB/s at each batch and miss rate, with the plain copy of the same bytes."""
    timed = timer(device)
    base = make_pools(max(batches), CHECK_BUFFER, torch.bfloat16, host_bytes, gen)
    pools = to_device(base, device)
    policy = get_policy("lru")
    pinned = torch.device(device).type == "cuda"
    out = []
    for batch in batches:
        rows = torch.arange(batch, device=device)
        for rate in rates:
            total = round(rate * batch * CHECK_TOP_K)
            nbytes = max(total, 1) * pools.row_bytes
            src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
            copy = statistics.median(timed(partial(dst.copy_, src, non_blocking=True)) for _ in range(repeats))
            times = []
            for i in range(repeats + 1):
                base.slot_pos.copy_(pools.slot_pos.cpu())  # the selection is made from the state the kernel left
                selection = make_top_k(base, batch, CHECK_TOP_K, total, gen).to(device)
                seconds = timed(partial(swap_in, selection, rows, pools.slot_pos, pools.lru, pools.device_rows,
                                        pools.host_rows, pools.host_kv, pools.device_kv, policy=policy,
                                        backend="triton"))
                if i:  # the first call compiles the kernel
                    times.append(seconds)
            seconds = statistics.median(times)
            out.append({"batch": batch, "miss_rate": rate, "misses": total, "us_per_call": seconds * 1e6,
                        "gbps": total * pools.row_bytes / seconds / 1e9, "copy_gbps": nbytes / copy / 1e9})
    return out


def check_device(device: str) -> None:
    """ValueError unless the device can run the kernel here: a GPU there is, or the interpreter on cpu."""
    where = torch.device(device)
    if where.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("no CUDA device here (torch.cuda.is_available() is False); "
                             "--device cpu runs the check through the Triton interpreter")
        if where.index is not None and where.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--device cpu needs TRITON_INTERPRET=1 in the environment")


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", type=comma_list(one_of(*TRITON_POLICIES)), default=",".join(TRITON_POLICIES))
    parser.add_argument("--batches", type=comma_list(int_in(1, MAX_CHECK_BATCH)), default="1,16,64",
                        help=f"comma list of batch sizes, at most {MAX_CHECK_BATCH} (the check's 64 MiB host pool)")
    parser.add_argument("--miss-rates", type=comma_list(float_in(0.0, 1.0)), default="0.001,0.2,1.0",
                        help="comma list of miss fractions in [0, 1]")
    parser.add_argument("--repeats", type=int_in(1, MAX_REPEATS), default=20, help=f"at most {MAX_REPEATS}")
    parser.add_argument("--host-gib", type=positive_float, default=1.0, help="pinned host pool for the timing, GiB")
    parser.add_argument("--device", type=device_flag, default="cuda",
                        help="cuda (or cuda:N); cpu: the Triton interpreter")
    parser.add_argument("--out", type=output_file, default=None, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    device, policies, batches, rates = args.device, args.policies, args.batches, args.miss_rates
    host_bytes = int(args.host_gib * (1 << 30))
    try:
        check_device(device)
        check_fits_in_memory(2 * host_bytes, f"a host pool of {args.host_gib:g} GiB and its pinned copy")
        check_host_pool(max(batches), CHECK_BUFFER, torch.bfloat16, host_bytes)
    except ValueError as error:
        parser.error(str(error))
    gen = torch.Generator().manual_seed(0)
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu (Triton interpreter)"
    print(f"device: {name}; rows of {ROW_VALUES} bfloat16 values; S={CHECK_BUFFER}, K={CHECK_TOP_K}")
    report: dict = {"device": name, "check": {}, "timing": []}
    for policy in policies:
        for batch in batches:
            misses = check_policy(policy, device, batch, gen)
            report["check"][f"{policy} batch {batch}"] = misses
            print(f"check {policy:>9} batch {batch:>3}: triton = reference over {CHECK_STEPS} steps ({misses} misses)")
    rows = time_rows(device, batches, rates, args.repeats, host_bytes, gen)
    report["timing"] = rows
    print(f"{'batch':>5} {'miss':>6} {'misses':>7} {'us/call':>9} {'GB/s':>7} {'copy GB/s':>9} {'x copy':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['miss_rate']:>6.1%} {r['misses']:>7} {r['us_per_call']:>9.1f} {r['gbps']:>7.2f} "
              f"{r['copy_gbps']:>9.2f} {r['gbps'] / r['copy_gbps']:>6.2f}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(run_main(main, prog=PROG))
