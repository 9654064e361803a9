"""Swap-in as a Triton kernel: one program per request, like the reference system's one CUDA block.

The reference builds a hash set of the top-k positions in shared memory. Here the membership tests are
a sparse set instead, which needs no hashing and no initialisation: a per-request scratch vector
`lookup[C]` (uninitialised memory) gets `lookup[slot_pos[s]] = s` for every occupied slot; a selected
position p is a hit iff `s = lookup[p]` is a slot index and `slot_pos[s] == p`, so stale garbage can
never produce a false hit. Everything else is vector work over the S slots and K columns of one block:
flags, exclusive prefix sums (ranks of evictables, hits and misses) and scatters, separated by
barriers where a phase reads what another lane wrote. The program then copies its own missed rows,
one row at a time in vectors of raw words (any dtype, bfloat16 included).

Policies: lru, fifo, score_lru and lrfu (clock's sequential hand sweep does not map onto a block; use
the cpu or the reference backend). score_lru's two stable sorts by age (victims among the evictables, then
the new order) are one `tl.sort` each over packed keys `(AGE_LIMIT - age) << 20 | index`: the index makes
every key distinct, so the sort is stable and its low bits say where each entry came from. Its next-ranked
positions are found with the same sparse set as the selected ones; a position listed twice keeps its best
rank (`atomic_min`). lrfu's victims are one such sort, by decayed value plus its next-rank credit
(`key << 20 | index`, the ranks found the same way), and its new order is LRU's. Its ghosts (recently
evicted positions) share the sparse set: `lookup[p] = S + entry` is written first, so a held position's
slot overwrites it, and a missed position is a ghost iff the entry read there lists it; the new ghost
list is two compactions (survivors, then the evicted in miss order) by prefix sums. On CUDA, `host_kv` may be
pinned host memory: the loads read it directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hisparse.formats.kernel_policy import KernelPolicy
from hisparse.kernels.swap_in import TRITON_POLICIES, SwapInResult, kernel_scalars


def swap_in_triton(top_k: torch.Tensor, rows: torch.Tensor, slot_pos: torch.Tensor, lru: torch.Tensor,
                   device_rows: torch.Tensor, host_rows: torch.Tensor, host_kv: torch.Tensor,
                   device_kv: torch.Tensor, *, policy: KernelPolicy = KernelPolicy("lru"),
                   next_ranked: torch.Tensor | None = None) -> SwapInResult:
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
    hits = torch.empty(batch, dtype=torch.int32, device=device)
    if batch == 0:
        return SwapInResult(page_table, misses, evictions, hits)
    score_lru, lrfu = policy.name == "score_lru", policy.name == "lrfu"
    sorts = score_lru or lrfu
    if sorts and num_slots >= _INDEX_LIMIT:
        raise ValueError(f"the triton {policy.name} swap-in packs slot indices in 20 bits; "
                         f"{num_slots} slots is too many")
    if next_ranked is None or not sorts:
        next_ranked = torch.empty((batch, 0), dtype=torch.int64, device=device)
    num_next = next_ranked.shape[1]
    age = torch.zeros((1, 1), dtype=torch.int32, device=device) if policy.values is None else policy.values
    ghost_pos, ghost_value = (policy.ghost_pos, policy.ghost_value) if policy.ghost_pos is not None else (
        torch.full((1, 1), -1, dtype=torch.int32, device=device), torch.zeros((1, 1), dtype=torch.int32, device=device))
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
    # score_lru's and lrfu's scratch: each slot's best next rank, its aged age (lrfu: decayed value), and
    # each entry's place after a sort
    touch = torch.empty((batch, block_s) if sorts else (1, 1), dtype=torch.int32, device=device)
    aged = torch.empty((batch, block_s) if sorts else (1, 1), dtype=torch.int32, device=device)
    placed = torch.empty((batch, block_s) if sorts else (1, 1), dtype=torch.int32, device=device)
    returned = torch.empty((batch, block_s) if lrfu else (1, 1), dtype=torch.int32, device=device)  # lrfu's ghosts
    _swap_in_kernel[(batch,)](
        top_k, rows, slot_pos, lru, device_rows, host_rows, host_words, device_words,
        page_table, misses, evictions, hits, lookup, hit_flags, by_rank, miss_src, miss_dst,
        next_ranked, age, touch, aged, placed, ghost_pos, ghost_value, returned,
        width, num_slots, context, words, num_next,
        *kernel_scalars(policy),
        FIFO=policy.name == "fifo", SCORE_LRU=score_lru, LRFU=lrfu, SORTS=sorts, BLOCK_K=block_k, BLOCK_S=block_s,
        BLOCK_M=triton.next_power_of_2(max(num_next, 1)), BLOCK_W=min(triton.next_power_of_2(words), 1024),
    )
    return SwapInResult(page_table, misses, evictions, hits)


_INDEX_BITS = 20
_INDEX_LIMIT = 1 << _INDEX_BITS


def _as_words(kv: torch.Tensor) -> torch.Tensor:
    """[rows, W] of any dtype as [rows, n] of the widest signed integer dividing the row size."""
    raw = kv.view(torch.uint8)
    for word in (torch.int64, torch.int32, torch.int16):
        if raw.shape[1] % word.itemsize == 0:
            return raw.view(word)
    return raw.view(torch.int8)


@triton.jit
def _swap_in_kernel(top_k_ptr, rows_ptr, slot_pos_ptr, lru_ptr, device_rows_ptr, host_rows_ptr,
                    host_ptr, device_ptr, page_table_ptr, misses_ptr, evictions_ptr, hits_ptr,
                    lookup_ptr, hit_ptr, by_rank_ptr, miss_src_ptr, miss_dst_ptr,
                    next_ptr, age_ptr, touch_ptr, aged_ptr, placed_ptr, ghost_pos_ptr, ghost_value_ptr, returned_ptr,
                    K, S, C, WORDS, M, CONST0, CONST1, CONST2, CONST3, CONST4, CONST5,
                    FIFO: tl.constexpr, SCORE_LRU: tl.constexpr, LRFU: tl.constexpr, SORTS: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    # The policy's constants as `kernel_scalars` orders them: score_lru's (touch_age_per_rank, load_age_steps,
    # age_limit, 0, 0, 0), lrfu's (hit, decay_shift, rank_bonus, ranks_per_top_k, ghost_decay_shift,
    # ghost_weight_quarters). `age_ptr` is its `values`: score_lru's ages, lrfu's counts; `ghost_*_ptr` lrfu's ghosts.
    touch_age_per_rank = CONST0
    load_age_steps = CONST1
    age_limit = CONST2
    hit = CONST0
    decay_shift = CONST1
    rank_bonus = CONST2
    ranks_per_top_k = CONST3
    ghost_shift = CONST4
    ghost_quarters = CONST5
    b = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + b)
    slots = tl.arange(0, BLOCK_S)
    in_s = slots < S
    cols = tl.arange(0, BLOCK_K)
    in_k = cols < K

    # Sparse set position -> slot (lrfu: position -> S + ghost entry first, which a held position's slot
    # then overwrites), and cleared hit flags.
    if LRFU:
        ghost_p = tl.load(ghost_pos_ptr + r * S + slots, mask=in_s, other=-1)
        tl.store(lookup_ptr + b * C + ghost_p, slots + S, mask=ghost_p >= 0)
        tl.store(returned_ptr + b * BLOCK_S + slots, tl.zeros([BLOCK_S], dtype=tl.int32))
        tl.debug_barrier()
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
    big = tl.full([BLOCK_S], 9223372036854775807, dtype=tl.int64)
    if SORTS:
        # Each slot's best next rank (1 for the first runner-up; int32 max: not ranked).
        tl.store(touch_ptr + b * BLOCK_S + slots, tl.full([BLOCK_S], 2147483647, dtype=tl.int32))
        tl.debug_barrier()
        ncols = tl.arange(0, BLOCK_M)
        nxt = tl.load(next_ptr + b * M + ncols, mask=ncols < M, other=-1)
        n_ok = nxt >= 0
        n_cand = tl.load(lookup_ptr + b * C + nxt, mask=n_ok, other=-1)
        n_ok = n_ok & (n_cand >= 0) & (n_cand < S)
        n_pos = tl.load(slot_pos_ptr + r * S + n_cand, mask=n_ok, other=-1)
        n_ok = n_ok & (n_pos == nxt)
        tl.atomic_min(touch_ptr + b * BLOCK_S + n_cand, (ncols + 1).to(tl.int32), mask=n_ok)
        tl.debug_barrier()
    if SCORE_LRU:
        # Age every slot a step; a next-ranked position looks as young as its rank says.
        unit = tl.maximum(K, 1)  # ages count in 1/K of a step
        spare = tl.maximum(S - K, 0)
        old_age = tl.load(age_ptr + r * S + slots, mask=in_s, other=0)
        age_s = tl.minimum(old_age.to(tl.int64) + unit, age_limit)
        rank_s = tl.load(touch_ptr + b * BLOCK_S + slots)
        touch_age = rank_s.to(tl.int64) * touch_age_per_rank * spare // unit
        age_s = tl.where(rank_s < 2147483647, tl.minimum(age_s, touch_age), age_s)
        tl.store(aged_ptr + b * BLOCK_S + slots, age_s.to(tl.int32), mask=in_s)
        tl.debug_barrier()
        state_o = tl.load(aged_ptr + b * BLOCK_S + order, mask=in_s, other=0).to(tl.int64)
        sort_key = (age_limit - state_o) << 20  # the oldest first
    elif LRFU:
        # Decay every count a step; the sort key credits a next-ranked position by its rank.
        old_value = tl.load(age_ptr + r * S + slots, mask=in_s, other=0)
        tl.store(aged_ptr + b * BLOCK_S + slots, old_value - (old_value >> decay_shift), mask=in_s)
        # No `.to()` on the constants: Triton passes an integer argument equal to 1 as a constexpr, which has
        # none; the int64 ranks make the products int64.
        span = ranks_per_top_k * tl.maximum(K, 1)
        rank_s = tl.load(touch_ptr + b * BLOCK_S + slots).to(tl.int64)
        credit = tl.where(rank_s <= span, rank_bonus * (span - (rank_s - 1)) // span, 0)
        tl.store(placed_ptr + b * BLOCK_S + slots, credit.to(tl.int32), mask=in_s)  # placed: free until the sort
        tl.debug_barrier()
        state_o = tl.load(aged_ptr + b * BLOCK_S + order, mask=in_s, other=0).to(tl.int64)
        credit_o = tl.load(placed_ptr + b * BLOCK_S + order, mask=in_s, other=0).to(tl.int64)
        tl.debug_barrier()  # every lane has read its credit before the sort reuses `placed`
        sort_key = (state_o + credit_o) << 20  # the lowest credited count first
    if SORTS:
        # Evictables by key, ties in order: one sort of keys that carry the order index.
        key = tl.sort(tl.where(ev_i != 0, sort_key | slots.to(tl.int64), big), 0)
        from_index = (key & 1048575).to(tl.int32)  # the order index of the entry sorted to this place
        sorted_ok = slots < n_ev
        tl.store(by_rank_ptr + b * BLOCK_S + slots, tl.load(lru_ptr + r * S + from_index, mask=sorted_ok, other=0),
                 mask=sorted_ok)
        tl.store(placed_ptr + b * BLOCK_S + from_index, slots, mask=sorted_ok)
    else:
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
    if LRFU:
        # A missed position that is a ghost returns: its slot starts at HIT + its decayed ghost value x
        # weight (at most HIT << DECAY_SHIFT), kept in `touch` (free since the sort) for the new state.
        ghost_i = cand - S
        returns = miss & (ghost_i >= 0) & (ghost_i < S)
        returns = returns & (tl.load(ghost_pos_ptr + r * S + ghost_i, mask=returns, other=-1) == sel)
        ghost_v = tl.load(ghost_value_ptr + r * S + ghost_i, mask=returns, other=0)
        credit_g = ghost_quarters * (ghost_v - (ghost_v >> ghost_shift)).to(tl.int64) // 4
        loaded_v = tl.minimum(hit + credit_g, hit << decay_shift)
        tl.store(touch_ptr + b * BLOCK_S + victim, loaded_v.to(tl.int32), mask=miss)
        tl.store(returned_ptr + b * BLOCK_S + ghost_i, tl.full([BLOCK_K], 1, dtype=tl.int32), mask=returns)
    slot = tl.where(miss, victim, hit_slot)
    dev_row = tl.load(device_rows_ptr + r * S + slot, mask=valid, other=-1)
    tl.store(page_table_ptr + b * K + cols, tl.where(valid, dev_row, -1), mask=in_k)
    src = tl.load(host_rows_ptr + r * C + sel, mask=miss, other=0)
    tl.store(miss_src_ptr + b * BLOCK_K + miss_rank, src, mask=miss)
    tl.store(miss_dst_ptr + b * BLOCK_K + miss_rank, dev_row, mask=miss)
    tl.store(misses_ptr + b, n_miss)
    tl.store(evictions_ptr + b, n_evict)
    tl.store(hits_ptr + b, tl.sum((valid & (hit_slot >= 0)).to(tl.int32), 0))

    # The new order (every lane loaded `order` before the last barrier).
    ev = ev_i != 0
    if SORTS:
        # LRU's new order: untouched evictables, loaded in miss order, hits.
        tl.debug_barrier()  # every lane has read its victim from by_rank, which score_lru reuses below
        victim_rank = tl.load(placed_ptr + b * BLOCK_S + slots, mask=ev, other=0)
        victim_o = ev & (victim_rank < n_miss)
        kept_i = (ev & (victim_rank >= n_miss)).to(tl.int32)
        base_index = tl.where(victim_o, n_ev - n_miss + victim_rank,
                              tl.where(ev, tl.cumsum(kept_i, 0) - kept_i, n_ev + hit_rank))
        if SCORE_LRU:  # ... stably sorted by new age
            new_state = tl.where(ev, tl.where(victim_o, tl.minimum(load_age_steps * tl.maximum(K, 1), age_limit),
                                              state_o), 0)
            tl.store(age_ptr + r * S + order, new_state.to(tl.int32), mask=in_s)
            tl.store(by_rank_ptr + b * BLOCK_S + base_index, order, mask=in_s)
            key = tl.where(in_s, ((age_limit - new_state) << 20) | base_index.to(tl.int64), big)
            key = tl.sort(key, 0)
            tl.debug_barrier()
            new_slot = tl.load(by_rank_ptr + b * BLOCK_S + (key & 1048575).to(tl.int32), mask=in_s, other=0)
            tl.store(lru_ptr + r * S + slots, new_slot, mask=in_s)
        else:  # lrfu, as it is: a hit adds one selection, a loaded slot starts at one (a ghost's more)
            loaded_o = tl.load(touch_ptr + b * BLOCK_S + order, mask=victim_o, other=0)
            new_state = tl.where(victim_o, loaded_o, tl.where(ev, state_o, state_o + hit))
            tl.store(age_ptr + r * S + order, new_state.to(tl.int32), mask=in_s)
            tl.store(lru_ptr + r * S + base_index, order, mask=in_s)
            # The ghosts: the surviving ones (decayed, the oldest first), then this step's evicted in miss
            # order with their decayed values; the last S kept, empty entries at the front.
            ghost_v_old = tl.load(ghost_value_ptr + r * S + slots, mask=in_s, other=0)
            was_returned = tl.load(returned_ptr + b * BLOCK_S + slots)
            kept_i = (in_s & (ghost_p >= 0) & (was_returned == 0)).to(tl.int32)
            n_kept = tl.sum(kept_i, 0)
            evicted = miss & (old >= 0)
            evicted_i = evicted.to(tl.int32)
            evicted_v = tl.load(aged_ptr + b * BLOCK_S + victim, mask=evicted, other=0)
            first = S - (n_kept + n_evict)  # where the list starts; entries before it fall off
            kept_at = first + tl.cumsum(kept_i, 0) - kept_i
            evicted_at = first + n_kept + tl.cumsum(evicted_i, 0) - evicted_i
            tl.debug_barrier()  # every lane has read the old ghosts
            tl.store(ghost_pos_ptr + r * S + slots, tl.full([BLOCK_S], -1, dtype=tl.int32), mask=in_s & (slots < first))
            tl.store(ghost_value_ptr + r * S + slots, tl.zeros([BLOCK_S], dtype=tl.int32), mask=in_s & (slots < first))
            kept = (kept_i != 0) & (kept_at >= 0)
            tl.store(ghost_pos_ptr + r * S + kept_at, ghost_p, mask=kept)
            tl.store(ghost_value_ptr + r * S + kept_at, ghost_v_old - (ghost_v_old >> ghost_shift), mask=kept)
            evicted = evicted & (evicted_at >= 0)
            tl.store(ghost_pos_ptr + r * S + evicted_at, old, mask=evicted)
            tl.store(ghost_value_ptr + r * S + evicted_at, evicted_v, mask=evicted)
    elif FIFO:
        loaded = ev & (ev_rank < n_miss)
        keep_i = (in_s & (loaded == 0)).to(tl.int32)
        new_index = tl.where(loaded, S - n_miss + ev_rank, tl.cumsum(keep_i, 0) - keep_i)
        tl.store(lru_ptr + r * S + new_index, order, mask=in_s)
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
