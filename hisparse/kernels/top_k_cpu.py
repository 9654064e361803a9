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

`top_k_and_runners_up` also lists the n best positions the top-k left out, best first (what `lrfu` and
`score_lru` read): a second radix select over the row's keys with the selected ones zeroed, then an LSD
radix sort of those n. k = 256 and n = 512 of 2k positions: 193 / 224 us at batch 8 / 16 against 400 / 763
us for the top-k plus PyTorch's scatter and sorted `topk` (session script, interleaved calls).

The reference is `IndexSelector.select_reference` (the PyTorch path).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from hisparse.kernels.numba_threads import on_torch_team

# batch x width below which one thread does it all. A short parallel region costs the engine more than
# its own time: the thread pool's wake-up, and a slower swap-in after it. On numba's TBB pool a batch-8 step
# at 2k context took 0.935x and 0.964x as long with the serial top-k. On torch's own OpenMP team a batch-16
# step at 1.5k context (about 26k scores) was faster with top-k and the swap-in plan in parallel
# (swap_in_cpu's PARALLEL_MIN_SELECTED gives the figures); smaller batches were not measured there.
PARALLEL_MIN_SCORES = 24576 if on_torch_team() else 32768


def top_k_ascending(scores: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [B, k]: each row's k highest-scored columns of `scores` (float32 [B, W], k <= W), ascending,
    -inf never selected (-1 padding at the end of a row that has fewer than k others)."""
    bits = scores.numpy().view(np.uint32)
    out = np.empty((bits.shape[0], k), np.int64)
    kernel = _top_k_parallel if bits.size >= PARALLEL_MIN_SCORES else _top_k_serial
    kernel(bits, k, out)
    return torch.from_numpy(out)


def top_k_and_runners_up(scores: torch.Tensor, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`top_k_ascending(scores, k)`, and int64 [B, n]: the n best-scored columns it left out, best first,
    ties to the earlier column, -inf never (-1 padding at the end). One pass of keys per row serves both;
    the runners-up are a second radix select over what the top-k left, then a sort of those n."""
    bits = scores.numpy().view(np.uint32)
    out = np.empty((bits.shape[0], k), np.int64)
    following = np.empty((bits.shape[0], n), np.int64)
    kernel = _top_k_runners_up_parallel if bits.size >= PARALLEL_MIN_SCORES else _top_k_runners_up_serial
    kernel(bits, k, n, out, following)
    return torch.from_numpy(out), torch.from_numpy(following)


@njit(cache=True)
def _ordered(bits):
    """float32 bits -> uint32 in the same order as the floats (-inf lowest, +inf highest)."""
    return ~bits if bits & 0x80000000 else bits | 0x80000000


_MINUS_INF = 0x007FFFFF  # _ordered(bits of -inf)


@njit(cache=True)
def _keys_of_row(bits, b):
    """Row b's scores as order-preserving uint32 keys."""
    width = bits.shape[1]
    keys = np.empty(width, np.uint32)
    for p in range(width):
        keys[p] = _ordered(bits[b, p])
    return keys


@njit(cache=True)
def _kth_largest(keys, k):
    """Radix select, 8 bits at a time from the top: (the k-th largest key, how many of the keys equal to it
    the k largest include). Needs k <= keys.size."""
    prefix = np.uint32(0)
    mask = np.uint32(0)
    remaining = k  # of the keys matching the prefix so far, how many more we need
    histogram = np.zeros(256, np.int64)
    for shift in (24, 16, 8, 0):
        histogram[:] = 0
        for p in range(keys.shape[0]):
            if keys[p] & mask == prefix:
                histogram[(keys[p] >> shift) & 255] += 1
        digit = 255
        while histogram[digit] < remaining:
            remaining -= histogram[digit]
            digit -= 1
        prefix |= np.uint32(digit) << shift
        mask |= np.uint32(255) << shift
    return prefix, remaining


@njit(cache=True)
def _keep_largest(keys, threshold, remaining, positions):
    """Write into `positions`, ascending, every position whose key is above `threshold` and the first
    `remaining` equal to it (what `_kth_largest` returned), never -inf (nor a key below it); return how many."""
    kept = 0
    for p in range(keys.shape[0]):
        key = keys[p]
        if key <= _MINUS_INF:
            continue
        if key > threshold or (key == threshold and remaining > 0):
            if key == threshold:
                remaining -= 1
            positions[kept] = p
            kept += 1
    return kept


@njit(cache=True)
def _top_k_row(bits, b, k, out):
    """Row b of `top_k_ascending`; returns the row's keys with the selected ones set to 0 (below -inf)."""
    keys = _keys_of_row(bits, b)
    threshold, remaining = _kth_largest(keys, k)
    kept = _keep_largest(keys, threshold, remaining, out[b])
    for j in range(kept):
        keys[out[b, j]] = 0
    for j in range(kept, k):
        out[b, j] = -1
    return keys


@njit(cache=True)
def _runners_up_row(keys, b, n, out):
    """Row b's n best positions left by `_top_k_row` (`keys`, selected at 0), best first, ties earliest,
    -inf never (-1 padding at the end)."""
    left = 0
    for p in range(keys.shape[0]):
        if keys[p] > _MINUS_INF:
            left += 1
    m = min(n, left)
    found = 0
    if m > 0:
        threshold, remaining = _kth_largest(keys, m)
        positions = np.empty(m, np.int64)
        found = _keep_largest(keys, threshold, remaining, positions)
        order_keys = np.empty(found, np.uint32)
        for i in range(found):
            order_keys[i] = ~keys[positions[i]]  # ascending ~key is descending key
        _radix_sort(order_keys, positions)
        for j in range(found):
            out[b, j] = positions[j]
    for j in range(found, n):
        out[b, j] = -1


@njit(cache=True)
def _radix_sort(keys, values):
    """Sort `values` by uint32 `keys`, ascending, in place (both): LSD radix, 8 bits a pass, stable, so
    equal keys keep their order (numba's stable argsort took about 4x as long on 512 runners-up)."""
    n = keys.shape[0]
    keys_out = np.empty_like(keys)
    values_out = np.empty_like(values)
    count = np.empty(257, np.int64)
    for shift in (0, 8, 16, 24):
        count[:] = 0
        for i in range(n):
            count[((keys[i] >> shift) & 255) + 1] += 1
        for d in range(256):
            count[d + 1] += count[d]
        for i in range(n):
            d = (keys[i] >> shift) & 255
            keys_out[count[d]] = keys[i]
            values_out[count[d]] = values[i]
            count[d] += 1
        keys, keys_out = keys_out, keys
        values, values_out = values_out, values
    # four passes: the sorted arrays are the originals again


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


@njit(cache=True)
def _top_k_runners_up_serial(bits, k, n, out, following):
    for b in range(bits.shape[0]):
        _runners_up_row(_top_k_row(bits, b, k, out), b, n, following)


@njit(parallel=True, cache=True)
def _top_k_runners_up_parallel(bits, k, n, out, following):
    for b in prange(bits.shape[0]):
        _runners_up_row(_top_k_row(bits, b, k, out), b, n, following)
