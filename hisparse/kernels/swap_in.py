"""Swap-in: bring one decode step's top-k selected tokens of one layer into the hot buffer.

One call handles one layer for the whole decode batch. Per request it classifies the selected
positions as hits (already in a hot slot) or misses, lets the eviction policy pick a victim slot for
each miss among the slots not selected this step, updates the slot table and the eviction order in
place, copies each missed row host -> device, and returns the page table that sparse attention reads.
A policy that reads the indexer's next-ranked positions (`score_lru`, `lrfu`) gets them as
`next_ranked`; they are never loaded.

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
TRITON_POLICIES = ("lru", "fifo", "score_lru", "lrfu")
CPU_POLICIES = ("lru", "fifo", "clock", "score_lru", "lrfu")  # any other runs on the reference under "auto"


@dataclass
class SwapInResult:
    page_table: torch.Tensor  # int64 [B, K]: device row of each selected position, -1 where top_k is -1
    misses: torch.Tensor  # int32 [B]: positions that were not in the hot buffer and were copied in
    evictions: torch.Tensor  # int32 [B]: misses that replaced a slot that held a token (not an empty slot)
    hits: torch.Tensor  # int32 [B]: selected positions that were in the hot buffer already


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
    backend = resolve_backend(backend, policy, top_k.device)
    if backend != "cpu":  # the cpu path checks values inside its kernel: a few torch ops cost more
        check_swap_in_values(top_k, rows, slot_pos.shape, host_rows.shape[1], next_ranked)
    return _implementation(backend)(top_k, rows, slot_pos, lru, device_rows, host_rows, host_kv, device_kv,
                                    policy=policy, next_ranked=next_ranked)


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
    name = resolve_backend(backend, policy, slot_pos.device)
    if name == "cpu":
        from hisparse.kernels.swap_in_cpu import BoundCpuSwapIn

        return BoundCpuSwapIn(slot_pos, lru, device_rows, host_rows, host_kv, device_kv, policy, totals)
    return BoundSwapIn(_implementation(name), policy, slot_pos, lru, device_rows, host_rows, host_kv, device_kv,
                       totals)


class BoundSwapIn:
    """`swap_in` of one backend with one layer's tables, pools and policy bound.

    `self(top_k, rows, next_ranked=None)` is the kernel's contract. `page_table` is the swap-in as a
    decode step uses it: each request's newest position is never swapped in but read from its reserved
    device row (the forward pass writes it there), and the step's totals are added to the bound counters
    where they are, so that a step never waits for the device. The cpu backend does all of that
    in one compiled call (`BoundCpuSwapIn`): each torch op around a swap-in runs with the caches the
    layer's weights just flushed, about 10 us apiece.
    """

    def __init__(self, implementation: Callable[..., SwapInResult], policy: EvictionPolicy, slot_pos: torch.Tensor,
                 lru: torch.Tensor, device_rows: torch.Tensor, host_rows: torch.Tensor, host_kv: torch.Tensor,
                 device_kv: torch.Tensor, totals: torch.Tensor | None = None) -> None:
        self.implementation = implementation
        self.policy = policy
        self.tensors = (slot_pos, lru, device_rows, host_rows, host_kv, device_kv)
        self.totals = torch.zeros(3, dtype=torch.int64, device=slot_pos.device) if totals is None else totals

    def __call__(self, top_k: torch.Tensor, rows: torch.Tensor,
                 next_ranked: torch.Tensor | None = None) -> SwapInResult:
        return self.implementation(top_k, rows, *self.tensors, policy=self.policy, next_ranked=next_ranked)

    def page_table(self, selected: torch.Tensor, rows: torch.Tensor, newest: torch.Tensor, reserved: torch.Tensor,
                   next_ranked: torch.Tensor | None = None) -> torch.Tensor:
        """Device rows [B, K] of `selected` [B, K] (-1 padding stays -1): swap-in for every position but
        `newest` [B], which reads `reserved` [B]. The batch's (hits, misses, evictions) are added to the
        bound `totals` on the tables' device: on a GPU, reading them here would wait for the device once
        per layer."""
        is_newest = selected == newest.unsqueeze(1)
        result = self(selected.masked_fill(is_newest, -1), rows, next_ranked)
        self.totals += torch.stack((result.hits.sum(), result.misses.sum(), result.evictions.sum()))
        return torch.where(is_newest, reserved.unsqueeze(1), result.page_table)


def resolve_backend(backend: str, policy: EvictionPolicy, device: torch.device) -> str:
    """The concrete backend for `backend` ("auto" included), or a ValueError saying why none fits."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown swap-in backend {backend!r}; known: {', '.join(BACKENDS)}")
    if backend == "auto":
        if device.type == "cuda":
            return "triton" if policy.name in TRITON_POLICIES else "reference"
        return "cpu" if policy.name in CPU_POLICIES else "reference"
    if backend == "cpu" and device.type != "cpu":
        raise ValueError(f"the cpu swap-in backend needs CPU tensors, got {device}")
    if backend == "triton" and policy.name not in TRITON_POLICIES:
        raise ValueError(
            f"the triton swap-in backend implements {', '.join(TRITON_POLICIES)}, not {policy.name!r}"
        )
    return backend


def _implementation(backend: str) -> Callable[..., SwapInResult]:
    """Imported lazily: triton is a development dependency, and the kernels import this module."""
    if backend == "reference":
        from hisparse.kernels.swap_in_reference import swap_in_reference

        return swap_in_reference
    if backend == "cpu":
        from hisparse.kernels.swap_in_cpu import swap_in_cpu

        return swap_in_cpu
    from hisparse.kernels.swap_in_triton import swap_in_triton

    return swap_in_triton


def check_swap_in_args(top_k: torch.Tensor, rows: torch.Tensor, slot_pos: torch.Tensor, lru: torch.Tensor,
                       device_rows: torch.Tensor, host_rows: torch.Tensor, host_kv: torch.Tensor,
                       device_kv: torch.Tensor, next_ranked: torch.Tensor) -> None:
    """Types and shapes: what would make a kernel misread its arguments. Cheap: no data is read."""
    _expect(top_k, "top_k", torch.int64, 2)
    _expect(next_ranked, "next_ranked", torch.int64, 2)
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
    if next_ranked.shape[0] != top_k.shape[0]:
        raise ValueError(f"next_ranked has {next_ranked.shape[0]} rows for a batch of {top_k.shape[0]}")
    if host_kv.dim() != 2 or device_kv.dim() != 2 or host_kv.shape[1] != device_kv.shape[1]:
        raise ValueError(f"host_kv and device_kv must be [rows, W] with one W, got {tuple(host_kv.shape)} "
                         f"and {tuple(device_kv.shape)}")
    device = top_k.device
    if any(t.device != device for t in (rows, slot_pos, lru, device_rows, host_rows, device_kv, next_ranked)) or (
        host_kv.device not in (device, torch.device("cpu"))
    ):
        raise ValueError(f"all swap-in tensors must be on {device} (host_kv may be in host memory)")
    if host_kv.dtype != device_kv.dtype:
        raise ValueError(f"host_kv is {host_kv.dtype} but device_kv is {device_kv.dtype}")
    if not (host_kv.is_contiguous() and device_kv.is_contiguous()):
        raise ValueError("host_kv and device_kv must be contiguous")


# Why a swap-in's values are invalid, as codes a kernel can return before it changes anything.
TOO_MANY_SELECTED, POSITION_OUT_OF_RANGE, ROW_OUT_OF_RANGE, ROW_TWICE, NEXT_RANKED_OUT_OF_RANGE = 1, 2, 3, 4, 5


def check_swap_in_values(top_k: torch.Tensor, rows: torch.Tensor, table_shape: tuple[int, int],
                         context: int, next_ranked: torch.Tensor) -> None:
    """The value checks, with torch reductions: selections fit the buffer, indices are in range."""
    if top_k.numel() == 0:
        return
    if next_ranked.numel():
        for value in (int(next_ranked.min()), int(next_ranked.max())):
            if value < -1 or value >= context:
                raise_value_error(NEXT_RANKED_OUT_OF_RANGE, value, table_shape, context)
    num_rows, num_slots = table_shape
    most = int((top_k >= 0).sum(dim=1).max())
    if most > num_slots:
        raise_value_error(TOO_MANY_SELECTED, most, table_shape, context)
    for value in (int(top_k.min()), int(top_k.max())):
        if value < -1 or value >= context:
            raise_value_error(POSITION_OUT_OF_RANGE, value, table_shape, context)
    for value in (int(rows.min()), int(rows.max())):
        if value < 0 or value >= num_rows:
            raise_value_error(ROW_OUT_OF_RANGE, value, table_shape, context)
    if torch.unique(rows).numel() != rows.numel():
        raise_value_error(ROW_TWICE, -1, table_shape, context)


def raise_value_error(code: int, detail: int, table_shape: tuple[int, int], context: int) -> None:
    num_rows, num_slots = table_shape
    if code == TOO_MANY_SELECTED:
        raise ValueError(f"a request selects {detail} positions but the hot buffer has {num_slots} slots")
    if code == POSITION_OUT_OF_RANGE:
        raise ValueError(f"top_k positions must be -1 or in [0, {context}), got {detail}")
    if code == ROW_OUT_OF_RANGE:
        raise ValueError(f"rows must be in [0, {num_rows}), got {detail}")
    if code == NEXT_RANKED_OUT_OF_RANGE:
        raise ValueError(f"next_ranked positions must be -1 or in [0, {context}), got {detail}")
    raise ValueError("two batch entries use the same row of the state tables")


def _expect(tensor: torch.Tensor, name: str, dtype: torch.dtype, dim: int) -> None:
    if tensor.dtype != dtype or tensor.dim() != dim:
        raise ValueError(f"{name} must be a {dim}-d {dtype} tensor, got {tensor.dim()}-d {tensor.dtype}")
    if dim == 2 and not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
