"""Swap-in: the three backends agree step by step, keep the slot tables sound, and match cache simulators.

Traces are random decode runs: each request's context grows by one token per step and its top-k
keeps part of the previous step's selection (locality), so steps mix hits, misses into empty slots
and evictions. Each step also carries next-ranked positions (what score_lru reads): mostly positions
the buffer may hold, some selected ones, a few repeats and -1 padding anywhere.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from unittest.mock import patch

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hisparse.kernels import lru_page_table_cpu, swap_in_cpu
from hisparse.kernels.streaming_store import rows_can_stream
from hisparse.kernels.swap_in import SwapInResult
from hisparse.memory.eviction import get_policy, new_slot_tables, reset_row
from hisparse.memory.swap_in import bound_swap_in, swap_in

if not torch.cuda.is_available():
    # Before the Triton kernel module is first imported (the dispatcher imports it lazily).
    os.environ.setdefault("TRITON_INTERPRET", "1")

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TRITON = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Case:
    rows: torch.Tensor
    slot_pos: torch.Tensor
    lru: torch.Tensor
    device_rows: torch.Tensor
    host_rows: torch.Tensor
    host_kv: torch.Tensor
    device_kv: torch.Tensor
    steps: list[torch.Tensor]  # top_k per step
    num_rows: int
    num_slots: int
    next_steps: list[torch.Tensor]  # next_ranked per step

    def clone(self) -> Case:
        return Case(self.rows, self.slot_pos.clone(), self.lru.clone(), self.device_rows, self.host_rows,
                    self.host_kv, self.device_kv.clone(), self.steps, self.num_rows, self.num_slots,
                    self.next_steps)


def make_case(seed: int, batch: int, num_slots: int, width: int, num_steps: int, row_width: int = 6,
              dtype: torch.dtype = torch.float32, pad_anywhere: bool = False) -> Case:
    rng = np.random.default_rng(seed)
    num_rows = batch + int(rng.integers(0, 3))
    rows = rng.permutation(num_rows)[:batch]
    seq_lens = rng.integers(2, 3 * num_slots, size=batch)
    context = int(seq_lens.max()) + num_steps + 1
    slot_pos, lru = new_slot_tables(num_rows, num_slots)
    for b, r in enumerate(rows):
        older = int(seq_lens[b]) - 1
        kept = int(rng.integers(0, min(num_slots, older) + 1))
        reset_row(slot_pos, lru, int(r), range(older - kept, older))
    host_size = num_rows * context + 7
    host_rows = torch.from_numpy(rng.permutation(host_size)[: num_rows * context].reshape(num_rows, context))
    device_size = num_rows * num_slots + 3
    device_rows = torch.from_numpy(rng.permutation(device_size)[: num_rows * num_slots])
    host_kv = torch.from_numpy(rng.standard_normal((host_size, row_width), dtype=np.float32)).to(dtype)
    device_kv = torch.zeros(device_size, row_width, dtype=dtype)
    device_rows = device_rows.view(num_rows, num_slots).long()
    held = slot_pos >= 0  # the buffer already holds these tokens' rows, as after prefill
    device_kv[device_rows[held]] = host_kv[host_rows.gather(1, slot_pos.clamp(min=0).long())[held]]

    steps, next_steps = [], []
    previous = [np.array([], dtype=np.int64) for _ in range(batch)]
    num_next = int(rng.integers(0, 2 * num_slots + 1))
    for _ in range(num_steps):
        following = rng.integers(0, int(seq_lens.max()) - 1, size=(batch, num_next))
        following = np.minimum(following, seq_lens[:, None] - 2)  # older than each request's newest token
        following[rng.random(following.shape) < 0.2] = -1
        next_steps.append(torch.from_numpy(following).long())
        top_k = torch.full((batch, width), -1, dtype=torch.int64)
        for b in range(batch):
            older = int(seq_lens[b]) - 1  # the newest token is never selected
            count = min(width, older) - int(rng.integers(0, 2))
            kept = previous[b][rng.random(previous[b].size) < 0.6][:count]
            fresh = rng.permutation(np.setdiff1d(np.arange(older), kept))[: count - kept.size]
            chosen = rng.permutation(np.concatenate([kept, fresh]))
            if pad_anywhere:
                cols = np.sort(rng.choice(width, size=chosen.size, replace=False))
                top_k[b, torch.from_numpy(cols)] = torch.from_numpy(chosen)
            else:
                top_k[b, : chosen.size] = torch.from_numpy(chosen)
            previous[b] = chosen
        seq_lens += 1
        steps.append(top_k)
    return Case(torch.from_numpy(rows).long(), slot_pos, lru, device_rows,
                host_rows.long(), host_kv, device_kv, steps, num_rows, num_slots, next_steps)


def run(case: Case, policy_name: str, backend: str):
    """Replay the trace; returns per-step results and pre-step slot tables, and the final state."""
    case = case.clone()
    policy = get_policy(policy_name, num_rows=case.num_rows, num_slots=case.num_slots)
    results: list[SwapInResult] = []
    before: list[torch.Tensor] = []
    for top_k, following in zip(case.steps, case.next_steps, strict=True):
        before.append(case.slot_pos.clone())
        lru_before = case.lru.clone()
        res = swap_in(top_k, case.rows, case.slot_pos, case.lru, case.device_rows, case.host_rows,
                      case.host_kv, case.device_kv, policy=policy, backend=backend, next_ranked=following)
        check_step(case, top_k, before[-1], lru_before, res)
        results.append(res)
    return results, before, case, policy


def check_step(case: Case, top_k: torch.Tensor, slot_pos_before: torch.Tensor, lru_before: torch.Tensor,
               res: SwapInResult) -> None:
    """Invariants of one swap-in that hold whatever the policy."""
    assert res.page_table.dtype == torch.int64 and res.page_table.shape == top_k.shape
    assert res.misses.dtype == torch.int32 and res.evictions.dtype == torch.int32 and res.hits.dtype == torch.int32
    for r in range(case.num_rows):
        assert sorted(case.lru[r].tolist()) == list(range(case.num_slots)), "lru lost or duplicated a slot"
        held = [p for p in case.slot_pos[r].tolist() if p >= 0]
        assert len(held) == len(set(held)), "a position is in two slots"
        if r not in case.rows.tolist():
            assert torch.equal(case.slot_pos[r], slot_pos_before[r]), "a row outside the batch changed"
            assert torch.equal(case.lru[r], lru_before[r]), "a row outside the batch changed"
    host_bytes = case.host_kv.view(torch.uint8)
    device_bytes = case.device_kv.view(torch.uint8)
    for b, r in enumerate(case.rows.tolist()):
        sel = top_k[b]
        valid = sel >= 0
        assert (res.page_table[b][~valid] == -1).all()
        dev = res.page_table[b][valid]
        assert dev.unique().numel() == dev.numel(), "two selected positions share a device row"
        positions = case.slot_pos[r].tolist()
        for p, d in zip(sel[valid].tolist(), dev.tolist(), strict=True):
            assert p in positions, "a selected position is not in the hot buffer"
            assert d == int(case.device_rows[r, positions.index(p)])
            assert torch.equal(device_bytes[d], host_bytes[case.host_rows[r, p]])
        old = set(slot_pos_before[r].tolist())
        assert int(res.misses[b]) == sum(p not in old for p in sel[valid].tolist())
        assert int(res.hits[b]) == sum(p in old for p in sel[valid].tolist())
        assert 0 <= int(res.evictions[b]) <= int(res.misses[b])


def assert_same_runs(a, b) -> None:
    results_a, _, case_a, policy_a = a
    results_b, _, case_b, policy_b = b
    for ra, rb in zip(results_a, results_b, strict=True):
        assert torch.equal(ra.page_table, rb.page_table)
        assert torch.equal(ra.misses, rb.misses)
        assert torch.equal(ra.evictions, rb.evictions)
        assert torch.equal(ra.hits, rb.hits)
    assert torch.equal(case_a.slot_pos, case_b.slot_pos)
    assert torch.equal(case_a.lru, case_b.lru)
    assert torch.equal(case_a.device_kv.view(torch.uint8), case_b.device_kv.view(torch.uint8))
    for key in policy_a.state:
        assert torch.equal(policy_a.state[key], policy_b.state[key])


def cases(max_batch: int = 6, min_slots: int = 4, max_slots: int = 64, max_steps: int = 6):
    @st.composite
    def build(draw):
        num_slots = draw(st.integers(min_slots, max_slots))
        return make_case(
            seed=draw(st.integers(0, 2**32 - 1)),
            batch=draw(st.integers(1, max_batch)),
            num_slots=num_slots,
            width=draw(st.integers(1, num_slots)),
            num_steps=draw(st.integers(1, max_steps)),
            row_width=draw(st.sampled_from([6, 5, 3])),
            dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.uint8])),  # uint8: packed DSA latent rows
            pad_anywhere=draw(st.booleans()),
        )

    return build()


@contextmanager
def cpu_parallel_always(plan: bool = True):
    """The test batches are small; force the cpu path's parallel loops (the default runs them serially):
    the copy, and with `plan` the bookkeeping too (else a serial plan hands its copies to a parallel call)."""
    with (patch.object(swap_in_cpu, "PARALLEL_MIN_SELECTED", 0 if plan else 1 << 60),
          patch.object(lru_page_table_cpu, "PARALLEL_MIN_SELECTED", 0 if plan else 1 << 60),
          patch.object(swap_in_cpu, "PARALLEL_MIN_BYTES", 0),
          patch.object(swap_in_cpu, "PARALLEL_PLAN_COPY_MIN_BYTES", 0)):
        yield


@pytest.mark.parametrize("policy", ["lru", "fifo", "clock", "score_lru", "lrfu"])
@FAST
@given(case=cases(), threads=st.sampled_from(["serial", "parallel", "parallel copy"]))
def test_cpu_matches_reference(policy, case, threads):
    with nullcontext() if threads == "serial" else cpu_parallel_always(plan=threads == "parallel"):
        assert_same_runs(run(case, policy, "reference"), run(case, policy, "cpu"))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("policy", ["lru", "clock", "score_lru", "lrfu"])
@FAST
@given(case=cases())
def test_bound_swap_in_sees_tables_changed_in_place(backend, policy, case):
    """The pools bind each layer's swap-in to its tables once (the cpu path keeps numpy views of them);
    a row reset in place between steps (a request leaves, another takes its row) must reach the bound call
    as it reaches swap_in."""
    def replay(bound: bool):
        c = case.clone()
        pol = get_policy(policy, num_rows=c.num_rows, num_slots=c.num_slots)
        call = bound_swap_in(backend, pol, c.slot_pos, c.lru, c.device_rows, c.host_rows, c.host_kv, c.device_kv)
        results = []
        for i, (top_k, following) in enumerate(zip(c.steps, c.next_steps, strict=True)):
            if i == 1:
                reset_row(c.slot_pos, c.lru, int(c.rows[0]), (), pol)
            if bound:
                results.append(call(top_k, c.rows, following))
            else:
                results.append(swap_in(top_k, c.rows, c.slot_pos, c.lru, c.device_rows, c.host_rows, c.host_kv,
                                       c.device_kv, policy=pol, backend=backend, next_ranked=following))
        return results, None, c, pol

    assert_same_runs(replay(False), replay(True))


def with_newest(case: Case, seed: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The trace's selections with each request's newest position (one past any the trace selects) in a
    random column, as the indexer returns them; and the reserved device row each newest position reads."""
    rng = np.random.default_rng(seed)
    batch = case.rows.shape[0]
    newest = torch.full((batch,), case.host_rows.shape[1] - 1, dtype=torch.int64)
    reserved = torch.arange(batch, dtype=torch.int64) + 10**6
    steps = []
    for top_k in case.steps:
        selected = torch.cat((top_k, newest.unsqueeze(1)), dim=1)
        steps.append(torch.stack([row[torch.from_numpy(rng.permutation(row.numel()))] for row in selected]))
    return steps, newest, reserved


@pytest.mark.parametrize("backend", ["cpu", "cpu parallel", "reference"])
@pytest.mark.parametrize("policy", ["lru", "score_lru", "lrfu"])
@FAST
@given(case=cases(), seed=st.integers(0, 2**16))
def test_step_page_table_is_the_swap_in_with_the_newest_in_its_reserved_row(backend, policy, case, seed):
    """`page_table` (what a decode step calls; one compiled call on the cpu path) equals the plain swap-in
    of the selection without the newest position, the newest column reading its reserved row, and it adds
    the plain swap-in's totals over the batch to the counters' row it was bound to (which starts non-zero:
    they add up, they do not overwrite)."""
    steps, newest, reserved = with_newest(case, seed)
    plain, fused = case.clone(), case.clone()
    plain_policy = get_policy(policy, num_rows=case.num_rows, num_slots=case.num_slots)
    fused_policy = get_policy(policy, num_rows=case.num_rows, num_slots=case.num_slots)
    name = backend.split()[0]
    counters = torch.tensor([[7, 0, 0], [0, 0, 0]])  # a layer's row; the other must stay as it is
    bound = bound_swap_in(name, fused_policy, fused.slot_pos, fused.lru, fused.device_rows, fused.host_rows,
                          fused.host_kv, fused.device_kv, counters[0])
    expected = counters.clone()
    for selected, following in zip(steps, case.next_steps, strict=True):
        is_newest = selected == newest.unsqueeze(1)
        res = swap_in(selected.masked_fill(is_newest, -1), plain.rows, plain.slot_pos, plain.lru, plain.device_rows,
                      plain.host_rows, plain.host_kv, plain.device_kv, policy=plain_policy, backend="reference",
                      next_ranked=following)
        with cpu_parallel_always() if backend == "cpu parallel" else nullcontext():
            page_table = bound.page_table(selected, fused.rows, newest, reserved, following)
        assert torch.equal(page_table, torch.where(is_newest, reserved.unsqueeze(1), res.page_table))
        expected[0] += torch.stack((res.hits.sum(), res.misses.sum(), res.evictions.sum())).long()
        assert torch.equal(counters, expected)
    assert torch.equal(plain.slot_pos, fused.slot_pos) and torch.equal(plain.lru, fused.lru)
    assert torch.equal(plain.device_kv.view(torch.uint8), fused.device_kv.view(torch.uint8))
    for key in plain_policy.state:
        assert torch.equal(plain_policy.state[key], fused_policy.state[key])


@pytest.mark.parametrize("policy", ["lru", "fifo", "score_lru", "lrfu"])
@TRITON
@given(case=cases(max_batch=3, max_slots=12, max_steps=3))
def test_triton_matches_reference(policy, case):
    assert_same_runs(run(case, policy, "reference"), run(case, policy, "triton"))


def simulate(case: Case, fifo: bool) -> list[tuple[list[int], list[int], list[set[int]]]]:
    """An OrderedDict cache per request, replayed over the trace: (misses, evictions, contents) per step.

    LRU: a selected position moves to the newest end; misses are inserted before the hits so the hits
    end newest, as in the reference system. FIFO: nothing moves. Both evict the oldest position that
    is not selected this step, and only when the cache is full.
    """
    caches = []
    for r in case.rows.tolist():
        held = [p for p in case.slot_pos[r].tolist() if p >= 0]
        order = sorted(held, key=lambda p: case.lru[r].tolist().index(case.slot_pos[r].tolist().index(p)))
        caches.append(OrderedDict.fromkeys(order))
    out = []
    for top_k in case.steps:
        misses, evictions, contents = [], [], []
        for b, cache in enumerate(caches):
            selected = [p for p in top_k[b].tolist() if p >= 0]
            chosen = set(selected)
            hits = [p for p in cache if p in chosen]
            n_miss = n_evict = 0
            for p in selected:
                if p in cache:
                    continue
                n_miss += 1
                if len(cache) == case.num_slots:
                    del cache[next(q for q in cache if q not in chosen)]
                    n_evict += 1
                cache[p] = None
            if not fifo:
                for p in hits:
                    cache.move_to_end(p)
            misses.append(n_miss)
            evictions.append(n_evict)
            contents.append(set(cache))
        out.append((misses, evictions, contents))
    return out


@pytest.mark.parametrize("policy", ["lru", "fifo"])
@FAST
@given(case=cases())
def test_matches_an_ordered_dict_cache(policy, case):
    expected = simulate(case, fifo=policy == "fifo")
    results, _, _, _ = run(case, policy, "cpu")
    replay = case.clone()
    for top_k, res, (misses, evictions, contents) in zip(case.steps, results, expected, strict=True):
        assert res.misses.tolist() == misses
        assert res.evictions.tolist() == evictions
        swap_in(top_k, replay.rows, replay.slot_pos, replay.lru, replay.device_rows, replay.host_rows,
                replay.host_kv, replay.device_kv, policy=policy, backend="reference")
        for b, r in enumerate(replay.rows.tolist()):
            assert {p for p in replay.slot_pos[r].tolist() if p >= 0} == contents[b]


def test_lru_keeps_an_intermittent_hot_set_that_fifo_cycles_out():
    """Positions 0 and 1 are selected every other step, cold pairs in between, in a 4-slot buffer."""
    num_slots = 4
    steps = [torch.tensor([[0, 1]]) if t % 2 == 0 else torch.tensor([[100 + t, 200 + t]]) for t in range(12)]
    total = {}
    for name in ("lru", "fifo"):
        slot_pos, lru = new_slot_tables(1, num_slots)
        kv = torch.zeros(num_slots, 2)
        total[name] = sum(
            int(swap_in(top_k, torch.tensor([0]), slot_pos, lru, torch.arange(num_slots).view(1, -1),
                        torch.arange(300).view(1, -1), torch.randn(300, 2), kv, policy=name).misses[0])
            for top_k in steps
        )
    # LRU: the hot pair is loaded once. FIFO: it is the oldest pair again every fourth step.
    assert total == {"lru": 2 + 2 * 6, "fifo": 2 + 2 * 6 + 2 * 2}


def _tables(batch: int = 2, num_slots: int = 4, context: int = 10):
    slot_pos, lru = new_slot_tables(batch, num_slots)
    device_rows = torch.arange(batch * num_slots).view(batch, num_slots)
    host_rows = torch.arange(batch * context).view(batch, context)
    return dict(rows=torch.arange(batch), slot_pos=slot_pos, lru=lru, device_rows=device_rows,
                host_rows=host_rows, host_kv=torch.randn(batch * context, 4),
                device_kv=torch.zeros(batch * num_slots, 4))


def _call(top_k, **overrides):
    args = {**_tables(), **overrides}
    policy = args.pop("policy", "lru")
    backend = args.pop("backend", "auto")
    return swap_in(top_k, args["rows"], args["slot_pos"], args["lru"], args["device_rows"],
                   args["host_rows"], args["host_kv"], args["device_kv"], policy=policy, backend=backend,
                   next_ranked=args.get("next_ranked"))


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize(("rank", "victim"), [(1, 1), (2, 1), (3, 0)])
def test_lrfu_credits_runners_up_down_to_rank_two_top_k_on_every_backend(backend, rank, victim):
    """Top-k width 1, so lrfu credits ranks 1 and 2 (RANK_BONUS and half of it) and not rank 3. Slot 0
    (position 10) is first in the order and ties slot 1 (11) in value: credited, it is kept and slot 1
    goes; past rank 2 it goes."""
    slot_pos = torch.tensor([[10, 11, 12]], dtype=torch.int32)
    lru = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    policy = get_policy("lrfu", num_rows=1, num_slots=3)
    hit = policy.HIT
    policy.state["value"][0] = torch.tensor([hit, hit, 3 * hit], dtype=torch.int32)
    following = torch.tensor([[5, 6][:rank - 1] + [10]])  # 10 at `rank`, after positions not held
    res = swap_in(torch.tensor([[20]]), torch.tensor([0]), slot_pos, lru, torch.arange(3).view(1, -1),
                  torch.arange(30).view(1, -1), torch.randn(30, 4), torch.zeros(3, 4), policy=policy,
                  backend=backend, next_ranked=following)
    assert res.page_table.tolist() == [[victim]] and slot_pos[0, victim] == 20
    assert policy.state["value"][0, 1 - victim] == hit - (hit >> policy.DECAY_SHIFT)  # the credit is not kept


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize(("ghosts", "selected", "start", "ghosts_after"), [
    # 30 is a ghost worth 8 selections: it returns at HIT + 6/4 of its decayed value and leaves the ghosts;
    # the evicted 10 joins them after the surviving 31, with its value (0).
    ([-1, 30, 31], 30, 1 + 6 * 7 / 4, [-1, 31, 10]),
    # 30 is no ghost: it starts at one selection; the list is full, so its oldest entry (40) falls off.
    ([40, 41, 42], 30, 1, [41, 42, 10]),
])
def test_lrfu_ghosts_on_every_backend(backend, ghosts, selected, start, ghosts_after):
    slot_pos = torch.tensor([[10, 11, 12]], dtype=torch.int32)
    lru = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    policy = get_policy("lrfu", num_rows=1, num_slots=3)
    hit = policy.HIT
    policy.state["value"][0] = torch.tensor([0, 2 * hit, 3 * hit], dtype=torch.int32)  # slot 0 (10) goes
    policy.state["ghost_pos"][0] = torch.tensor(ghosts, dtype=torch.int32)
    policy.state["ghost_value"][0] = torch.tensor([8 * hit if p >= 0 else 0 for p in ghosts], dtype=torch.int32)
    res = swap_in(torch.tensor([[selected]]), torch.tensor([0]), slot_pos, lru, torch.arange(3).view(1, -1),
                  torch.arange(50).view(1, -1), torch.randn(50, 4), torch.zeros(3, 4), policy=policy,
                  backend=backend)
    assert res.page_table.tolist() == [[0]] and slot_pos[0].tolist() == [selected, 11, 12]
    assert policy.state["value"][0, 0] == int(start * hit)
    assert policy.state["ghost_pos"][0].tolist() == ghosts_after
    decayed = 8 * hit - (8 * hit >> policy.GHOST_DECAY_SHIFT)
    assert policy.state["ghost_value"][0].tolist() == [0 if p in (-1, 10) else decayed for p in ghosts_after]


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_more_selected_positions_than_slots_is_an_error(backend):
    with pytest.raises(ValueError, match="4 slots"):
        _call(torch.tensor([[0, 1, 2, 3, 4], [0, 1, -1, -1, -1]]), backend=backend)
    # as many as the slots is fine, padding does not count
    res = _call(torch.tensor([[0, 1, 2, 3, -1], [5, -1, -1, -1, -1]]), backend=backend)
    assert res.misses.tolist() == [4, 1]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(policy="belady"), "unknown eviction policy 'belady'"),
        (dict(policy="clock"), "per-slot state"),
        (dict(backend="cuda"), "unknown swap-in backend"),
        (dict(backend="triton", policy=get_policy("clock", num_rows=2, num_slots=4)), "triton"),
        (dict(host_rows=torch.zeros(2, 10, dtype=torch.int32)), "host_rows must be"),
        (dict(slot_pos=torch.full((2, 4), -1, dtype=torch.int64)), "slot_pos must be"),
        (dict(device_kv=torch.zeros(8, 4, dtype=torch.float16)), "device_kv is"),
        (dict(device_kv=torch.zeros(8, 5)), "one W"),
        (dict(lru=torch.zeros(2, 3, dtype=torch.int32)), "one shape"),
        (dict(next_ranked=torch.zeros(2, 3, dtype=torch.int32)), "next_ranked must be"),
        (dict(next_ranked=torch.zeros(3, 2, dtype=torch.int64)), "next_ranked has 3 rows"),
    ],
)
def test_bad_arguments_are_value_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        _call(torch.tensor([[0, 1], [2, -1]]), **overrides)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize(
    ("top_k", "rows", "match"),
    [
        ([[0, 10], [2, -1]], [0, 1], "top_k positions"),
        ([[0, -2], [2, -1]], [0, 1], "top_k positions"),
        ([[0, 1], [2, -1]], [1, 1], "same row"),
        ([[0, 1], [2, -1]], [0, 2], "rows must be in"),
        ([[0, 1, 2, 3, 4], [2, -1, -1, -1, -1]], [0, 1], "4 slots"),
    ],
)
def test_bad_values_are_value_errors_and_change_nothing(backend, top_k, rows, match):
    args = _tables()
    slot_pos, lru = args["slot_pos"].clone(), args["lru"].clone()
    with pytest.raises(ValueError, match=match):
        _call(torch.tensor(top_k), **{**args, "rows": torch.tensor(rows)}, backend=backend)
    assert torch.equal(args["slot_pos"], slot_pos) and torch.equal(args["lru"], lru)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("following", [[[10], [0]], [[-2], [0]]])
def test_next_ranked_out_of_range_is_a_value_error_and_changes_nothing(backend, following):
    args = _tables()
    policy = get_policy("score_lru", num_rows=2, num_slots=4)
    slot_pos, lru = args["slot_pos"].clone(), args["lru"].clone()
    with pytest.raises(ValueError, match="next_ranked positions"):
        _call(torch.tensor([[0, 1], [2, -1]]), **args, next_ranked=torch.tensor(following), policy=policy,
              backend=backend)
    assert torch.equal(args["slot_pos"], slot_pos) and torch.equal(args["lru"], lru)
    assert int(policy.state["age"].sum()) == 0


def test_empty_batch_is_a_no_op():
    res = _call(torch.zeros((0, 3), dtype=torch.int64), rows=torch.zeros(0, dtype=torch.int64))
    assert res.page_table.shape == (0, 3) and res.misses.shape == (0,)


@settings(max_examples=30, deadline=None)
@given(num_copies=st.integers(0, 3 * swap_in_cpu._COPY_CHUNK + 5), row_bytes=st.sampled_from([6, 7, 64, 656, 768]),
       parallel=st.booleans(), seed=st.integers(0, 2**31 - 1))
@example(num_copies=swap_in_cpu._COPY_CHUNK, row_bytes=768, parallel=True, seed=1)
@example(num_copies=2 * swap_in_cpu._COPY_CHUNK, row_bytes=656, parallel=True, seed=2)
@example(num_copies=swap_in_cpu._PREFETCH_AHEAD, row_bytes=7, parallel=False, seed=3)
def test_cpu_row_copy_writes_exactly_the_listed_rows(num_copies, row_bytes, parallel, seed):
    """The prefetching copy (short lists, lists of several parallel chunks, rows not a whole number of
    cache lines or words) writes each listed destination row with its source row and nothing else; a
    parallel copy of rows of whole lines also with its stores streamed past the caches."""
    rng = np.random.default_rng(seed)
    host = torch.from_numpy(rng.integers(0, 256, (4 * num_copies + 8, row_bytes), dtype=np.uint8))
    device = torch.empty(2 * num_copies + 8, row_bytes, dtype=torch.uint8)  # torch aligns it to 64 bytes
    device.copy_(torch.from_numpy(rng.integers(0, 256, tuple(device.shape), dtype=np.uint8)))
    src = rng.choice(host.shape[0], num_copies, replace=False).astype(np.int64)
    dst = rng.choice(device.shape[0], num_copies, replace=False).astype(np.int64)
    initial = device.clone()
    expected = device.clone()
    expected[torch.from_numpy(dst)] = host[torch.from_numpy(src)]
    words = swap_in_cpu._as_words(host), swap_in_cpu._as_words(device)  # views of the tensors' memory
    assert rows_can_stream(*words) == (row_bytes % 64 == 0)
    if parallel:
        for streaming in {False, rows_can_stream(*words)}:
            device.copy_(initial)
            swap_in_cpu._copy_rows_parallel(*words, src, dst, 2, streaming)
            assert torch.equal(device, expected), streaming
    else:
        swap_in_cpu._copy_rows_serial(*words, src, dst)
        assert torch.equal(device, expected)


def test_only_aligned_rows_of_whole_lines_stream():
    """A non-temporal vector store to an unaligned line faults: rows_can_stream refuses a destination whose
    rows do not all start on a line, and rows of a fraction of a line or of other word types."""
    pool = torch.empty(9, 96, dtype=torch.int64).view(torch.uint8)  # 768-byte rows, 64-byte aligned
    words = swap_in_cpu._as_words(pool)
    assert rows_can_stream(words, words)
    assert not rows_can_stream(words, swap_in_cpu._as_words(pool.view(-1)[8:8 + 768 * 8].view(8, 768)))
    assert not rows_can_stream(words[:, :88], words[:, :88])  # 704 bytes a row: not contiguous rows
    assert not rows_can_stream(words, words.view(np.uint32))  # rows of other elements
    half_lines = swap_in_cpu._as_words(torch.empty(4, 40, dtype=torch.uint8))  # 5 words
    assert not rows_can_stream(half_lines, half_lines)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_rows_wider_than_one_copy_block_are_copied_whole(backend):
    """The Triton kernel copies a row in blocks of at most 1024 words; a latent or K/V row of more than 8 KiB
    (1050 words here) takes two, and the cpu path's word loop must cover it too."""
    case = make_case(seed=5, batch=2, num_slots=4, width=3, num_steps=3, row_width=2100)
    results, _, _, _ = run(case, "lru", backend)  # check_step compares every selected row's bytes
    assert sum(int(r.misses.sum()) for r in results) > 0


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("policy", ["lru", "fifo", "lrfu"])
def test_evicting_position_zero_counts_as_an_eviction(backend, policy):
    """A full buffer whose oldest slot holds position 0 (the first token, a real token, not an empty slot):
    the miss that replaces it is an eviction."""
    slot_pos = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    lru = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    pol = get_policy(policy, num_rows=1, num_slots=3)
    res = swap_in(torch.tensor([[7, 2]]), torch.tensor([0]), slot_pos, lru, torch.arange(3).view(1, -1),
                  torch.arange(10).view(1, -1), torch.randn(10, 4), torch.zeros(3, 4), policy=pol, backend=backend)
    assert slot_pos[0].tolist() == [7, 1, 2]
    assert (res.misses.tolist(), res.evictions.tolist(), res.hits.tolist()) == ([1], [1], [1])


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_an_lrfu_ghost_entry_is_never_read_as_a_slot(backend):
    """The kernels' sparse set maps a ghost position p to S + its entry; read as a slot, S + 2 would be slot 2
    of the next row, which holds p. p is a ghost of row 0, not in its buffer: a miss (and the ghost returns),
    not a hit on row 1's slot."""
    slot_pos = torch.tensor([[10, 11, 12], [20, 21, 50]], dtype=torch.int32)
    lru = torch.tensor([[0, 1, 2], [0, 1, 2]], dtype=torch.int32)
    policy = get_policy("lrfu", num_rows=2, num_slots=3)
    policy.state["ghost_pos"][0] = torch.tensor([-1, -1, 50], dtype=torch.int32)
    policy.state["ghost_value"][0, 2] = policy.HIT
    res = swap_in(torch.tensor([[50]]), torch.tensor([0]), slot_pos, lru, torch.arange(6).view(2, 3),
                  torch.arange(120).view(2, 60), torch.randn(120, 4), torch.zeros(6, 4), policy=policy, backend=backend)
    assert (res.misses.tolist(), res.hits.tolist()) == ([1], [0])
    assert res.page_table.tolist() == [[0]] and slot_pos.tolist() == [[50, 11, 12], [20, 21, 50]]
    assert policy.state["ghost_pos"][0].tolist() == [-1, -1, 10]


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_score_lru_ages_saturate_on_every_backend(backend):
    """A reset puts empty slots at AGE_LIMIT; a step that leaves one empty must keep it there (the random
    traces reset rows without the policy, so their ages never come near the limit)."""
    slot_pos, lru = new_slot_tables(1, 4)
    policy = get_policy("score_lru", num_rows=1, num_slots=4)
    reset_row(slot_pos, lru, 0, [10], policy)
    limit, held = policy.AGE_LIMIT, policy.HELD_AGE
    res = swap_in(torch.tensor([[20]]), torch.tensor([0]), slot_pos, lru, torch.arange(4).view(1, -1),
                  torch.arange(30).view(1, -1), torch.randn(30, 4), torch.zeros(4, 4), policy=policy, backend=backend)
    assert res.page_table.tolist() == [[1]] and slot_pos[0].tolist() == [10, 20, -1, -1]
    assert policy.state["age"][0].tolist() == [held + 1, policy.LOAD_AGE_STEPS, limit, limit]


def test_lru_page_tables_run_in_c_where_built():
    """The CPU's default policy plans a decode step's page table in C (`lru_page_table_cpu`); the others in numba."""
    from hisparse.kernels import lru_page_table_cpu

    args = _tables()
    tensors = [args[k] for k in ("slot_pos", "lru", "device_rows", "host_rows", "host_kv", "device_kv")]
    lru_bound = bound_swap_in("cpu", get_policy("lru", num_rows=2, num_slots=4), *tensors)
    fifo_bound = bound_swap_in("cpu", get_policy("fifo", num_rows=2, num_slots=4), *tensors)
    assert (lru_bound.lru_page_table is not None) == lru_page_table_cpu.available()
    assert fifo_bound.lru_page_table is None


@pytest.mark.parametrize(
    ("selected", "rows", "match"),
    [
        ([[0, 10], [2, -1]], [0, 1], "top_k positions must be"),
        ([[0, 1], [2, -1]], [1, 1], "same row"),
        ([[0, 1], [2, -1]], [0, 2], "rows must be in"),
        ([[0, 1, 2, 3, 4], [2, -1, -1, -1, -1]], [0, 1], "4 slots"),
    ],
)
def test_the_c_lru_page_table_refuses_bad_values_and_changes_nothing(selected, rows, match):
    from hisparse.kernels import lru_page_table_cpu

    if not lru_page_table_cpu.available():
        pytest.skip("no C compiler: the numba plan serves lru")
    args = _tables()
    slot_pos, lru, device_kv = args["slot_pos"].clone(), args["lru"].clone(), args["device_kv"].clone()
    totals = torch.zeros(3, dtype=torch.int64)
    table = lru_page_table_cpu.LruPageTable(args["slot_pos"], args["lru"], args["device_rows"], args["host_rows"],
                                            args["host_kv"], args["device_kv"], totals)
    with pytest.raises(ValueError, match=match):
        table(torch.tensor(selected), torch.tensor(rows), torch.tensor([-2, -2]), torch.tensor([0, 0]), False)
    assert torch.equal(args["slot_pos"], slot_pos) and torch.equal(args["lru"], lru)
    assert torch.equal(args["device_kv"], device_kv) and not totals.any()
