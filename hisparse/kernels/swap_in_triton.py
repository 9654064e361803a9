"""Swap-in as a Triton kernel: one program per request, like the reference system's one CUDA block.

The reference builds a hash set of the top-k positions in shared memory. Here the membership tests are
a sparse set instead, which needs no hashing and no initialisation: a per-request scratch vector
`lookup[C]` (uninitialised memory) gets `lookup[slot_pos[s]] = s` for every occupied slot; a selected
position p is a hit iff `s = lookup[p]` is a slot index and `slot_pos[s] == p`, so stale garbage can
never produce a false hit. Everything else is vector work over the S slots and K columns of one block:
flags, exclusive prefix sums (ranks of evictables, hits and misses) and scatters, separated by
barriers where a phase reads what another lane wrote. The program then copies its own missed rows,
one row at a time in vectors of raw words (any dtype, bfloat16 included).

Policies: lru and fifo (clock's sequential hand sweep does not map onto a block; use the cpu or the
reference backend). On CUDA, `host_kv` may be pinned host memory: the loads read it directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hisparse.kernels.swap_in import TRITON_POLICIES, SwapInResult
from hisparse.memory.eviction import EvictionPolicy, resolve_policy


def swap_in_triton(top_k: torch.Tensor, rows: torch.Tensor, slot_pos: torch.Tensor, lru: torch.Tensor,
                   device_rows: torch.Tensor, host_rows: torch.Tensor, host_kv: torch.Tensor,
                   device_kv: torch.Tensor, *, policy: str | EvictionPolicy = "lru") -> SwapInResult:
    policy = resolve_policy(policy)
    if policy.name not in TRITON_POLICIES:
        raise ValueError(f"the triton swap-in backend implements {', '.join(TRITON_POLICIES)}, "
                         f"not {policy.name!r}")
    batch, width = top_k.shape
    num_slots = slot_pos.shape[1]
    context = host_rows.shape[1]
    device = top_k.device
    page_table = torch.empty((batch, width), dtype=torch.int64, device=device)
    misses = torch.empty(batch, dtype=torch.int32, device=device)
    evictions = torch.empty(batch, dtype=torch.int32, device=device)
    if batch == 0:
        return SwapInResult(page_table, misses, evictions)
    block_s = triton.next_power_of_2(num_slots)
    block_k = triton.next_power_of_2(max(width, 1))
    host_words = _as_words(host_kv)
    device_words = _as_words(device_kv)
    words = host_words.shape[1]
    lookup = torch.empty((batch, context), dtype=torch.int32, device=device)
    hit_flags = torch.empty((batch, block_s), dtype=torch.int32, device=device)
    by_rank = torch.empty((batch, block_s), dtype=torch.int32, device=device)
    miss_src = torch.empty((batch, block_k), dtype=torch.int64, device=device)
    miss_dst = torch.empty((batch, block_k), dtype=torch.int64, device=device)
    _swap_in_kernel[(batch,)](
        top_k, rows, slot_pos, lru, device_rows, host_rows, host_words, device_words,
        page_table, misses, evictions, lookup, hit_flags, by_rank, miss_src, miss_dst,
        width, num_slots, context, words,
        FIFO=policy.name == "fifo", BLOCK_K=block_k, BLOCK_S=block_s,
        BLOCK_W=min(triton.next_power_of_2(words), 1024),
    )
    return SwapInResult(page_table, misses, evictions)


def _as_words(kv: torch.Tensor) -> torch.Tensor:
    """[rows, W] of any dtype as [rows, n] of the widest signed integer dividing the row size."""
    raw = kv.view(torch.uint8)
    for word in (torch.int64, torch.int32, torch.int16):
        if raw.shape[1] % word.itemsize == 0:
            return raw.view(word)
    return raw.view(torch.int8)


@triton.jit
def _swap_in_kernel(top_k_ptr, rows_ptr, slot_pos_ptr, lru_ptr, device_rows_ptr, host_rows_ptr,
                    host_ptr, device_ptr, page_table_ptr, misses_ptr, evictions_ptr,
                    lookup_ptr, hit_ptr, by_rank_ptr, miss_src_ptr, miss_dst_ptr,
                    K, S, C, WORDS,
                    FIFO: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_W: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + b)
    slots = tl.arange(0, BLOCK_S)
    in_s = slots < S
    cols = tl.arange(0, BLOCK_K)
    in_k = cols < K

    # Sparse set position -> slot, and cleared hit flags.
    pos = tl.load(slot_pos_ptr + r * S + slots, mask=in_s, other=-1)
    tl.store(lookup_ptr + b * C + pos, slots, mask=pos >= 0)
    tl.store(hit_ptr + b * BLOCK_S + slots, tl.zeros([BLOCK_S], dtype=tl.int32))
    tl.debug_barrier()

    # Hits per column; flag their slots.
    sel = tl.load(top_k_ptr + b * K + cols, mask=in_k, other=-1)
    valid = sel >= 0
    cand = tl.load(lookup_ptr + b * C + sel, mask=valid, other=-1)
    cand_ok = valid & (cand >= 0) & (cand < S)
    cand_pos = tl.load(slot_pos_ptr + r * S + cand, mask=cand_ok, other=-1)
    is_hit = cand_ok & (cand_pos == sel)
    hit_slot = tl.where(is_hit, cand, -1)
    tl.store(hit_ptr + b * BLOCK_S + cand, tl.full([BLOCK_K], 1, dtype=tl.int32), mask=is_hit)
    tl.debug_barrier()

    # Walk the order: rank the evictables (oldest first) and the hits.
    order = tl.load(lru_ptr + r * S + slots, mask=in_s, other=0)
    hit_o = tl.load(hit_ptr + b * BLOCK_S + order, mask=in_s, other=0)
    ev_i = (in_s & (hit_o == 0)).to(tl.int32)
    hit_i = (in_s & (hit_o != 0)).to(tl.int32)
    ev_rank = tl.cumsum(ev_i, 0) - ev_i
    hit_rank = tl.cumsum(hit_i, 0) - hit_i
    n_ev = tl.sum(ev_i, 0)
    tl.store(by_rank_ptr + b * BLOCK_S + ev_rank, order, mask=ev_i != 0)
    tl.debug_barrier()

    # The i-th miss (column order) takes the i-th evictable.
    miss_i = (valid & (hit_slot < 0)).to(tl.int32)
    miss = miss_i != 0
    miss_rank = tl.cumsum(miss_i, 0) - miss_i
    n_miss = tl.sum(miss_i, 0)
    victim = tl.load(by_rank_ptr + b * BLOCK_S + miss_rank, mask=miss, other=0)
    old = tl.load(slot_pos_ptr + r * S + victim, mask=miss, other=-1)
    n_evict = tl.sum((miss & (old >= 0)).to(tl.int32), 0)
    tl.store(slot_pos_ptr + r * S + victim, sel.to(tl.int32), mask=miss)
    slot = tl.where(miss, victim, hit_slot)
    dev_row = tl.load(device_rows_ptr + r * S + slot, mask=valid, other=-1)
    tl.store(page_table_ptr + b * K + cols, tl.where(valid, dev_row, -1), mask=in_k)
    src = tl.load(host_rows_ptr + r * C + sel, mask=miss, other=0)
    tl.store(miss_src_ptr + b * BLOCK_K + miss_rank, src, mask=miss)
    tl.store(miss_dst_ptr + b * BLOCK_K + miss_rank, dev_row, mask=miss)
    tl.store(misses_ptr + b, n_miss)
    tl.store(evictions_ptr + b, n_evict)

    # The new order (every lane loaded `order` before the last barrier).
    ev = ev_i != 0
    if FIFO:
        loaded = ev & (ev_rank < n_miss)
        keep_i = (in_s & (loaded == 0)).to(tl.int32)
        new_index = tl.where(loaded, S - n_miss + ev_rank, tl.cumsum(keep_i, 0) - keep_i)
    else:
        new_index = tl.where(ev, tl.where(ev_rank >= n_miss, ev_rank - n_miss, n_ev - n_miss + ev_rank),
                             n_ev + hit_rank)
    tl.store(lru_ptr + r * S + new_index, order, mask=in_s)
    tl.debug_barrier()

    # Copy this request's missed rows.
    offs = tl.arange(0, BLOCK_W)
    for i in range(n_miss):
        s_row = tl.load(miss_src_ptr + b * BLOCK_K + i)
        d_row = tl.load(miss_dst_ptr + b * BLOCK_K + i)
        for w0 in range(0, WORDS, BLOCK_W):
            m = w0 + offs < WORDS
            x = tl.load(host_ptr + s_row * WORDS + w0 + offs, mask=m)
            tl.store(device_ptr + d_row * WORDS + w0 + offs, x, mask=m)
