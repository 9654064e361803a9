"""The lru swap-in of a decode step in C (`lru_page_table_cpu.c`): the CPU default policy's page table in one call.

`kernels.swap_in_cpu` plans every policy in numba. A decode step calls a layer's swap-in right after the layer's
weights have streamed through the caches, and there the call's fixed costs dominate at small batches: numba's
dispatch of the plan's 23 arguments took 9.7 us with the caches flushed against 1.5 us warm, and a batch-1 call
with every selected position a hit 51 us against 13 us. Here the layer's tables are bound once into a struct
(`LruTables`), a call passes the step's five arrays, and the plan is lru's alone, so its code is small.

The rule is `swap_in_cpu`'s for lru, to the bit: the same page table, tables, copies and totals (the swap-in
tests hold both to the PyTorch reference). Values are checked first, as there, and an error changes nothing.
In the engine, the two taking turns every 6 steps (medians of 20, 1.5k contexts, a 300-slot buffer): 0.938x the
step time at batch 1, 0.954x at batch 16; `python -m hisparse.bench.decode_overhead --batch 1 --context 1536`
with that buffer: HiSparse's step 1.001x the baseline's (1.067x with the numba plan), the same misses. Built on
first use (`kernels.c_library`); where it cannot be, `available()` is False and the numba plan runs.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch

from hisparse.kernels.c_library import INT, INT64, POINTER, CLibrary
from hisparse.kernels.swap_in import raise_value_error

# batch x top_k from which requests and copies run on the OpenMP team: from batch 4 at top_k 256. Engine steps, the
# thresholds taking turns every 6 steps (medians of 20): 1024 against 4096 (numba's plan's) 0.968x at batch 4
# (1.5k contexts, 300-slot buffer), 0.986x at batch 8 (2k, 512); 512 against 4096 at batch 2: 0.990x, noise.
PARALLEL_MIN_SELECTED = 1024


class LruTables(ctypes.Structure):
    """The C file's `Tables`: one layer's tables and pools."""

    _fields_ = [("slot_pos", ctypes.c_void_p), ("lru", ctypes.c_void_p), ("device_rows", ctypes.c_void_p),
                ("host_rows", ctypes.c_void_p), ("num_rows", ctypes.c_int64), ("num_slots", ctypes.c_int64),
                ("context", ctypes.c_int64), ("host", ctypes.c_void_p), ("device", ctypes.c_void_p),
                ("row_bytes", ctypes.c_int64), ("totals", ctypes.c_void_p)]


_LIBRARY = CLibrary(
    Path(__file__).with_suffix(".c"),
    {"lru_page_table": (INT, [POINTER, POINTER, INT64, INT64, POINTER, POINTER, POINTER, POINTER, INT, POINTER])},
    "the lru swap-in plans with numba")
available = _LIBRARY.available  # whether the kernel is built and loaded (building it on first use)


class LruPageTable:
    """One layer's lru page table, its tables bound: `BoundCpuSwapIn.page_table` for the lru policy.

    slot_pos, lru int32 [R, S]; device_rows int64 [R, S]; host_rows int64 [R, C]; host_kv, device_kv: pools of rows
    of the same bytes; totals int64 [3]: all contiguous CPU tensors, kept alive here (the struct points into them).
    """

    def __init__(self, slot_pos: torch.Tensor, lru: torch.Tensor, device_rows: torch.Tensor, host_rows: torch.Tensor,
                 host_kv: torch.Tensor, device_kv: torch.Tensor, totals: torch.Tensor) -> None:
        tensors = (slot_pos, lru, device_rows, host_rows, host_kv, device_kv, totals)
        row_bytes = host_kv.shape[1] * host_kv.element_size()
        if (not all(t.is_cpu and t.is_contiguous() for t in tensors) or slot_pos.dtype != torch.int32
                or lru.dtype != torch.int32 or device_rows.dtype != torch.int64 or host_rows.dtype != torch.int64
                or totals.dtype != torch.int64 or totals.shape != (3,) or lru.shape != slot_pos.shape
                or device_rows.shape != slot_pos.shape or host_rows.shape[0] != slot_pos.shape[0]
                or device_kv.shape[1] * device_kv.element_size() != row_bytes):
            raise ValueError("LruPageTable takes contiguous CPU tables: int32 slot_pos and lru [R, S], int64 "
                             "device_rows [R, S] and host_rows [R, C], pools of rows of one size, int64 totals [3]")
        self._tensors = tensors
        self.table_shape = tuple(slot_pos.shape)
        self.context = host_rows.shape[1]
        self._tables = LruTables(slot_pos.data_ptr(), lru.data_ptr(), device_rows.data_ptr(), host_rows.data_ptr(),
                                 slot_pos.shape[0], slot_pos.shape[1], self.context, host_kv.data_ptr(),
                                 device_kv.data_ptr(), row_bytes, totals.data_ptr())
        self.address = ctypes.addressof(self._tables)  # what the C function takes

    def __call__(self, selected: torch.Tensor, rows: torch.Tensor, newest: torch.Tensor, reserved: torch.Tensor,
                 parallel: bool) -> torch.Tensor:
        """Device rows [B, K] of the selected positions (int64 [B, K], -1 padding), missed rows swapped in first;
        newest[b] reads reserved[b]; rows, newest, reserved int64 [B]: all contiguous on the CPU."""
        page = torch.empty(selected.shape, dtype=torch.int64)
        bind_page_tables([self], selected, rows, newest, reserved, page, parallel)(0)
        return page


def bind_page_tables(tables: list[LruPageTable], selected: torch.Tensor, rows: torch.Tensor, newest: torch.Tensor,
                     reserved: torch.Tensor, page: torch.Tensor, parallel: bool) -> Callable[[int], None]:
    """`LruPageTable.__call__` of tables[l] into page (int64 [B, K], contiguous) as a call checked once, `call(l)`,
    for a caller that swaps every layer in with the same buffers (a decode step, whose selection each layer writes
    in place); the call keeps them alive."""
    batch, width = selected.shape
    step = (selected, rows, newest, reserved, page)
    if not all(t.dtype == torch.int64 and t.is_contiguous() and t.is_cpu for t in step):
        raise ValueError("LruPageTable takes contiguous int64 CPU tensors")
    if not rows.shape == newest.shape == reserved.shape == (batch,) or page.shape != selected.shape:
        raise ValueError(f"rows, newest and reserved must be [{batch}], one per selected row, and the page table "
                         f"[{batch}, {width}]")
    function, addresses, detail = _LIBRARY.load().lru_page_table, [t.address for t in tables], ctypes.c_int64(0)
    arguments = (selected.data_ptr(), batch, width, rows.data_ptr(), newest.data_ptr(), reserved.data_ptr(),
                 page.data_ptr(), parallel, ctypes.addressof(detail))

    def page_table(layer: int) -> None:
        code = function(addresses[layer], *arguments)
        if code == -1:
            raise MemoryError("lru_page_table: no memory for its scratch")
        if code:
            raise_value_error(code, detail.value, tables[layer].table_shape, tables[layer].context)
    page_table.tensors = step
    return page_table
