"""Swap-in on the CPU with numba: the reference's rules, at memory speed.

Two parallel phases. Bookkeeping plans one request at a time on each thread; each request finds its
hits with a sparse set, as the Triton kernel does: the thread's scratch `lookup[position] = slot` for the
slots the request holds, a selected position being a hit iff the slot read there holds it, so the
scratch is never cleared and a step costs O(S + K) per request whatever the context (lrfu's ghosts are
in it too, as S + their entry, written first so that a held position's slot wins). (Against an
open-addressing hash set of the top-k, 8x its size, built and probed per request: batch 64, calls
alternating, 0.88-0.92x the time at 0% and 20% misses, the same at 100%, where the misses' own work
dominates.) The
copies then run over all misses of the batch at once (chunks of the flattened miss list, in the same
parallel call), so a batch whose misses sit in one request still uses every core, and each row is
prefetched into L2 a few rows before its copy (`prefetch`): at batch 64 and 100% misses, these two and
the missed host rows read in a loop of their own took a call from 2.69 to 1.95 ms, measured side by
side. Threads claim requests and chunks one at a time (`work_claim`) instead of taking numba's fixed
shares, because the second thread often wakes late. Rows are copied as raw machine words
(the widest unsigned integer dividing the row size), which handles every dtype, bfloat16 included,
and lets the compiler emit plain wide loads and stores. (Copying each row as its slot is picked, in the
bookkeeping loop, was 1.3-1.6x slower at 100% misses: the scattered loads stall the bookkeeping, while
a tight copy loop keeps many rows in flight.) A copy big enough for the parallel loop stores its rows
past the caches when they are whole, aligned cache lines (`streaming_store`), as a large memcpy does:
calls alternating with ordinary stores, 41 each, 1 GiB host pool, took 0.78x the time at batch 64 and 100%
misses in bfloat16, 0.84x at batch 16, 0.65x in float32, 0.88x at batch 64 and 20% misses. In the engine
it changes little: a batch-32 HiSparse step (1k contexts, about 1 MiB of misses a layer; two engines
stepping in turn, 40 steps each, two runs) took 155.5 and 135.6 ms against 153.6 and 134.4 ms with ordinary
stores, its swap-in 0.95x and 0.93x the time, since the layer's attention then reads the new rows from
memory instead of the caches. A smaller copy, on the calling thread, keeps ordinary stores.

`BoundCpuSwapIn.page_table` is the same plan and copy with the decode step's newest position handled
inside (read from its reserved row, never swapped) and the batch's totals added inside, so a layer's
swap-in is one compiled call: in the engine each torch or numpy op around it runs on caches the layer's
weights have just flushed (about 10 us apiece), and the masking, the totals and the merge of the
reserved rows were more than half of HiSparse's time per layer at batch 1. For lru, the CPU's default, that
call is C's where gcc built it (`lru_page_table_cpu`, the same rule): this plan's dispatch and code were most of
what was left.

All arrays are zero-copy numpy views of the caller's tensors; `slot_pos`, `lru`, the policy state and
`device_kv` are written in place.

Small steps (few requests, few missed bytes) run the same loops on the calling thread: waking a
thread pool costs more than they do. Which pool runs the parallel loops matters on a busy machine: see
`numba_threads`.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch
from numba import njit, prange

from hisparse.formats.kernel_policy import KernelPolicy
from hisparse.kernels import lru_page_table_cpu
from hisparse.kernels.numba_threads import on_torch_team
from hisparse.kernels.prefetch import line_step, prefetch_row_to_l2, prefetch_to_l2
from hisparse.kernels.streaming_store import copy_row_past_caches, rows_can_stream, store_fence
from hisparse.kernels.swap_in import (
    NEXT_RANKED_OUT_OF_RANGE,
    POSITION_OUT_OF_RANGE,
    ROW_OUT_OF_RANGE,
    ROW_TWICE,
    TOO_MANY_SELECTED,
    SwapInResult,
    kernel_scalars,
    raise_value_error,
)
from hisparse.kernels.work_claim import claim

POLICY_CODES = {"lru": 0, "fifo": 1, "clock": 2, "score_lru": 3, "lrfu": 4}
_LRU, _FIFO, _CLOCK, _SCORE_LRU, _LRFU = 0, 1, 2, 3, 4
# Below these sizes a parallel region costs more than it saves (tens of microseconds to wake the
# workers, milliseconds on a loaded machine), so small steps run on the calling thread. On torch's own OpenMP
# team (numba_threads), measured in the engine by an ad-hoc script (one engine, 1.5k contexts, top_k 256, hot
# buffer 300, the variants taking turns step by step, medians of 60 steps): planning in parallel from batch
# 16 up, with top-k in parallel too, made a batch-16 step 2-5% faster in three runs (129.2 vs 136.5, 155.7 vs
# 162.3, 139.9 vs 142.9 ms); at batch 4 and 8 a parallel plan was 0-3% slower. On TBB, batch 16 and 32 (about
# 10% misses) planned faster on one thread: a layer's swap-in took 146 / 193 / 141 us planned serially against
# 152 / 219 / 205 us in parallel (two engines stepping in turn, three runs), so there only batch 64 plans in
# parallel.
PARALLEL_MIN_SELECTED = 4096 if on_torch_team() else 16384  # batch x top_k
PARALLEL_MIN_BYTES = 1 << 20  # bytes of missed rows
# The same, for the copies of a parallel plan: its threads are awake, so splitting a smaller copy over them costs
# no wake-up. At batch 16 (1.5k contexts, about 16% misses: 0.5 MiB a layer) the engine's step took 0.944x the time
# with 64 KiB here as with 1 MiB, 0.958x in a second run, 0.969x at batch 32 (the two taking turns every 6 steps,
# medians of 16).
PARALLEL_PLAN_COPY_MIN_BYTES = 1 << 16
_NO_REFERENCED = torch.zeros((1, 1), dtype=torch.int8)  # stands for a state the policy does not have
_NO_AGE = torch.zeros((1, 1), dtype=torch.int32)
_NO_GHOSTS = (torch.full((1, 1), -1, dtype=torch.int32), torch.zeros((1, 1), dtype=torch.int32))
_NO_RANKS = np.empty((0, 0), np.int64)  # next_ranked of a policy that reads none (any batch: M = 0)
_NOT_A_POSITION = -2  # the "newest position" of a plain swap-in call: matches no selection, not even padding
_PREFETCH_AHEAD = 8  # rows; 4 and 16 did as well
_COPY_CHUNK = 256  # rows per claimed chunk of a parallel copy: many per thread, so the threads finish together


def swap_in_cpu(top_k: torch.Tensor, rows: torch.Tensor, slot_pos: torch.Tensor, lru: torch.Tensor,
                device_rows: torch.Tensor, host_rows: torch.Tensor, host_kv: torch.Tensor,
                device_kv: torch.Tensor, *, policy: KernelPolicy = KernelPolicy("lru"),
                next_ranked: torch.Tensor | None = None) -> SwapInResult:
    return BoundCpuSwapIn(slot_pos, lru, device_rows, host_rows, host_kv, device_kv, policy)(top_k, rows, next_ranked)


class BoundCpuSwapIn:
    """`swap_in_cpu` for one layer's tables and pools, their numpy views made once.

    A decode step calls the swap-in of every layer, and at batch 8 turning the bound tensors into numpy
    views (and the pools into machine words) was a third of a call's Python time; here a call converts
    only the step's selection.
    """

    def __init__(self, slot_pos: torch.Tensor, lru: torch.Tensor, device_rows: torch.Tensor, host_rows: torch.Tensor,
                 host_kv: torch.Tensor, device_kv: torch.Tensor, policy: KernelPolicy = KernelPolicy("lru"),
                 totals: torch.Tensor | None = None) -> None:
        if policy.name not in POLICY_CODES:
            raise ValueError(f"the cpu swap-in backend implements {', '.join(POLICY_CODES)}, not {policy.name!r}")
        self.code = POLICY_CODES[policy.name]
        self.table_shape = tuple(slot_pos.shape)
        self.context = host_rows.shape[1]  # positions must fall in [0, context)
        def given(tensor: torch.Tensor | None, none: torch.Tensor) -> np.ndarray:
            return (none if tensor is None else tensor).numpy()

        self.tables = (slot_pos.numpy(), lru.numpy(), device_rows.numpy(), host_rows.numpy(),
                       given(policy.referenced, _NO_REFERENCED), given(policy.values, _NO_AGE),
                       given(policy.ghost_pos, _NO_GHOSTS[0]), given(policy.ghost_value, _NO_GHOSTS[1]))
        self.constants = kernel_scalars(policy)  # score_lru's or lrfu's; the other policies ignore them
        self.host_words, self.device_words = _as_words(host_kv), _as_words(device_kv)
        # A copy big enough for the parallel loop streams its rows past the caches, where the rows allow it
        # (see the module docstring).
        self.streaming = rows_can_stream(self.host_words, self.device_words)
        self.totals = np.zeros(3, np.int64) if totals is None else totals.numpy()  # page_table adds to it
        self._tensors = (slot_pos, lru, device_rows, host_rows, host_kv, device_kv)  # for `lru_page_table`
        self.row_bytes = host_kv.shape[1] * host_kv.element_size()
        self.lookup = np.empty((0, self.context), np.int32)  # per thread: the plan's sparse sets, never cleared
        # per thread: lrfu's ghost scratch, [threads, 3, width] (zero-width for the other policies); here, not per
        # request: three zero-size arrays per request cost the other policies' plan 2-4% at batch 64
        self.ghost_scratch = np.empty((0, 3, 0), np.int64)

    def __call__(self, top_k: torch.Tensor, rows: torch.Tensor,
                 next_ranked: torch.Tensor | None = None) -> SwapInResult:
        batch = top_k.shape[0]
        none = np.full(batch, _NOT_A_POSITION, np.int64)
        page_table, misses, evictions, hits = self._run(top_k, rows, none, none, np.zeros(3, np.int64), next_ranked)
        return SwapInResult(torch.from_numpy(page_table), torch.from_numpy(misses), torch.from_numpy(evictions),
                            torch.from_numpy(hits))

    @functools.cached_property
    def lru_page_table(self) -> lru_page_table_cpu.LruPageTable | None:
        """lru's page table, the CPU's default, in C where it is built (`lru_page_table_cpu`: this plan's fixed
        costs dominate a decode step's call); None (the numba plan) for other policies or where it is not. Bound
        on first use: a plain `swap_in_cpu` call never asks for it."""
        tensors = self._tensors
        if self.code != _LRU or not all(t.is_contiguous() for t in tensors) or not lru_page_table_cpu.available():
            return None
        return lru_page_table_cpu.LruPageTable(*tensors, torch.from_numpy(self.totals))

    def page_table(self, selected: torch.Tensor, rows: torch.Tensor, newest: torch.Tensor, reserved: torch.Tensor,
                   next_ranked: torch.Tensor | None = None) -> torch.Tensor:
        """`BoundSwapIn.page_table` in one compiled call (see the module docstring)."""
        if self.lru_page_table is not None:
            return self.lru_page_table(selected.contiguous(), rows, newest, reserved,
                                       selected.numel() >= lru_page_table_cpu.PARALLEL_MIN_SELECTED)
        page_table, _, _, _ = self._run(selected, rows, newest.numpy(), reserved.numpy(), self.totals, next_ranked)
        return torch.from_numpy(page_table)

    def _run(self, top_k: torch.Tensor, rows: torch.Tensor, newest: np.ndarray, reserved: np.ndarray,
             totals: np.ndarray, next_ranked: torch.Tensor | None) -> tuple:
        """Check, plan, copy: (page_table, misses, evictions, hits); the batch's (hits, misses, evictions)
        are added to `totals`."""
        batch, width = top_k.shape
        ranked = _NO_RANKS if next_ranked is None else next_ranked.numpy()
        parallel = batch * width >= PARALLEL_MIN_SELECTED
        plan = _plan_batch_parallel if parallel else _plan_batch_serial
        parallel_copy_bytes = PARALLEL_PLAN_COPY_MIN_BYTES if parallel else PARALLEL_MIN_BYTES
        workers = numba.get_num_threads()  # read here: inside compiled code it would stop numba caching it
        if self.lookup.shape[0] < workers:
            self.lookup = np.empty((workers, self.context), np.int32)  # no need to clear: see `_held`
        scratch_shape = (workers, 3, width if self.code == _LRFU else 0)
        if self.ghost_scratch.shape != scratch_shape:
            self.ghost_scratch = np.empty(scratch_shape, np.int64)
        error, detail, page_table, misses, evictions, hits, src, dst = plan(
            top_k.numpy(), rows.numpy(), newest, reserved, *self.tables, ranked, self.constants, self.code,
            self.host_words, self.device_words, parallel_copy_bytes // self.row_bytes, totals, self.lookup,
            self.ghost_scratch, workers, self.streaming)
        if error:
            raise_value_error(error, detail, self.table_shape, self.context)
        if src.size:  # more missed bytes than the plan copies on its own thread
            _copy_rows_parallel(self.host_words, self.device_words, src, dst, workers, self.streaming)
        return page_table, misses, evictions, hits


def _as_words(kv: torch.Tensor) -> np.ndarray:
    """[rows, W] of any dtype as [rows, n] of the widest unsigned word dividing the row size."""
    raw = kv.view(torch.uint8).numpy()
    for word in (np.uint64, np.uint32, np.uint16):
        if raw.shape[1] % np.dtype(word).itemsize == 0:
            return raw.view(word)
    return raw


@njit(cache=True)
def _held(lookup, slot_pos, r, p):
    """The slot of row r holding position p, -1 if none. `lookup[p]` is the slot the row's scatter wrote
    for p this call, or anything at all (the scratch is never cleared: another row's or call's value): a
    slot counts only if it really holds p, so no stale value can make a false hit."""
    s = lookup[p]
    if 0 <= s < slot_pos.shape[1] and slot_pos[r, s] == p:
        return s
    return -1


@njit(cache=True)
def _ghost(lookup, ghost_pos, r, p, num_slots):
    """The ghost entry of row r for position p, -1 if none: `lookup[p]` is S + its entry when the row's
    scatter wrote one (see `_held`; a held position's slot overwrote it, so a held position has none)."""
    g = lookup[p] - num_slots
    if 0 <= g < ghost_pos.shape[1] and ghost_pos[r, g] == p:
        return g
    return -1


@njit(cache=True)
def keep_last_ghosts(ghost_pos, ghost_value, r, decay, evicted_pos, evicted_value, n_evicted):
    """Row r's ghosts := the last S of (its surviving ghosts, decayed by 1/2**decay, the oldest first, then
    the n evicted), empty entries (-1, 0) at the front (`LRFUPolicy.choose`)."""
    num_slots = ghost_pos.shape[1]
    listed_pos = np.empty(num_slots + n_evicted, np.int32)
    listed_value = np.empty(num_slots + n_evicted, np.int32)
    n = 0
    for g in range(num_slots):
        if ghost_pos[r, g] >= 0:
            listed_pos[n] = ghost_pos[r, g]
            listed_value[n] = ghost_value[r, g] - (ghost_value[r, g] >> decay)
            n += 1
    for i in range(n_evicted):
        listed_pos[n] = evicted_pos[i]
        listed_value[n] = evicted_value[i]
        n += 1
    first = max(n - num_slots, 0)
    pad = num_slots - (n - first)
    for k in range(num_slots):
        if k < pad:
            ghost_pos[r, k] = -1
            ghost_value[r, k] = 0
        else:
            ghost_pos[r, k] = listed_pos[first + k - pad]
            ghost_value[r, k] = listed_value[first + k - pad]


@njit(cache=True)
def _slot_ranks(next_ranked, b, lookup, slot_pos, r, pinned, limit):
    """Per slot of row r, the rank (1 for the best) of its position among request b's first `limit`
    next-ranked positions, 0 if not listed there or pinned this step; a position listed twice keeps its
    best rank (`EvictionPolicy.plan_row`'s `next_rank`)."""
    rank = np.zeros(slot_pos.shape[1], np.int64)
    for j in range(min(next_ranked.shape[1], limit)):
        p = next_ranked[b, j]
        s = _held(lookup, slot_pos, r, p) if p >= 0 else -1
        if s >= 0 and pinned[s] == 0 and rank[s] == 0:
            rank[s] = j + 1
    return rank


@njit(cache=True)
def _plan_row(b, r, newest, reserved, top_k, slot_pos, lru, device_rows, host_rows, referenced, age, ghost_pos,
              ghost_value, next_ranked, constants, policy, page_table, miss_src, miss_dst, lookup, ghost_scratch):
    """One request's bookkeeping; returns (misses, evictions, hits). Position `newest` is not swapped in:
    its column reads device row `reserved`. `lookup` [context] int32 is this thread's sparse set (see
    `_held`), `ghost_scratch` [3, width] int64 its lrfu scratch; other scratch is allocated here, per call."""
    width = top_k.shape[1]
    num_slots = slot_pos.shape[1]
    if policy == _LRFU:  # lrfu's ghosts first, so that a held position's slot overwrites any ghost of it
        for g in range(num_slots):
            p = ghost_pos[r, g]
            if p >= 0:
                lookup[p] = num_slots + g
    for s in range(num_slots):  # the sparse set: position -> the slot holding it
        p = slot_pos[r, s]
        if p >= 0:
            lookup[p] = s

    # Hits per column, then the walk of the order: hits keep their slot, the rest is evictable, oldest first.
    col_slot = np.full(width, -1, np.int32)
    pinned = np.zeros(num_slots, np.uint8)  # 1: hit this step, 2: loaded this step
    for j in range(width):
        p = top_k[b, j]
        if p >= 0 and p != newest:
            s = _held(lookup, slot_pos, r, p)
            if s >= 0:
                col_slot[j] = s
                pinned[s] = 1
    evictable = np.empty(num_slots, np.int32)
    hits = np.empty(num_slots, np.int32)
    n_evictable = 0
    n_hits = 0
    for i in range(num_slots):
        s = lru[r, i]
        if pinned[s]:
            hits[n_hits] = s
            n_hits += 1
            if policy == _CLOCK:
                referenced[r, s] = 1
        else:
            evictable[n_evictable] = s
            n_evictable += 1

    # score_lru: age every slot a step, let next-ranked positions look younger, take the oldest evictables.
    # lrfu: decay every count a step, take the lowest counts, a next-ranked position's credited by its rank.
    # Both keep the new value in new_age (lrfu's credit is in its sort keys only).
    victims = evictable
    # score_lru: (touch, load steps, age limit, 0, 0, 0); lrfu: (hit, shift, bonus, span/K, ghost shift, ghost 4ths)
    c0, c1, c2, c3, c4, c5 = constants
    unit = max(width, 1)  # score_lru's ages count in 1/width of a step
    spare = max(num_slots - width, 0)
    sorts = policy == _SCORE_LRU or policy == _LRFU
    new_age = np.empty(num_slots if sorts else 0, np.int64)
    if policy == _SCORE_LRU:
        touch, limit = c0, c2
        rank = _slot_ranks(next_ranked, b, lookup, slot_pos, r, pinned, next_ranked.shape[1])
        for s in range(num_slots):
            new_age[s] = min(np.int64(age[r, s]) + unit, limit)
            if rank[s]:
                new_age[s] = min(new_age[s], np.int64(touch) * rank[s] * spare // unit)
    elif policy == _LRFU:
        decay_shift, bonus, span = c1, np.int64(c2), np.int64(c3) * unit
        rank = _slot_ranks(next_ranked, b, lookup, slot_pos, r, pinned, span if bonus > 0 else 0)
        for s in range(num_slots):
            new_age[s] = age[r, s] - (age[r, s] >> decay_shift)
    if sorts:  # victims by ascending key, ties in eviction order (a stable sort)
        sort_keys = np.empty(n_evictable, np.int64)
        for i in range(n_evictable):
            s = evictable[i]
            if policy == _SCORE_LRU:  # the oldest first
                sort_keys[i] = -new_age[s]
            else:  # the lowest credited count first
                sort_keys[i] = new_age[s] + (bonus * (span - rank[s] + 1) // span if rank[s] else 0)
        victims = evictable[:n_evictable][np.argsort(sort_keys, kind="mergesort")]

    # The i-th miss (column order) takes the policy's i-th victim. lrfu: a returning ghost's value comes
    # with it (and it leaves the ghosts), an evicted token's joins them.
    lrfu = policy == _LRFU
    loaded_value, evicted_pos, evicted_value = ghost_scratch[0], ghost_scratch[1], ghost_scratch[2]
    n_miss = 0
    n_evict = 0
    hand = 0
    for j in range(width):
        p = top_k[b, j]
        if p < 0:
            page_table[b, j] = -1
            continue
        if p == newest:
            page_table[b, j] = reserved
            continue
        s = col_slot[j]
        if s < 0:
            if policy == _CLOCK:
                while True:
                    s = lru[r, hand]
                    hand = (hand + 1) % num_slots
                    if pinned[s] != 0:
                        continue
                    if referenced[r, s] != 0:
                        referenced[r, s] = 0
                        continue
                    break
                referenced[r, s] = 1
            else:
                s = victims[n_miss]
            pinned[s] = 2
            if lrfu:
                g = _ghost(lookup, ghost_pos, r, p, num_slots)
                credit = 0
                if g >= 0:
                    credit = c5 * np.int64(ghost_value[r, g] - (ghost_value[r, g] >> c4)) // 4
                    ghost_pos[r, g] = -1  # it returns
                loaded_value[n_miss] = min(c0 + credit, np.int64(c0) << c1)
            if slot_pos[r, s] >= 0:
                if lrfu:
                    evicted_pos[n_evict] = slot_pos[r, s]
                    evicted_value[n_evict] = new_age[s]
                n_evict += 1
            slot_pos[r, s] = p
            miss_src[b, n_miss] = p  # its host row is read at the end; asked for now
            prefetch_to_l2(host_rows, r, p)
            miss_dst[b, n_miss] = device_rows[r, s]
            n_miss += 1
        page_table[b, j] = device_rows[r, s]
    # The new order.
    if policy == _LRU or policy == _SCORE_LRU or policy == _LRFU:
        # LRU's: untouched evictables, then the loaded slots, then the hits (for lru the victims are the
        # oldest evictables, so the untouched ones are evictable[n_miss:]).
        k = 0
        for i in range(n_evictable):
            if pinned[evictable[i]] == 0:
                lru[r, k] = evictable[i]
                k += 1
        for i in range(n_miss):
            lru[r, k] = victims[i]
            k += 1
        for i in range(n_hits):
            lru[r, k] = hits[i]
            k += 1
        if policy == _SCORE_LRU:  # ... stably sorted by descending new age
            load_steps, limit = c1, c2
            for i in range(n_miss):
                new_age[victims[i]] = min(load_steps * unit, limit)
            for i in range(n_hits):
                new_age[hits[i]] = 0
            base = lru[r].copy()
            older_first = np.empty(num_slots, np.int64)
            for i in range(num_slots):
                older_first[i] = -new_age[base[i]]
            ranked = np.argsort(older_first, kind="mergesort")
            for i in range(num_slots):
                lru[r, i] = base[ranked[i]]
        elif policy == _LRFU:  # a hit adds a selection, a loaded slot starts at one (a ghost's more)
            hit = c0
            for i in range(n_hits):
                new_age[hits[i]] += hit
            for i in range(n_miss):
                new_age[victims[i]] = loaded_value[i]
            keep_last_ghosts(ghost_pos, ghost_value, r, c4, evicted_pos, evicted_value, n_evict)
        if sorts:
            for s in range(num_slots):
                age[r, s] = new_age[s]
    elif policy == _FIFO:
        old = lru[r].copy()
        k = 0
        for i in range(num_slots):
            if pinned[old[i]] != 2:
                lru[r, k] = old[i]
                k += 1
        for i in range(n_miss):
            lru[r, k] = evictable[i]
            k += 1
    elif hand != 0:
        old = lru[r].copy()
        for i in range(num_slots):
            lru[r, i] = old[(hand + i) % num_slots]
    # The missed positions' host rows, last and in a loop of their own: each is a cold line of a large table,
    # prefetched when its miss was found, and the loads of a loop this small overlap. (Read in the loop that
    # finds the misses, at batch 64 and 100% misses, they cost about three times as long: 0.47 against 0.15
    # ms a call. Read right after that loop without the prefetch, calls alternating with this, 40 each, three
    # runs: 1.06-1.08x the time of a call at 100% misses, 1.05-1.06x at 20%.)
    for i in range(n_miss):
        miss_src[b, i] = host_rows[r, miss_src[b, i]]
    return n_miss, n_evict, n_hits


@njit(cache=True)
def _check_values(top_k, rows, newest, num_rows, num_slots, context, next_ranked):
    """(error code, detail) as swap_in.raise_value_error reads them; (0, 0) when valid. Runs first."""
    for b in range(next_ranked.shape[0]):
        for j in range(next_ranked.shape[1]):
            p = next_ranked[b, j]
            if p < -1 or p >= context:
                return NEXT_RANKED_OUT_OF_RANGE, p
    seen = np.zeros(num_rows, np.uint8)
    for b in range(top_k.shape[0]):
        r = rows[b]
        if r < 0 or r >= num_rows:
            return ROW_OUT_OF_RANGE, r
        if seen[r]:
            return ROW_TWICE, r
        seen[r] = 1
        count = 0
        for j in range(top_k.shape[1]):
            p = top_k[b, j]
            if p < -1 or p >= context:
                return POSITION_OUT_OF_RANGE, p
            count += p >= 0 and p != newest[b]
        if count > num_slots:
            return TOO_MANY_SELECTED, count
    return 0, 0


@njit(cache=True)
def _flatten_misses(miss_src, miss_dst, misses):
    """The batch's copies as one list, so the parallel copy balances over misses, not requests."""
    total = 0
    for b in range(misses.shape[0]):
        total += misses[b]
    src = np.empty(total, np.int64)
    dst = np.empty(total, np.int64)
    k = 0
    for b in range(misses.shape[0]):
        for i in range(misses[b]):
            src[k] = miss_src[b, i]
            dst[k] = miss_dst[b, i]
            k += 1
    return src, dst


@njit(cache=True)
def _plan_start(top_k, rows, newest, slot_pos, host_rows, next_ranked):
    """Check the values and allocate the outputs (page table, misses, evictions, hits) and miss lists."""
    error, detail = _check_values(top_k, rows, newest, slot_pos.shape[0], slot_pos.shape[1], host_rows.shape[1],
                                  next_ranked)
    batch = top_k.shape[0]
    return (error, detail, np.empty(top_k.shape, np.int64), np.zeros(batch, np.int32), np.zeros(batch, np.int32),
            np.zeros(batch, np.int32), np.empty(top_k.shape, np.int64), np.empty(top_k.shape, np.int64))


@njit(cache=True)
def _plan_finish(error, detail, page_table, misses, evictions, hits, miss_src, miss_dst, host_words, device_words,
                 serial_copy_rows, totals):
    """Add up the totals and list the copies; a batch with few missed rows is copied here, on this thread
    (waking the pool would cost more), and then no rows are left for the caller's parallel copy."""
    totals[0] += hits.sum()
    totals[1] += misses.sum()
    totals[2] += evictions.sum()
    src, dst = _flatten_misses(miss_src, miss_dst, misses)
    if src.size < serial_copy_rows:
        _copy_rows_serial(host_words, device_words, src, dst)
        src, dst = src[:0], dst[:0]
    return error, detail, page_table, misses, evictions, hits, src, dst


# Serial and parallel variants are separate functions (here and for the copies): numba's disk cache keys a
# compiled function by the Python function and the argument types, not by `parallel`.
@njit(cache=True)
def _plan_batch_serial(top_k, rows, newest, reserved, slot_pos, lru, device_rows, host_rows, referenced, age,
                       ghost_pos, ghost_value, next_ranked, constants, policy, host_words, device_words,
                       serial_copy_rows, totals, lookup, ghost_scratch, workers, streaming):
    """Check, plan every request, copy a few rows or list them: (error, detail, page table, misses,
    evictions, hits, src rows, dst rows left to copy); the batch's totals are added to `totals`. `workers`
    (the parallel variant's thread count) and `streaming` (its copy's stores) are unused here, and only
    `lookup[0]` and `ghost_scratch[0]` (each thread's sparse set and lrfu scratch) are: both variants take the
    same arguments."""
    error, detail, page_table, misses, evictions, hits, miss_src, miss_dst = _plan_start(
        top_k, rows, newest, slot_pos, host_rows, next_ranked)
    if error == 0:
        for b in range(top_k.shape[0]):
            misses[b], evictions[b], hits[b] = _plan_row(
                b, rows[b], newest[b], reserved[b], top_k, slot_pos, lru, device_rows, host_rows, referenced, age,
                ghost_pos, ghost_value, next_ranked, constants, policy, page_table, miss_src, miss_dst, lookup[0],
                ghost_scratch[0])
    return _plan_finish(error, detail, page_table, misses, evictions, hits, miss_src, miss_dst, host_words,
                        device_words, serial_copy_rows, totals)


@njit(parallel=True, cache=True)
def _plan_batch_parallel(top_k, rows, newest, reserved, slot_pos, lru, device_rows, host_rows, referenced, age,
                         ghost_pos, ghost_value, next_ranked, constants, policy, host_words, device_words,
                         serial_copy_rows, totals, lookup, ghost_scratch, workers, streaming):
    """_plan_batch_serial on `workers` threads, each claiming the next request (`work_claim.claim`), and
    the copies it leaves in a second parallel loop of the same call, by chunks claimed the same way: waking
    the thread pool costs about 80 us when it has slept (as it has between two layers' swap-ins), and a
    separate copy call could find it asleep again. Claimed rather than cut in fixed shares, because the
    second thread often wakes late (batch 64, 100% misses, calls alternating: 0.88x, 0.94x and 0.92x the
    time with numba's fixed halves)."""
    error, detail, page_table, misses, evictions, hits, miss_src, miss_dst = _plan_start(
        top_k, rows, newest, slot_pos, host_rows, next_ranked)
    counters = np.zeros(2, np.int64)  # the next request to plan, the next chunk to copy
    batch = top_k.shape[0]
    if error == 0:
        for w in prange(workers):
            b = claim(counters, 0)
            while b < batch:
                misses[b], evictions[b], hits[b] = _plan_row(
                    b, rows[b], newest[b], reserved[b], top_k, slot_pos, lru, device_rows, host_rows, referenced,
                    age, ghost_pos, ghost_value, next_ranked, constants, policy, page_table, miss_src, miss_dst,
                    lookup[w], ghost_scratch[w])
                b = claim(counters, 0)
    error, detail, page_table, misses, evictions, hits, src, dst = _plan_finish(
        error, detail, page_table, misses, evictions, hits, miss_src, miss_dst, host_words, device_words,
        serial_copy_rows, totals)
    for _ in prange(workers):
        _copy_claimed_chunks(host_words, device_words, src, dst, counters, streaming)
    return error, detail, page_table, misses, evictions, hits, src[:0], dst[:0]


@njit(cache=True)
def _copy_rows(host, device, src, dst, lo, hi, streaming):
    """Rows src[lo:hi] -> dst[lo:hi], each prefetched into L2 `_PREFETCH_AHEAD` rows before its copy;
    `streaming`: stored past the caches (`streaming_store`, the rows must allow it), fenced at the end."""
    words = host.shape[1]
    line = line_step(host)
    for i in range(lo, min(lo + _PREFETCH_AHEAD, hi)):
        prefetch_row_to_l2(host, src[i], line)
    for i in range(lo, hi):
        if i + _PREFETCH_AHEAD < hi:
            prefetch_row_to_l2(host, src[i + _PREFETCH_AHEAD], line)
        s = src[i]
        d = dst[i]
        if streaming:
            copy_row_past_caches(device, d, host, s)
        else:
            for w in range(words):
                device[d, w] = host[s, w]
    if streaming:
        store_fence()


@njit(cache=True)
def _copy_chunk(host, device, src, dst, c, streaming):
    """Chunk c of a parallel copy: rows c x _COPY_CHUNK up to the next chunk or the end."""
    _copy_rows(host, device, src, dst, c * _COPY_CHUNK, min((c + 1) * _COPY_CHUNK, src.shape[0]), streaming)


@njit(cache=True)
def _copy_rows_serial(host, device, src, dst):
    """A small copy, on the calling thread, with ordinary stores: the same layer's attention reads its rows
    next, from the caches."""
    _copy_rows(host, device, src, dst, 0, src.shape[0], False)


@njit(parallel=True, cache=True)
def _copy_rows_parallel(host, device, src, dst, workers, streaming):
    counters = np.zeros(2, np.int64)
    for _ in prange(workers):
        _copy_claimed_chunks(host, device, src, dst, counters, streaming)


@njit(cache=True)
def _copy_claimed_chunks(host, device, src, dst, counters, streaming):
    """One thread's part of a parallel copy: chunks claimed one by one (`counters[1]`) until none is left.
    (The `prange` over the threads stays in each parallel caller: numba parallelises only the loops of the
    function it compiles with parallel=True.)"""
    chunks = (src.shape[0] + _COPY_CHUNK - 1) // _COPY_CHUNK
    c = claim(counters, 1)
    while c < chunks:
        _copy_chunk(host, device, src, dst, c, streaming)
        c = claim(counters, 1)
