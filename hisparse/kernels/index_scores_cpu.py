"""Lightning-indexer scores of every past token from int8 key rows, on the CPU with numba.

A decode step scores every past token of every request in every layer, and with PyTorch that is a
gather of the key rows, a widening of their int8 values to float32, two batched matmuls, a ReLU, the
scale and two masks: each pass reads or writes a [B, L, d] or [B, H, L] tensor. Here one loop per key
takes the H dot products straight from its int8 row, sums the weighted ReLUs in registers and writes one
float. `python -m hisparse.bench.index_scores` (one layer, 4 heads of 64 dims, 2k keys per request,
caches flushed before each call; our 2-core machine): 0.24-0.27x the PyTorch path's time at batch 1,
0.27-0.41x at 4, 0.26-0.29x at 8, 0.30x at 16.

The reference is `IndexSelector.past_scores_reference` (the PyTorch path); the two agree to float32
rounding (the sums run in another order) and exactly on the masks. Summation order is the only freedom
the compiler gets (no fast-math assumptions about infinities: the masks are infinities).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import njit, prange

from hisparse.kernels.numba_threads import choose_threading_layer

choose_threading_layer()

TILE = 256  # positions per parallel work item
PARALLEL_MIN_KEYS = 4096  # below this a parallel region costs more than it saves
_FLAGS = {"reassoc", "contract", "nsz"}  # reorder and fuse the sums; nothing that assumes finite values


def int8_past_scores(rows: torch.Tensor, head_dim: int, slots: torch.Tensor, q: torch.Tensor, w: torch.Tensor,
                     lengths: torch.Tensor) -> torch.Tensor:
    """Scores [B, W] float32: sum_h w[b, h] ReLU(q[b, h] . k) x scale for the key row at slots[b, p] of
    `rows` (uint8 [N, head_dim + 4]: head_dim int8 values, then the fp32 scale), -inf for p >= lengths[b],
    +inf at the newest position lengths[b] - 1. q [B, H, head_dim] and w [B, H] float32."""
    table = rows.numpy()
    keys = table.view(np.int8)
    scales = table.view(np.float32)[:, head_dim // 4]
    batch, width = slots.shape
    out = np.empty((batch, width), np.float32)
    serial, parallel = _kernels(head_dim)
    kernel = parallel if batch * width >= PARALLEL_MIN_KEYS else serial
    kernel(keys, scales, slots.numpy(), q.numpy(), w.numpy(), lengths.numpy(), out)
    return torch.from_numpy(out)


def _score(keys, s, qb, wb, head_dim):
    total = np.float32(0.0)
    for h in range(qb.shape[0]):
        acc = np.float32(0.0)
        for d in range(head_dim):
            acc += qb[h, d] * np.float32(keys[s, d])
        total += wb[h] * max(acc, np.float32(0.0))
    return total


def _score_tile(keys, scales, slots, q, w, lengths, out, t, head_dim):
    """Work item t: TILE positions of one request."""
    tiles = (slots.shape[1] + TILE - 1) // TILE
    b = t // tiles
    lo = (t % tiles) * TILE
    hi = min(lo + TILE, slots.shape[1])
    n = lengths[b]
    qb = q[b]
    wb = w[b]
    for p in range(lo, hi):
        if p >= n:
            out[b, p] = -np.inf
        elif p == n - 1:
            out[b, p] = np.inf
        else:
            s = slots[b, p]
            out[b, p] = _score(keys, s, qb, wb, head_dim) * scales[s]


# Inlined at numba's level into the drivers below (compiled with the same flags), where head_dim is a constant.
_score, _score_tile = (njit(fastmath=_FLAGS, cache=True, inline="always")(f) for f in (_score, _score_tile))


@functools.cache
def _kernels(head_dim: int):
    """(serial, parallel) scorers for keys of `head_dim` dims. The dim is a constant of the compiled code:
    with it known, the dot product is a few full-width vector instructions; as a run-time bound the loop
    took 1.6x as long (loop checks and a remainder around the same vector body). The drivers capture only
    the integer, so numba's disk cache finds them again in the next process (drivers that captured another
    compiled function got a new cache key, and were compiled anew, in every process)."""

    # Two drivers, not one function compiled twice: numba's disk cache keys a compiled function by the
    # Python function and the argument types, not by `parallel`, so the two would share one cache entry.
    @njit(fastmath=_FLAGS, cache=True)
    def serial(keys, scales, slots, q, w, lengths, out):
        for t in range(slots.shape[0] * ((slots.shape[1] + TILE - 1) // TILE)):
            _score_tile(keys, scales, slots, q, w, lengths, out, t, head_dim)

    @njit(fastmath=_FLAGS, parallel=True, cache=True)
    def parallel(keys, scales, slots, q, w, lengths, out):
        for t in prange(slots.shape[0] * ((slots.shape[1] + TILE - 1) // TILE)):
            _score_tile(keys, scales, slots, q, w, lengths, out, t, head_dim)

    return serial, parallel
