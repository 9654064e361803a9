"""Swap-in: bring one decode step's top-k selected tokens of one layer into the hot buffer.

One call handles one layer for the whole decode batch. Per request it classifies the selected
positions as hits (already in a hot slot) or misses, lets the eviction policy pick a victim slot for
each miss among the slots not selected this step, updates the slot table and the eviction order in
place, copies each missed row host -> device, and returns the page table that sparse attention reads.
A policy that reads the indexer's next-ranked positions (`score_lru`, `lrfu`) gets them as
`next_ranked`; they are never loaded.

Three implementations share one signature: `swap_in_reference` (plain Python/PyTorch over the policy's
Python rule, the definition), `kernels.swap_in_cpu` (numba, parallel over requests and over misses) and
`kernels.swap_in_triton` (one program per request, for CUDA; runs on CPU tensors under
TRITON_INTERPRET=1). The kernels see a policy only as its `kernel_view()`. Arguments are checked here,
once, so the implementations may assume them valid.
"""

from __future__ import annotations

import torch

from hisparse.kernels.swap_in import (
    BoundSwapIn,
    SwapInResult,
    check_swap_in_args,
    check_swap_in_values,
    resolve_backend,
)
from hisparse.memory.eviction import EvictionPolicy, resolve_policy
from hisparse.memory.swap_in_reference import swap_in_reference


def swap_in(top_k: torch.Tensor, rows: torch.Tensor, slot_pos: torch.Tensor, lru: torch.Tensor,
            device_rows: torch.Tensor, host_rows: torch.Tensor, host_kv: torch.Tensor,
            device_kv: torch.Tensor, *, policy: str | EvictionPolicy = "lru", backend: str = "auto",
            next_ranked: torch.Tensor | None = None) -> SwapInResult:
    """Swap in one layer's selected tokens for the whole batch; see the module docstring.

    top_k [B, K] int64 (-1 padding), rows [B] int64, slot_pos [R, S] int32 and lru [R, S] int32
    (updated in place), device_rows [R, S] int64, host_rows [R, C] int64, host_kv [H, W], device_kv
    [D, W] (written in place). `policy` is a name ("lru", "fifo") or a policy object (needed for
    stateful ones: `get_policy("clock", num_rows=R, num_slots=S)`, one per layer). `backend`:
    "reference", "cpu", "triton", or "auto" (triton on CUDA tensors when it supports the policy, the
    reference otherwise; cpu on CPU tensors). `next_ranked` [B, M] int64 (-1 padding): the positions the
    indexer ranked just below each request's top_k, the best first (None: no ranks, M = 0).
    """
    policy = resolve_policy(policy)
    if next_ranked is None:
        next_ranked = torch.empty((top_k.shape[0], 0), dtype=torch.int64, device=top_k.device)
    check_swap_in_args(top_k, rows, slot_pos, lru, device_rows, host_rows, host_kv, device_kv, next_ranked)
    name = resolve_backend(backend, policy.name, top_k.device)
    if name != "cpu":  # the cpu path checks values inside its kernel: a few torch ops cost more
        check_swap_in_values(top_k, rows, slot_pos.shape, host_rows.shape[1], next_ranked)
    tensors = (slot_pos, lru, device_rows, host_rows, host_kv, device_kv)
    if name == "reference":
        return swap_in_reference(top_k, rows, *tensors, policy=policy, next_ranked=next_ranked)
    if name == "cpu":
        from hisparse.kernels.swap_in_cpu import swap_in_cpu

        return swap_in_cpu(top_k, rows, *tensors, policy=policy.kernel_view(), next_ranked=next_ranked)
    from hisparse.kernels.swap_in_triton import swap_in_triton

    return swap_in_triton(top_k, rows, *tensors, policy=policy.kernel_view(), next_ranked=next_ranked)


def bound_swap_in(backend: str, policy: EvictionPolicy, slot_pos: torch.Tensor, lru: torch.Tensor,
                  device_rows: torch.Tensor, host_rows: torch.Tensor, host_kv: torch.Tensor,
                  device_kv: torch.Tensor, totals: torch.Tensor | None = None) -> BoundSwapIn:
    """One layer's swap-in with its tables, pools, policy and counters bound; see `BoundSwapIn`. `totals`:
    int64 [3] on the tables' device, where `page_table` adds each step's (hits, misses, evictions) (None: a
    tensor of its own, for a caller that does not count).

    For a caller that builds every argument itself and calls each layer's swap-in every decode step (the
    HiSparse pools): `swap_in`'s per-call checks of types, shapes and devices were a quarter of a call at
    batch 1, and the cpu backend makes its numpy views of the bound tensors once (a third of its Python
    time at batch 8)."""
    name = resolve_backend(backend, policy.name, slot_pos.device)
    tensors = (slot_pos, lru, device_rows, host_rows, host_kv, device_kv)
    if name == "cpu":
        from hisparse.kernels.swap_in_cpu import BoundCpuSwapIn

        return BoundCpuSwapIn(*tensors, policy.kernel_view(), totals)
    if name == "reference":
        return BoundSwapIn(swap_in_reference, policy, *tensors, totals)
    from hisparse.kernels.swap_in_triton import swap_in_triton

    return BoundSwapIn(swap_in_triton, policy.kernel_view(), *tensors, totals)
