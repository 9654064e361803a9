"""A decode step's page table from a table of rows and a selection of positions, in C (`page_rows_cpu.c`).

The baseline attends to the pool rows of the positions its indexer selected, and HiSparse's fast path to the hot
slots that hold them: `torch.where(selected >= 0, table.gather(1, selected.clamp(min=0)), -1)`, four ops a layer,
each a few microseconds of dispatch at batch 1 against a loop over a few hundred entries. Built on first use
(`kernels.c_library`); where it cannot be (no gcc), `available()` is False and the backends keep PyTorch's ops.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from hisparse.kernels.c_library import INT64, POINTER, CLibrary

_LIBRARY = CLibrary(
    Path(__file__).with_suffix(".c"),
    {"page_rows": (INT64, [POINTER, INT64, INT64, POINTER, INT64, INT64, POINTER])},
    "the page tables are gathered with PyTorch's ops")
available = _LIBRARY.available  # whether the kernel is built and loaded (building it on first use)


def bind_page_rows(table: torch.Tensor, selected: torch.Tensor, page: torch.Tensor) -> Callable[[], int]:
    """page[b, j] <- table[b, selected[b, j]], -1 where selected[b, j] is -1, as a call checked once that returns how
    many positions it looked up, for a caller that selects into the same buffer every layer. table int64 [B, W] (each
    row contiguous), selected and page int64 [B, K] contiguous, in CPU memory; the call keeps them alive. A position
    outside [-1, W) raises ValueError and writes nothing."""
    batch, width = table.shape if table.dim() == 2 else (-1, -1)
    if (batch < 0 or selected.dim() != 2 or selected.shape[0] != batch or page.shape != selected.shape
            or any(t.dtype != torch.int64 or not t.is_cpu for t in (table, selected, page))
            or table.stride(1) != 1 or not selected.is_contiguous() or not page.is_contiguous()):
        raise ValueError(f"page_rows takes an int64 table [B, W] with contiguous rows and contiguous int64 selected "
                         f"and page [B, K], in CPU memory; got table {tuple(table.shape)} {table.dtype}, selected "
                         f"{tuple(selected.shape)} {selected.dtype}, page {tuple(page.shape)} {page.dtype}")
    function = _LIBRARY.load().page_rows
    arguments = (table.data_ptr(), table.stride(0), width, selected.data_ptr(), batch, selected.shape[1],
                 page.data_ptr())

    def look_up() -> int:
        count = function(*arguments)
        if count < 0:
            raise ValueError(f"page_rows: a selected position is outside [-1, {width})")
        return count
    look_up.tensors = (table, selected, page)
    return look_up
