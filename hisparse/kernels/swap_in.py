"""Swap-in: bring one decode step's top-k selected tokens of one layer into the hot buffer.

One call handles one layer for the whole decode batch. Per request it classifies the selected
positions as hits (already in a hot slot) or misses, lets the eviction policy pick a victim slot for
each miss among the slots not selected this step, updates the slot table and the eviction order in
place, copies each missed row host -> device, and returns the page table that sparse attention reads.

Three implementations share the signature below: `swap_in_reference` (plain Python/PyTorch, the
definition), `swap_in_cpu` (numba, parallel over requests and over misses) and `swap_in_triton` (one
program per request, for CUDA; runs on CPU tensors under TRITON_INTERPRET=1). Arguments are checked
here, once, so the implementations may assume them valid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hisparse.memory.eviction import EvictionPolicy, resolve_policy

BACKENDS = ("reference", "cpu", "triton", "auto")
TRITON_POLICIES = ("lru", "fifo")


@dataclass
class SwapInResult:
    page_table: torch.Tensor  # int64 [B, K]: device row of each selected position, -1 where top_k is -1
    misses: torch.Tensor  # int32 [B]: positions that were not in the hot buffer and were copied in
    evictions: torch.Tensor  # int32 [B]: misses that replaced a slot that held a token (not an empty slot)


def swap_in(top_k: torch.Tensor, rows: torch.Tensor, slot_pos: torch.Tensor, lru: torch.Tensor,
            device_rows: torch.Tensor, host_rows: torch.Tensor, host_kv: torch.Tensor,
            device_kv: torch.Tensor, *, policy: str | EvictionPolicy = "lru",
            backend: str = "auto") -> SwapInResult:
    """Swap in one layer's selected tokens for the whole batch; see the module docstring.

    top_k [B, K] int64 (-1 padding), rows [B] int64, slot_pos [R, S] int32 and lru [R, S] int32
    (updated in place), device_rows [R, S] int64, host_rows [R, C] int64, host_kv [H, W], device_kv
    [D, W] (written in place). `policy` is a name ("lru", "fifo") or a policy object (needed for
    stateful ones: `get_policy("clock", num_rows=R, num_slots=S)`, one per layer). `backend`:
    "reference", "cpu", "triton", or "auto" (triton on CUDA tensors when it supports the policy, the
    reference otherwise; cpu on CPU tensors).
    """
    policy = resolve_policy(policy)
    check_swap_in_args(top_k, rows, slot_pos, lru, device_rows, host_rows, host_kv, device_kv)
    return _implementation(backend, policy, top_k.device)(
        top_k, rows, slot_pos, lru, device_rows, host_rows, host_kv, device_kv, policy=policy
    )


def _implementation(backend: str, policy: EvictionPolicy,
                    device: torch.device) -> Callable[..., SwapInResult]:
    """Imported lazily: triton is a development dependency, and the kernels import this module."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown swap-in backend {backend!r}; known: {', '.join(BACKENDS)}")
    if backend == "auto":
        if device.type == "cuda":
            backend = "triton" if policy.name in TRITON_POLICIES else "reference"
        else:
            backend = "cpu"
    if backend == "reference":
        from hisparse.kernels.swap_in_reference import swap_in_reference

        return swap_in_reference
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(f"the cpu swap-in backend needs CPU tensors, got {device}")
        from hisparse.kernels.swap_in_cpu import swap_in_cpu

        return swap_in_cpu
    if policy.name not in TRITON_POLICIES:
        raise ValueError(
            f"the triton swap-in backend implements {', '.join(TRITON_POLICIES)}, not {policy.name!r}"
        )
    from hisparse.kernels.swap_in_triton import swap_in_triton

    return swap_in_triton


def check_swap_in_args(top_k: torch.Tensor, rows: torch.Tensor, slot_pos: torch.Tensor, lru: torch.Tensor,
                       device_rows: torch.Tensor, host_rows: torch.Tensor, host_kv: torch.Tensor,
                       device_kv: torch.Tensor) -> None:
    """Reject what would make a kernel read or write out of bounds; a few O(B*K) reductions."""
    _expect(top_k, "top_k", torch.int64, 2)
    _expect(rows, "rows", torch.int64, 1)
    _expect(slot_pos, "slot_pos", torch.int32, 2)
    _expect(lru, "lru", torch.int32, 2)
    _expect(device_rows, "device_rows", torch.int64, 2)
    _expect(host_rows, "host_rows", torch.int64, 2)
    num_rows, num_slots = slot_pos.shape
    if lru.shape != slot_pos.shape or device_rows.shape != slot_pos.shape:
        raise ValueError(f"slot_pos, lru and device_rows must have one shape, got {tuple(slot_pos.shape)}, "
                         f"{tuple(lru.shape)}, {tuple(device_rows.shape)}")
    if host_rows.shape[0] != num_rows:
        raise ValueError(f"host_rows has {host_rows.shape[0]} rows, slot_pos {num_rows}")
    if rows.shape[0] != top_k.shape[0]:
        raise ValueError(f"rows has {rows.shape[0]} entries for a batch of {top_k.shape[0]}")
    if host_kv.dim() != 2 or device_kv.dim() != 2 or host_kv.shape[1] != device_kv.shape[1]:
        raise ValueError(f"host_kv and device_kv must be [rows, W] with one W, got {tuple(host_kv.shape)} "
                         f"and {tuple(device_kv.shape)}")
    if host_kv.dtype != device_kv.dtype:
        raise ValueError(f"host_kv is {host_kv.dtype} but device_kv is {device_kv.dtype}")
    if not (host_kv.is_contiguous() and device_kv.is_contiguous()):
        raise ValueError("host_kv and device_kv must be contiguous")
    if top_k.numel() == 0:
        return
    valid = top_k >= 0
    most = int(valid.sum(dim=1).max())
    if most > num_slots:
        raise ValueError(f"a request selects {most} positions but the hot buffer has {num_slots} slots")
    if int(top_k.min()) < -1 or int(top_k.max()) >= host_rows.shape[1]:
        raise ValueError(f"top_k positions must be -1 or in [0, {host_rows.shape[1]})")
    if int(rows.min()) < 0 or int(rows.max()) >= num_rows:
        raise ValueError(f"rows must be in [0, {num_rows})")
    if torch.unique(rows).numel() != rows.numel():
        raise ValueError("two batch entries use the same row of the state tables")


def _expect(tensor: torch.Tensor, name: str, dtype: torch.dtype, dim: int) -> None:
    if tensor.dtype != dtype or tensor.dim() != dim:
        raise ValueError(f"{name} must be a {dim}-d {dtype} tensor, got {tensor.dim()}-d {tensor.dtype}")
    if dim == 2 and not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
