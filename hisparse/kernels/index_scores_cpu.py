"""Lightning-indexer scores of every past token from int8 key rows, on the CPU in C (`index_scores_cpu.c`).

A decode step scores every past token of every request in every layer, and with PyTorch that is a
gather of the key rows, a widening of their int8 values to float32, two batched matmuls, a ReLU, the
scale and two masks: each pass reads or writes a [B, L, d] or [B, H, L] tensor. Here one loop per key
takes the H dot products straight from its int8 row, sums the weighted ReLUs in registers and writes one
float. `python -m hisparse.bench.index_scores` (one layer, 4 heads of 64 dims, 2k keys per request,
caches flushed before each call; our 2-core machine): 0.24-0.27x the PyTorch path's time at batch 1,
0.27-0.41x at 4, 0.26-0.29x at 8, 0.30x at 16.

The reference is `IndexSelector.past_scores_reference` (the PyTorch path); the two agree to float32
rounding (the sums run in another order) and exactly on the masks. Each key is widened once, each head's dot
product is a few AVX-512 FMAs, and four heads' products are summed across lanes together (see the C file).
Built on first use (`kernels.c_library`); where it cannot be (no gcc), `available()` is False and selection
scores with PyTorch.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hisparse.kernels.c_library import INT, INT64, POINTER, CLibrary

PARALLEL_MIN_KEYS = 4096  # below this a parallel region costs more than it saves


_LIBRARY = CLibrary(
    Path(__file__).with_suffix(".c"),
    {"int8_past_scores": (INT, [POINTER, INT64, INT64, INT64, POINTER, INT64, INT64, POINTER, POINTER, INT64,
                                POINTER, POINTER, INT])},
    "the indexer scores with PyTorch")
available = _LIBRARY.available  # whether the kernel is built and loaded (building it on first use)


def int8_past_scores(rows: torch.Tensor, head_dim: int, slots: torch.Tensor, q: torch.Tensor, w: torch.Tensor,
                     lengths: torch.Tensor) -> torch.Tensor:
    """Scores [B, W] float32: sum_h w[b, h] ReLU(q[b, h] . k) x scale for the key row at slots[b, p] of
    `rows` (uint8 [N, head_dim + 4]: head_dim int8 values, then the fp32 scale), -inf for p >= lengths[b],
    +inf at the newest position lengths[b] - 1. q [B, H, head_dim] and w [B, H] float32, slots [B, W] and
    lengths [B] int64, all contiguous in CPU memory. A slot read outside the rows raises ValueError."""
    batch, width = slots.shape
    heads = q.shape[1]
    if (rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != head_dim + 4 or head_dim % 4
            or not rows.is_contiguous() or q.shape != (batch, heads, head_dim) or w.shape != (batch, heads)
            or lengths.shape != (batch,) or q.dtype != torch.float32 or w.dtype != torch.float32
            or slots.dtype != torch.int64 or lengths.dtype != torch.int64
            or not rows.is_cpu or not all(t.is_contiguous() and t.is_cpu for t in (slots, q, w, lengths))):
        raise ValueError(f"int8_past_scores takes uint8 rows [N, {head_dim + 4}] (head_dim a multiple of 4), "
                         f"int64 slots [B, W] and lengths [B], float32 q [B, H, {head_dim}] and w [B, H], contiguous "
                         f"in CPU memory")
    out = torch.empty(batch, width)
    error = _LIBRARY.load().int8_past_scores(rows.data_ptr(), rows.shape[1], rows.shape[0], head_dim,
                                             slots.data_ptr(), batch, width, q.data_ptr(), w.data_ptr(), heads,
                                             lengths.data_ptr(), out.data_ptr(), batch * width >= PARALLEL_MIN_KEYS)
    if error == 2:
        raise ValueError(f"int8_past_scores: lengths must be in [0, {width}] (the slots' width)")
    if error:
        raise ValueError(f"int8_past_scores: a slot is outside the key rows [0, {rows.shape[0]})")
    return out
