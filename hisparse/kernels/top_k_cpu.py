"""Each request's top-k positions by indexer score, ascending, on the CPU with numba.

The indexer hands sparse attention and the swap-in the k best-scored positions of every request in
every layer, in ascending order. PyTorch does it as `topk` (a heap per row), then marks the picks in a
boolean row and reads them back with `nonzero` to get them in order: three passes and a [B, W] mask.
Here each row finds its k-th largest score by a radix select over the scores' bits (four passes of an
8-bit histogram over a row of float32 keys mapped to order-preserving integers; numba's `np.partition`
took 3x as long), and one scan in position order keeps every position above it and, of those equal to
it, the earliest until k are kept, so the output comes out ascending with no sort; ties therefore go to
the earlier positions (`topk` leaves ties to its implementation). Positions scored -inf (past a
request's length) are never selected: a row with fewer than k others is padded with -1 at the end.
`python -m hisparse.bench.index_scores` (k = 256 of 2k positions; our 2-core machine): 0.38 / 0.46 / 0.44 /
0.53x the PyTorch path's time at batch 1 / 4 / 8 / 16.

The reference is `IndexerKeyCache.select_reference` (the PyTorch path).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from hisparse.kernels.numba_threads import choose_threading_layer

choose_threading_layer()

# batch x width below which one thread does it all. A short parallel region costs the engine more than
# its own time: the thread pool's wake-up, and a slower swap-in after it (at batch 8, 2k context, 192 against
# 150 us a layer). Two engines stepping in turn, batch 8 and 2k context: a step took 0.935x and 0.964x as
# long with the serial top-k; at batch 16 the two were even (1.002).
PARALLEL_MIN_SCORES = 32768


def top_k_ascending(scores: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [B, k]: each row's k highest-scored columns of `scores` (float32 [B, W], k <= W), ascending,
    -inf never selected (-1 padding at the end of a row that has fewer than k others)."""
    bits = scores.numpy().view(np.uint32)
    out = np.empty((bits.shape[0], k), np.int64)
    kernel = _top_k_parallel if bits.size >= PARALLEL_MIN_SCORES else _top_k_serial
    kernel(bits, k, out)
    return torch.from_numpy(out)


@njit(cache=True)
def _ordered(bits):
    """float32 bits -> uint32 in the same order as the floats (-inf lowest, +inf highest)."""
    return ~bits if bits & 0x80000000 else bits | 0x80000000


_MINUS_INF = 0x007FFFFF  # _ordered(bits of -inf)


@njit(cache=True)
def _top_k_row(bits, b, k, out):
    """Row b of `top_k_ascending`."""
    width = bits.shape[1]
    keys = np.empty(width, np.uint32)
    for p in range(width):
        keys[p] = _ordered(bits[b, p])
    # Radix select of the k-th largest key, 8 bits at a time from the top.
    prefix = np.uint32(0)
    mask = np.uint32(0)
    remaining = k  # of the keys matching the prefix so far, how many more we need
    histogram = np.zeros(256, np.int64)
    for shift in (24, 16, 8, 0):
        histogram[:] = 0
        for p in range(width):
            if keys[p] & mask == prefix:
                histogram[(keys[p] >> shift) & 255] += 1
        digit = 255
        while histogram[digit] < remaining:
            remaining -= histogram[digit]
            digit -= 1
        prefix |= np.uint32(digit) << shift
        mask |= np.uint32(255) << shift
    # prefix is the k-th largest key; `remaining` of the keys equal to it are kept, the earliest first.
    kept = 0
    for p in range(width):
        key = keys[p]
        if key == _MINUS_INF:
            continue
        if key > prefix:
            out[b, kept] = p
            kept += 1
        elif key == prefix and remaining > 0:
            out[b, kept] = p
            kept += 1
            remaining -= 1
    for j in range(kept, k):
        out[b, j] = -1


# Two drivers, not one function compiled twice: numba's disk cache keys a compiled function by the Python
# function and the argument types, not by `parallel`, so the two would share one cache entry.
@njit(cache=True)
def _top_k_serial(bits, k, out):
    for b in range(bits.shape[0]):
        _top_k_row(bits, b, k, out)


@njit(parallel=True, cache=True)
def _top_k_parallel(bits, k, out):
    for b in prange(bits.shape[0]):
        _top_k_row(bits, b, k, out)
