"""Lightning-indexer scores of every past token from int8 key rows, on the CPU in C (`index_scores_cpu.c`).

A decode step scores every past token of every request in every layer, and with PyTorch that is a
gather of the key rows, a widening of their int8 values to float32, two batched matmuls, a ReLU, the
scale and two masks: each pass reads or writes a [B, L, d] or [B, H, L] tensor. Here one loop per key
takes the H dot products straight from its int8 row, sums the weighted ReLUs in registers and writes one
float. `python -m hisparse.bench.index_scores` (one layer, 4 heads of 64 dims, 2k keys per request,
caches flushed before each call; our 2-core machine): 0.24-0.27x the PyTorch path's time at batch 1,
0.27-0.41x at 4, 0.26-0.29x at 8, 0.30x at 16.

`int8_top_k` ranks the scores in the same call: a decode step's selection is then one parallel region (scores'
tiles, a barrier, each row's radix select while its scores are in the caches) instead of a scorer and a numba
top-k apart. In the engine, selection alternating with the two calls every 6 steps (medians of 20): 0.954x the
step time at batch 16 with HiSparse, 0.952x at batch 4 without (1.5k contexts).

The reference is `IndexSelector.past_scores_reference` (the PyTorch path); the two agree to float32
rounding (the sums run in another order) and exactly on the masks. Each key is widened once, each head's dot
product is a few AVX-512 FMAs, and four heads' products are summed across lanes together (see the C file).
Built on first use (`kernels.c_library`); where it cannot be (no gcc), `available()` is False and selection
scores with PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from hisparse.kernels.c_library import INT, INT64, POINTER, CLibrary, LayerAddresses
from hisparse.kernels.numba_threads import on_torch_team

# batch x keys from which the tiles run on the thread team. On torch's own OpenMP team (numba_threads), awake from the
# step's matmuls, engine steps of one request with ~1.6k keys (the two taking turns every 10 steps, medians of 70)
# took 0.977x-0.978x as long with 512 as with 4096 (HiSparse and not), two requests 0.983x; ~700 keys 0.996x. On
# TBB a parallel region costs a wake-up.
PARALLEL_MIN_KEYS = 1024 if on_torch_team() else 4096


_LIBRARY = CLibrary(
    Path(__file__).with_suffix(".c"),
    {"int8_past_scores": (INT, [POINTER, INT64, INT64, INT64, POINTER, INT64, INT64, POINTER, POINTER, INT64,
                                POINTER, POINTER, INT]),
     "int8_top_k": (INT, [POINTER, INT64, INT64, INT64, POINTER, INT64, INT64, POINTER, POINTER, INT64, POINTER,
                          INT64, POINTER, POINTER, INT])},
    "the indexer scores with PyTorch")
available = _LIBRARY.available  # whether the kernel is built and loaded (building it on first use)


def int8_past_scores(rows: torch.Tensor, head_dim: int, slots: torch.Tensor, q: torch.Tensor, w: torch.Tensor,
                     lengths: torch.Tensor) -> torch.Tensor:
    """Scores [B, W] float32: sum_h w[b, h] ReLU(q[b, h] . k) x scale for the key row at slots[b, p] of
    `rows` (uint8 [N, head_dim + 4]: head_dim int8 values, then the fp32 scale), -inf for p >= lengths[b],
    +inf at the newest position lengths[b] - 1. q [B, H, head_dim] and w [B, H] float32, slots [B, W] and
    lengths [B] int64, all contiguous in CPU memory. A slot read outside the rows raises ValueError."""
    _check("int8_past_scores", rows, head_dim, slots, q, w, lengths)
    batch, width = slots.shape
    out = torch.empty(batch, width)
    _raise_on(_LIBRARY.load().int8_past_scores(*_arguments(rows, head_dim, slots, q, w, lengths), out.data_ptr(),
                                               batch * width >= PARALLEL_MIN_KEYS), "int8_past_scores", rows, width)
    return out


def int8_top_k(rows: torch.Tensor, head_dim: int, slots: torch.Tensor, q: torch.Tensor, w: torch.Tensor,
               lengths: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [B, k]: `top_k_cpu.top_k_ascending(int8_past_scores(...), k)` in one call, 0 <= k <= W: each row's k best
    positions, ascending, ties to the earlier, -1 padded. Each request's scores are ranked while they are still in
    its core's cache, and the step's selection is one parallel region instead of two."""
    out = torch.empty(slots.shape[0], max(k, 0), dtype=torch.int64)
    bind_int8_top_k(rows.unsqueeze(0), head_dim, slots, q, w, lengths, k, out)(0)
    return out


def bind_int8_top_k(rows: torch.Tensor, head_dim: int, slots: torch.Tensor, q: torch.Tensor, w: torch.Tensor,
                    lengths: torch.Tensor, k: int, out: torch.Tensor) -> Callable[[int], None]:
    """`int8_top_k` over layer l of rows [L, N, head_dim + 4] into out (int64 [B, k], contiguous) as a call checked
    once, `call(l)`, for a caller that selects with the same queries' buffers in every layer (a decode step); the
    call keeps the tensors it reads and writes alive."""
    _check("int8_top_k", rows[0], head_dim, slots, q, w, lengths)
    batch, width = slots.shape
    if not 0 <= k <= width:
        raise ValueError(f"int8_top_k: k must be in [0, {width}] (the slots' width), got {k}")
    if out.shape != (batch, k) or out.dtype != torch.int64 or not out.is_cpu or not out.is_contiguous():
        raise ValueError(f"int8_top_k writes contiguous int64 [{batch}, {k}] in CPU memory")
    layers, function = LayerAddresses(rows), _LIBRARY.load().int8_top_k
    scores = torch.empty(batch, width)
    arguments = (*_arguments(rows[0], head_dim, slots, q, w, lengths)[1:], k, scores.data_ptr(), out.data_ptr(),
                 batch * width >= PARALLEL_MIN_KEYS)

    def select(layer: int) -> None:
        error = function(layers.address(layer), *arguments) if k else 0
        if error:
            _raise_on(error, "int8_top_k", rows[0], width)
    select.tensors = (rows, slots, q, w, lengths, scores, out)  # scores: its scratch
    return select


def _check(name: str, rows: torch.Tensor, head_dim: int, slots: torch.Tensor, q: torch.Tensor, w: torch.Tensor,
           lengths: torch.Tensor) -> None:
    batch, width = slots.shape
    heads = q.shape[1]
    if (rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != head_dim + 4 or head_dim % 4
            or not rows.is_contiguous() or q.shape != (batch, heads, head_dim) or w.shape != (batch, heads)
            or lengths.shape != (batch,) or q.dtype != torch.float32 or w.dtype != torch.float32
            or slots.dtype != torch.int64 or lengths.dtype != torch.int64
            or not rows.is_cpu or not all(t.is_contiguous() and t.is_cpu for t in (slots, q, w, lengths))):
        raise ValueError(f"{name} takes uint8 rows [N, {head_dim + 4}] (head_dim a multiple of 4), "
                         f"int64 slots [B, W] and lengths [B], float32 q [B, H, {head_dim}] and w [B, H], contiguous "
                         f"in CPU memory")


def _arguments(rows, head_dim, slots, q, w, lengths) -> tuple:
    """The C functions' common leading arguments."""
    batch, width = slots.shape
    return (rows.data_ptr(), rows.shape[1], rows.shape[0], head_dim, slots.data_ptr(), batch, width, q.data_ptr(),
            w.data_ptr(), q.shape[1], lengths.data_ptr())


def _raise_on(error: int, name: str, rows: torch.Tensor, width: int) -> None:
    if error == 2:
        raise ValueError(f"{name}: lengths must be in [0, {width}] (the slots' width)")
    if error == 3:
        raise MemoryError(f"{name}: no memory for the top-k's scratch ({width} keys)")
    if error:
        raise ValueError(f"{name}: a slot is outside the key rows [0, {rows.shape[0]})")
