"""What every swap-in implementation shares: its result, the checks of its arguments, the backends and the
policies each implements, and the binding of one layer's tables (`memory.swap_in` says what a swap-in does
and dispatches to an implementation; the compiled ones here see a policy only as a `KernelPolicy`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hisparse.formats.kernel_policy import KernelPolicy

BACKENDS = ("reference", "cpu", "triton", "auto")
TRITON_POLICIES = ("lru", "fifo", "score_lru", "lrfu")
CPU_POLICIES = ("lru", "fifo", "clock", "score_lru", "lrfu")  # any other runs on the reference under "auto"


@dataclass
class SwapInResult:
    page_table: torch.Tensor  # int64 [B, K]: device row of each selected position, -1 where top_k is -1
    misses: torch.Tensor  # int32 [B]: positions that were not in the hot buffer and were copied in
    evictions: torch.Tensor  # int32 [B]: misses that replaced a slot that held a token (not an empty slot)
    hits: torch.Tensor  # int32 [B]: selected positions that were in the hot buffer already


class BoundSwapIn:
    """`memory.swap_in.swap_in` of one backend with one layer's tables, pools and policy bound (the policy as
    its implementation takes it: an `EvictionPolicy` for the reference, a `KernelPolicy` for a kernel).

    `self(top_k, rows, next_ranked=None)` is the kernel's contract. `page_table` is the swap-in as a
    decode step uses it: each request's newest position is never swapped in but read from its reserved
    device row (the forward pass writes it there), and the step's totals are added to the bound counters
    where they are, so that a step never waits for the device. The cpu backend does all of that
    in one compiled call (`BoundCpuSwapIn`): each torch op around a swap-in runs with the caches the
    layer's weights just flushed, about 10 us apiece.
    """

    def __init__(self, implementation: Callable[..., SwapInResult], policy: object, slot_pos: torch.Tensor,
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


def resolve_backend(backend: str, policy: str, device: torch.device) -> str:
    """The concrete backend for `backend` ("auto" included), or a ValueError saying why none fits."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown swap-in backend {backend!r}; known: {', '.join(BACKENDS)}")
    if backend == "auto":
        if device.type == "cuda":
            return "triton" if policy in TRITON_POLICIES else "reference"
        return "cpu" if policy in CPU_POLICIES else "reference"
    if backend == "cpu" and device.type != "cpu":
        raise ValueError(f"the cpu swap-in backend needs CPU tensors, got {device}")
    if backend == "triton" and policy not in TRITON_POLICIES:
        raise ValueError(f"the triton swap-in backend implements {', '.join(TRITON_POLICIES)}, not {policy!r}")
    return backend


def kernel_scalars(policy: KernelPolicy) -> tuple[int, int, int, int, int, int]:
    """The six scalars the compiled kernels take for a policy's constants, in their calling convention:
    score_lru's (touch_age_per_rank, load_age_steps, age_limit, 0, 0, 0); lrfu's (hit, decay_shift,
    rank_bonus, ranks_per_top_k, ghost_decay_shift, ghost_weight_quarters); zeros for the others."""
    c = policy.constants
    if policy.name == "score_lru":
        return c.touch_age_per_rank, c.load_age_steps, c.age_limit, 0, 0, 0
    if policy.name == "lrfu":
        return c.hit, c.decay_shift, c.rank_bonus, c.ranks_per_top_k, c.ghost_decay_shift, c.ghost_weight_quarters
    return 0, 0, 0, 0, 0, 0


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
