"""Decode attention straight from a pool of K/V rows, with numba: one query per request over its own rows.

A decode step's attention reads a few hundred rows per request (the top-k selection) scattered over the
pool. Gathering them into a dense tensor for SDPA writes them once more, and SDPA's CPU kernel is made for
long queries, not one query per request (isolated, with the caches flushed, gather + SDPA took 1.7-1.8 ms
for 16 requests x 257 bfloat16 rows, the first version of this kernel 0.9; gather + two batched matmuls,
39.6 ms for 30 layers against that version's 25.1). Here each row is read where it lies, prefetched a few
rows ahead and widened to float32 as it is read (a bfloat16 is the top 16 bits of a float32): each row's K
half is scored by the query heads that share its KV head, one plain store per score; then the softmax; then
the V halves, TILE_ROWS rows at a time, are weighted into the output (each accumulator load and store serves
the tile).

The code is compiled for each (KV heads, query heads per KV head, head dim) so that every inner loop has a
constant length and becomes a few full-width vector instructions, and the softmax's exponential is a
polynomial LLVM vectorizes (numba's np.exp is a scalar libm call per score, a fifth of the kernel's time).
Against the first version (runtime loop bounds, one row at a time, libm exp), side by side on our 2-core
EPYC, medians of 9 (a one-off script that imported both files; the figures are in issue 6's notes): 30
layers x 16 requests x 256 bfloat16 rows took 7.6-11.2 ms instead of 15.5-20.4, batch 4 4.5-6.4 instead
of 7.9-10.6; in the engine, a batch-16 HiSparse decode step 0.907x as long (170 against 188 ms), a
batch-4 baseline step 0.957x.

Rows whose index is -1 take no part; a request with none gets zeros.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import njit, prange

from hisparse.kernels.numba_threads import choose_threading_layer, on_torch_team
from hisparse.kernels.prefetch import line_step, prefetch_row_to_l2

choose_threading_layer()

# batch x rows from which requests run in parallel. On torch's own OpenMP team (numba_threads) a parallel region
# costs a wake-up: int4 engine steps at batch 8 / 6 and ~100-token contexts (about 1k and 700 rows) took 0.94x /
# 0.96x as long with 1024 as with 4096, the two thresholds taking turns every 10 steps (medians of 16).
PARALLEL_MIN_ROWS = 1024 if on_torch_team() else 4096
TILE_ROWS = 4  # V rows per tile; `_accumulate_tile` spells out the four weights (p0..p3)
_FASTMATH = {"reassoc", "contract", "nsz"}  # lets the dot products vectorize; -inf must stay -inf
_PREFETCH_AHEAD = 8  # rows: each row, K and V, is asked for this many rows before its scores
_LOG2_E = np.float32(1.4426950408889634)


def sparse_decode_attention(pool: torch.Tensor, rows: torch.Tensor, q: torch.Tensor, scale: float,
                            num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """[B, Hq, D] in q's dtype: softmax((q . K) * scale) V over the pool rows rows[b, j] >= 0 of each request.

    pool [N, 2 * Hkv * D] float32 or bfloat16 (a row is K then V, heads in order, as the caches store
    them, contiguous); rows [B, L] int64, each -1 or a row of the pool; q [B, Hq, D] float32 or bfloat16 (any
    strides: the model's slice of its rotated heads) with Hq a multiple of Hkv (query head h reads KV head
    h // (Hq / Hkv)). A bfloat16 q is widened and the output rounded to bfloat16 (to nearest even, as `.to`
    does) inside the kernel: at one token the conversions around it cost more than the attention.
    """
    if pool.dtype not in (torch.float32, torch.bfloat16) or pool.dim() != 2 or not pool.is_contiguous():
        raise ValueError(f"the pool must be a contiguous 2-d float32 or bfloat16 tensor, got {pool.dim()}-d "
                         f"{pool.dtype}")
    batch, num_heads, dim = q.shape
    if rows.dtype != torch.int64 or rows.dim() != 2 or rows.shape[0] != batch:
        raise ValueError(f"rows must be [{batch}, L] int64 (one row per query), got {tuple(rows.shape)} {rows.dtype}")
    if dim != head_dim or num_heads % num_kv_heads or pool.shape[1] != 2 * num_kv_heads * head_dim:
        raise ValueError(f"q {tuple(q.shape)} and pool rows of {pool.shape[1]} do not fit {num_kv_heads} KV heads "
                         f"of {head_dim}")
    if q.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"q must be float32 or bfloat16, got {q.dtype}")
    group = num_heads // num_kv_heads
    raw = pool.view(torch.int16) if pool.dtype == torch.bfloat16 else pool
    # Every index in the loops is a loop variable of its own axis: numba then needs no negative-index fix-up,
    # and the loops over a head's dims vectorize (with `base + d` into flat rows they did not: 4x slower).
    flat = raw.numpy()  # [N, W], what the prefetch reads a row of
    words = flat.reshape(pool.shape[0], 2, num_kv_heads, head_dim)
    bfloat16_q = q.dtype == torch.bfloat16
    queries = (q.view(torch.int16) if bfloat16_q else q).numpy().reshape(batch, num_kv_heads, group, head_dim)
    out = np.empty((batch, num_kv_heads, group, head_dim), np.int16 if bfloat16_q else np.float32)
    index = rows.numpy()
    serial, parallel = _kernels(num_kv_heads, group, head_dim, pool.dtype == torch.bfloat16, bfloat16_q)
    kernel = parallel if index.size >= PARALLEL_MIN_ROWS else serial
    if not kernel(words, flat, index, queries, np.float32(scale), out):
        raise ValueError(f"rows must be -1 or in [0, {pool.shape[0]}), got {index.min()} .. {index.max()}")
    return torch.from_numpy(out).view(q.dtype).view(batch, num_heads, head_dim)


@njit(cache=True)
def _prefetch_row(flat, row, line):
    if row >= 0:  # -1: no row
        prefetch_row_to_l2(flat, row, line)


@njit(fastmath=_FASTMATH, cache=True)
def _softmax_numerators(scores, powers, powers_as_float):
    """scores[j] <- exp(scores[j] - max(scores)) in place; returns their sum. A -inf score (no row) gives
    exactly 0. powers (int32) and powers_as_float (the same memory as float32) are scratch of the same length.

    exp(y) = 2^x with x = y log2(e) = n + f, n an integer and f in [-1/2, 1/2]: 2^f is the degree-6 Taylor
    polynomial of exp(f ln 2) (error below 1.2e-7, float32's own rounding), 2^n a float32 built from its
    exponent bits (n + 127) << 23. x is clamped at -127, whose bits are those of 0.0. Every step is
    arithmetic LLVM vectorizes; the bits go through the int32 scratch because numba has no scalar bit cast.
    """
    top = np.float32(-np.inf)
    for j in range(scores.shape[0]):
        top = max(top, scores[j])
    for j in range(scores.shape[0]):
        x = max((scores[j] - top) * _LOG2_E, np.float32(-127.0))
        n = np.floor(x + np.float32(0.5))
        f = x - n
        p = np.float32(1.5403530393381606e-4)
        p = p * f + np.float32(1.3333558146428443e-3)
        p = p * f + np.float32(9.618129107628477e-3)
        p = p * f + np.float32(5.550410866482158e-2)
        p = p * f + np.float32(0.2402265069591007)
        p = p * f + np.float32(0.6931471805599453)
        scores[j] = p * f + np.float32(1.0)
        powers[j] = (np.int32(n) + 127) << 23
    total = np.float32(0.0)
    for j in range(scores.shape[0]):
        value = scores[j] * powers_as_float[j]
        scores[j] = value
        total += value
    return total


def _read_half(pool, bfloat16, row, which, tile, tile_bits, k):
    """K (which 0) or V (1) of pool row `row` into tile[k] [H, D] as float32; a `bfloat16` pool is int16 bits
    (tile_bits is the tile's memory as uint32). bfloat16 is a constant of the compiled code: tested at run
    time, it kept the loops below from vectorizing (the kernel took 1.6x as long)."""
    if bfloat16:
        for h in range(tile.shape[1]):
            for d in range(tile.shape[2]):
                tile_bits[k, h, d] = np.uint32(np.uint16(pool[row, which, h, d])) << 16
    else:
        for h in range(tile.shape[1]):
            for d in range(tile.shape[2]):
                tile[k, h, d] = pool[row, which, h, d]


@njit(cache=True)
def _rows_within(rows, num_rows):
    """Whether every entry of rows is -1 or a row below num_rows: the compiled loops check no index."""
    for b in range(rows.shape[0]):
        for j in range(rows.shape[1]):
            if rows[b, j] < -1 or rows[b, j] >= num_rows:
                return False
    return True


def _score_rows(pool, flat, bfloat16, rows, queries, scale, b, keys, key_bits, scores, line):
    """scores[h, g, j] <- (q_hg . K_j[h]) * scale for each of request b's rows j (-inf where rows[b, j] is -1);
    returns how many rows are valid. keys [1, H, D] float32 scratch, key_bits the same memory as uint32. Each row's
    K half is widened once and scored by every query head that shares it; every store is a plain scalar one
    (a tile of rows written to their scores at once compiled to scatters, half the kernel's time)."""
    num_kv_heads, group, length = scores.shape
    for j in range(min(_PREFETCH_AHEAD, length)):
        _prefetch_row(flat, rows[b, j], line)
    valid = 0
    for j in range(length):
        if j + _PREFETCH_AHEAD < length:
            _prefetch_row(flat, rows[b, j + _PREFETCH_AHEAD], line)
        r = rows[b, j]
        if r < 0:
            for h in range(num_kv_heads):
                for g in range(group):
                    scores[h, g, j] = -np.inf
            continue
        valid += 1
        _read_half(pool, bfloat16, r, 0, keys, key_bits, 0)
        for h in range(num_kv_heads):
            for g in range(group):
                s = np.float32(0.0)
                for d in range(keys.shape[2]):
                    s += queries[0, h, g, d] * keys[0, h, d]
                scores[h, g, j] = s * scale
    return valid


def _accumulate_tile(tile, weights, acc):
    """acc[h, g] += sum_k weights[h, g, k] V_k[h] over the tile's V halves (weight 0 for unused ones)."""
    for h in range(acc.shape[0]):
        for g in range(acc.shape[1]):
            p0 = weights[h, g, 0]
            p1 = weights[h, g, 1]
            p2 = weights[h, g, 2]
            p3 = weights[h, g, 3]
            for d in range(acc.shape[2]):
                acc[h, g, d] += p0 * tile[0, h, d] + p1 * tile[1, h, d] + p2 * tile[2, h, d] + p3 * tile[3, h, d]


def _attend_request(pool, flat, bfloat16, rows, raw_queries, bfloat16_q, scale, out, b, keys, tile, acc):
    """Request b's output. keys [1, H, D], tile [TILE_ROWS, H, D] and acc [H, G, D] are zeros from the caller,
    whose shapes are constants of the compiled code: every loop bound below is read from them. The tile must
    be zeros, not np.empty: a request with fewer rows than a tile leaves slots unwritten, and their weight 0
    times a NaN of uninitialized memory would be NaN. raw_queries and out: float32, or bfloat16 as int16 bits
    (bfloat16_q)."""
    num_kv_heads, group, _ = acc.shape
    length = rows.shape[1]
    queries = np.empty((1, num_kv_heads, group, acc.shape[2]), np.float32)  # request b's, widened
    query_bits = queries.view(np.uint32)
    for h in range(num_kv_heads):
        for g in range(group):
            for d in range(acc.shape[2]):
                if bfloat16_q:
                    query_bits[0, h, g, d] = np.uint32(np.uint16(raw_queries[b, h, g, d])) << 16
                else:
                    queries[0, h, g, d] = raw_queries[b, h, g, d]
    scores = np.empty((num_kv_heads, group, length), np.float32)
    valid = _score_rows(pool, flat, bfloat16, rows, queries, scale, b, keys, keys.view(np.uint32), scores,
                        line_step(flat))
    if valid == 0:
        out[b] = 0
        return
    totals = np.empty((num_kv_heads, group), np.float32)
    powers = np.empty(length, np.int32)
    powers_as_float = powers.view(np.float32)
    for h in range(num_kv_heads):
        for g in range(group):
            totals[h, g] = _softmax_numerators(scores[h, g], powers, powers_as_float)
    weights = np.zeros((num_kv_heads, group, TILE_ROWS), np.float32)
    tile_bits = tile.view(np.uint32)
    filled = 0
    for j in range(length):
        r = rows[b, j]
        if r < 0:
            continue
        _read_half(pool, bfloat16, r, 1, tile, tile_bits, filled)
        for h in range(num_kv_heads):
            for g in range(group):
                weights[h, g, filled] = scores[h, g, j]
        filled += 1
        if filled == TILE_ROWS:
            _accumulate_tile(tile, weights, acc)
            filled = 0
    if filled:
        for h in range(num_kv_heads):
            for g in range(group):
                for k in range(filled, TILE_ROWS):
                    weights[h, g, k] = 0.0
        _accumulate_tile(tile, weights, acc)
    acc_bits = acc.view(np.uint32)
    for h in range(num_kv_heads):
        for g in range(group):
            inverse = np.float32(1.0) / totals[h, g]
            for d in range(acc.shape[2]):
                acc[h, g, d] *= inverse
                if bfloat16_q:  # to nearest even: add half an ulp of bfloat16, less one unless the kept bit is odd
                    bits = acc_bits[h, g, d]
                    out[b, h, g, d] = np.int16(np.uint16((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16))
                else:
                    out[b, h, g, d] = acc[h, g, d]


# Inlined at numba's level into each driver below (which compile them with the same fastmath flags), where
# the scratch shapes are constants.
_read_half, _score_rows, _accumulate_tile, _attend_request = (
    njit(fastmath=_FASTMATH, cache=True, inline="always")(f)
    for f in (_read_half, _score_rows, _accumulate_tile, _attend_request))


@functools.cache
def _kernels(num_kv_heads: int, group: int, head_dim: int, bfloat16: bool, bfloat16_q: bool):
    """(serial, parallel) drivers for this head layout, pool dtype and query dtype, each returning False (having
    done nothing) when a row is out of range. They capture the layout as integer
    constants and hand `_attend_request` scratch of constant shape, from which LLVM (inlining it) learns every
    loop bound. Only integers and a bool are captured, so numba's disk cache finds them again (a closure that
    captures another compiled function gets a new cache key in every process, and is compiled anew each
    time)."""
    H, G, D, BF16, BF16_Q = num_kv_heads, group, head_dim, bfloat16, bfloat16_q

    # Serial and parallel drivers are separate functions: numba's disk cache keys compiled code by the Python
    # function and the argument types, not by `parallel`.
    @njit(fastmath=_FASTMATH, cache=True)
    def serial(pool, flat, rows, queries, scale, out):
        if not _rows_within(rows, pool.shape[0]):
            return False
        for b in range(rows.shape[0]):
            _attend_request(pool, flat, BF16, rows, queries, BF16_Q, scale, out, b, np.zeros((1, H, D), np.float32),
                            np.zeros((TILE_ROWS, H, D), np.float32), np.zeros((H, G, D), np.float32))
        return True

    @njit(fastmath=_FASTMATH, parallel=True, cache=True)
    def parallel(pool, flat, rows, queries, scale, out):
        if not _rows_within(rows, pool.shape[0]):
            return False
        for b in prange(rows.shape[0]):
            _attend_request(pool, flat, BF16, rows, queries, BF16_Q, scale, out, b, np.zeros((1, H, D), np.float32),
                            np.zeros((TILE_ROWS, H, D), np.float32), np.zeros((H, G, D), np.float32))
        return True

    return serial, parallel
