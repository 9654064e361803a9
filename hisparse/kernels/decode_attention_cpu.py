"""Decode attention straight from a pool of K/V rows, with numba: one query per request over its own rows.

A decode step's attention reads a few hundred rows per request (the top-k selection) scattered over the
pool. Gathering them into a dense tensor for SDPA writes them once more, and SDPA's CPU kernel is made for
long queries, not one query per request (isolated, with the caches flushed, gather + SDPA took 1.7-1.8 ms
for 16 requests x 257 bfloat16 rows, this kernel 0.9). Here each row is read where it lies, prefetched a
few rows ahead: its K half scored by the query heads that share its KV head, then its V half weighted into
the output, in float32; bfloat16 rows are widened as they are read (the top 16 bits of a float32). Two
engines stepping in turn, 1.5k context, top-256: a HiSparse step took 0.929x (batch 1) and 0.954x (batch
16) as long as with gather + SDPA; the baseline's at batch 4, 0.985x and 1.028x.

Rows whose index is -1 take no part; a request with none gets zeros.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from hisparse.kernels.numba_threads import choose_threading_layer
from hisparse.kernels.prefetch import line_step, prefetch_row_to_l2

choose_threading_layer()

# batch x rows from which requests run in parallel: at batch 16 and 257 rows a step took 0.957x as long with
# the parallel loop (two engines stepping in turn); the engine's other short parallel regions lost.
PARALLEL_MIN_ROWS = 4096
_FASTMATH = {"reassoc", "contract", "nsz"}  # lets the 64-wide dot products vectorize
_PREFETCH_AHEAD = 8  # rows: each row, K and V, is asked for this many rows before its scores


def sparse_decode_attention(pool: torch.Tensor, rows: torch.Tensor, q: torch.Tensor, scale: float,
                            num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """[B, Hq, D] in q's dtype: softmax((q . K) * scale) V over the pool rows rows[b, j] >= 0 of each request.

    pool [N, 2 * Hkv * D] float32 or bfloat16 (a row is K then V, heads in order, as the caches store
    them, contiguous); rows [B, L] int64, each -1 or a row of the pool; q [B, Hq, D] with Hq a multiple of
    Hkv (query head h reads KV head h // (Hq / Hkv)). The compiled loops check no index, so this does.
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
    group = num_heads // num_kv_heads
    raw = pool.view(torch.int16) if pool.dtype == torch.bfloat16 else pool
    # Every index below is a loop variable of its own axis: numba then needs no negative-index fix-up, and
    # the 64-wide loops over a head's dims vectorize (with `base + d` into flat rows they did not: 4x slower).
    flat = raw.numpy()  # [N, W], what the prefetch reads a row of
    words = flat.reshape(pool.shape[0], 2, num_kv_heads, head_dim)
    queries = q.to(torch.float32).contiguous().numpy().reshape(batch, num_kv_heads, group, head_dim)
    out = np.empty((batch, num_kv_heads, group, head_dim), np.float32)
    index = rows.numpy()
    if index.size and (index.max() >= pool.shape[0] or index.min() < -1):
        raise ValueError(f"rows must be -1 or in [0, {pool.shape[0]}), got {index.min()} .. {index.max()}")
    kernel = _attend_parallel if index.size >= PARALLEL_MIN_ROWS else _attend_serial
    kernel(words, flat, pool.dtype == torch.bfloat16, index, queries, np.float32(scale), out)
    return torch.from_numpy(out).view(batch, num_heads, head_dim).to(q.dtype)


@njit(cache=True, fastmath=_FASTMATH)
def _load_half(pool, bfloat16, row, which, dest):
    """K (which 0) or V (1) of pool row `row` as float32 [Hkv, D] into dest; a `bfloat16` pool is int16 bits."""
    if bfloat16:
        bits = dest.view(np.uint32)
        for h in range(dest.shape[0]):
            for d in range(dest.shape[1]):
                bits[h, d] = np.uint32(np.uint16(pool[row, which, h, d])) << 16
    else:
        for h in range(dest.shape[0]):
            for d in range(dest.shape[1]):
                dest[h, d] = pool[row, which, h, d]


@njit(cache=True, fastmath=_FASTMATH)
def _attend_request(pool, flat, bfloat16, rows, queries, scale, out, b):
    _, num_kv_heads, group, dim = queries.shape
    length = rows.shape[1]
    scores = np.empty((num_kv_heads, group, length), np.float32)
    half = np.empty((num_kv_heads, dim), np.float32)
    line = line_step(flat)
    for j in range(min(_PREFETCH_AHEAD, length)):
        _prefetch_row(flat, rows[b, j], line)
    valid = 0
    for j in range(length):
        if j + _PREFETCH_AHEAD < length:
            _prefetch_row(flat, rows[b, j + _PREFETCH_AHEAD], line)
        r = rows[b, j]
        if r < 0:
            continue
        valid += 1
        _load_half(pool, bfloat16, r, 0, half)
        for h in range(num_kv_heads):
            for g in range(group):
                s = np.float32(0.0)
                for d in range(dim):
                    s += queries[b, h, g, d] * half[h, d]
                scores[h, g, j] = s * scale
    acc = np.zeros((num_kv_heads, group, dim), np.float32)
    if valid == 0:
        out[b] = acc
        return
    top = np.full((num_kv_heads, group), -np.inf, np.float32)
    for j in range(length):
        if rows[b, j] >= 0:
            for h in range(num_kv_heads):
                for g in range(group):
                    top[h, g] = max(top[h, g], scores[h, g, j])
    total = np.zeros((num_kv_heads, group), np.float32)
    for h in range(num_kv_heads):
        for g in range(group):
            for j in range(length):
                p = np.exp(scores[h, g, j] - top[h, g]) if rows[b, j] >= 0 else np.float32(0.0)
                scores[h, g, j] = p
                total[h, g] += p
    for j in range(length):
        r = rows[b, j]
        if r < 0:
            continue
        _load_half(pool, bfloat16, r, 1, half)
        for h in range(num_kv_heads):
            for g in range(group):
                p = scores[h, g, j]
                for d in range(dim):
                    acc[h, g, d] += p * half[h, d]
    for h in range(num_kv_heads):
        for g in range(group):
            for d in range(dim):
                out[b, h, g, d] = acc[h, g, d] / total[h, g]


@njit(cache=True)
def _prefetch_row(flat, row, line):
    if row >= 0:  # -1: no row
        prefetch_row_to_l2(flat, row, line)


# Serial and parallel variants are separate functions: numba's disk cache keys compiled code by the Python
# function and the argument types, not by `parallel`.
@njit(cache=True)
def _attend_serial(pool, flat, bfloat16, rows, queries, scale, out):
    for b in range(rows.shape[0]):
        _attend_request(pool, flat, bfloat16, rows, queries, scale, out, b)


@njit(parallel=True, cache=True)
def _attend_parallel(pool, flat, bfloat16, rows, queries, scale, out):
    for b in prange(rows.shape[0]):
        _attend_request(pool, flat, bfloat16, rows, queries, scale, out, b)
