"""The one selection path: IndexSelector's decode and prompt-chunk top-k against brute force, for both rules
of the newest token, and the runners-up an eviction policy reads."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse.attention.index_selection import IndexSelector, runners_up
from hisparse.formats.index_key import IndexKeyFormat
from hisparse.memory.indexer_cache import IndexerKeyCache

D = 64
FP8, INT8 = IndexKeyFormat("fp8", D), IndexKeyFormat("int8", D)


def brute_force_scores(cache, layer, q, w, slots, length):
    """Scores of positions 0..length-1 from the stored (dequantized) keys, one position at a time."""
    qq = cache.format.prepare_query(q).double()  # the query in the keys' basis and precision
    out = []
    for p in range(length):
        key = cache.keys(layer, slots[p:p + 1])[0].double()
        out.append(sum(float(w[h]) * max(0.0, float(qq[h] @ key)) for h in range(q.shape[0])))
    return torch.tensor(out, dtype=torch.float64)


def random_batch(lengths, heads, seed, layer, key_format=FP8):
    """A cache whose `layer` holds random keys for a batch of requests of these lengths, and a random
    indexer query and head weights per request: (cache, slots [B, width], q, w, lengths)."""
    g = torch.Generator().manual_seed(seed)
    b, width = len(lengths), max(lengths)
    cache = IndexerKeyCache(layer + 1, 200, key_format)
    slots = torch.stack([torch.from_numpy(cache.allocator.allocate(width)) for _ in range(b)])
    for row in range(b):
        cache.write(layer, slots[row], torch.randn(width, D, generator=g))
    q, w = torch.randn(b, heads, D, generator=g), torch.randn(b, heads, generator=g)
    return cache, slots, q, w, torch.tensor(lengths)


def assert_top_k_of(chosen: list[int], scores: torch.Tensor, length: int, top_k: int) -> None:
    """`chosen` lists, ascending without repeats, min(top_k, length) positions below `length`, none of them
    scored lower than one left out (ties may go either way)."""
    assert chosen == sorted(set(chosen)), "ascending, no repeats"
    assert len(chosen) == min(top_k, length) and all(0 <= p < length for p in chosen)
    rest = [p for p in range(length) if p not in chosen]
    if rest:
        finite = scores[:length][torch.isfinite(scores[:length])]
        tol = 1e-4 * (1 + finite.abs().max()) if finite.numel() else 0.0
        assert scores[chosen].min() >= scores[rest].max() - tol


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4), top_k=st.integers(1, 48),
       heads=st.integers(1, 4), seed=st.integers(0, 2**16), fp8=st.booleans(), newest=st.booleans())
def test_decode_select_matches_brute_force(lengths, top_k, heads, seed, fp8, newest):
    cache, slots, q, w, lengths_t = random_batch(lengths, heads, seed, layer=1, key_format=FP8 if fp8 else INT8)
    b, width = slots.shape
    picked = IndexSelector(cache, select_newest=newest).select(1, q, w, slots, lengths_t, top_k)
    assert picked.shape == (b, min(top_k, width)) and picked.dtype == torch.int64
    for row, length in enumerate(lengths):
        chosen = [p for p in picked[row].tolist() if p >= 0]
        assert picked[row].tolist()[len(chosen):] == [-1] * (picked.shape[1] - len(chosen)), "padding last"
        if length <= top_k:
            assert chosen == list(range(length)), "short context: exactly dense"
            continue
        scores = brute_force_scores(cache, 1, q[row], w[row], slots[row], length)
        if newest:
            assert length - 1 in chosen, "the rule: the newest position is always selected"
            scores[length - 1] = float("inf")
        assert_top_k_of(chosen, scores, length, top_k)


@settings(max_examples=30, deadline=None)
@given(start=st.integers(0, 30), chunk=st.integers(1, 20), top_k=st.integers(1, 24), heads=st.integers(1, 3),
       seed=st.integers(0, 2**16), newest=st.booleans())
def test_chunk_select_is_each_querys_causal_top_k(start, chunk, top_k, heads, seed, newest):
    """A prompt chunk's queries (positions start..start+chunk-1) each select over their own causal past."""
    end = start + chunk
    g = torch.Generator().manual_seed(seed)
    cache = IndexerKeyCache(1, 64, FP8)
    slots = torch.randperm(64, generator=g)[:end]
    cache.write(0, slots, torch.randn(end, D, generator=g))
    q, w = torch.randn(chunk, heads, D, generator=g), torch.randn(chunk, heads, generator=g)
    positions = torch.arange(start, end)
    picked = IndexSelector(cache, select_newest=newest).select_chunk(0, q, w, slots, positions, top_k)
    assert picked.shape == (chunk, min(top_k, end))
    for t, p in enumerate(positions.tolist()):
        chosen = [s for s in picked[t].tolist() if s >= 0]
        scores = brute_force_scores(cache, 0, q[t], w[t], slots, p + 1)
        if newest:
            assert p in chosen
            scores[p] = float("inf")
        assert_top_k_of(chosen, scores, p + 1, top_k)


def test_a_chunk_selects_as_decode_does_for_the_same_query():
    """One path: a query's top-k is the same whether it comes in a prompt chunk or as a decode step."""
    cache, slots, q, w, _ = random_batch([30], 2, seed=7, layer=0)
    selector = IndexSelector(cache, select_newest=False)
    chunk = selector.select_chunk(0, q, w, slots[0], torch.tensor([29]), top_k=8)
    assert torch.equal(chunk, selector.select(0, q, w, slots, torch.tensor([30]), top_k=8))


def test_selection_works_in_positions_not_slots():
    cache = IndexerKeyCache(1, 64, INT8)
    slots = torch.tensor([[40, 3, 17, 9, 60]])
    keys = torch.zeros(5, D)
    keys[2, 0] = 10.0  # position 2 (slot 17) is the only key that matches the query
    cache.write(0, slots[0], keys)
    q = torch.zeros(1, 1, D)
    q[0, 0, 0] = 1.0
    picked = IndexSelector(cache).select(0, q, torch.ones(1, 1), slots, torch.tensor([5]), top_k=2)
    assert picked.tolist() == [[2, 4]]


@pytest.mark.parametrize("compiled", [True, False])
@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4), top_k=st.integers(1, 24),
       num_next=st.integers(0, 30), seed=st.integers(0, 2**16))
def test_select_with_next_ranks_the_runners_up_and_selects_exactly_as_select(compiled, lengths, top_k, num_next,
                                                                              seed):
    """Both paths: the compiled top-k with its runners-up (the CPU's) and PyTorch's (every other device)."""
    cache, slots, q, w, lengths_t = random_batch(lengths, 2, seed, layer=0)
    selector = IndexSelector(cache)
    selector.compiled_top_k = compiled
    b = slots.shape[0]
    picked, following = selector.select_with_next(0, q, w, slots, lengths_t, top_k, num_next)
    assert torch.equal(picked, selector.select(0, q, w, slots, lengths_t, top_k))
    assert following.shape == (b, num_next) and following.dtype == torch.int64
    for row, length in enumerate(lengths):
        chosen = {p for p in picked[row].tolist() if p >= 0}
        ranked = [p for p in following[row].tolist() if p >= 0]
        assert following[row].tolist()[len(ranked):] == [-1] * (num_next - len(ranked)), "padding last"
        assert len(ranked) == min(num_next, length - len(chosen))
        assert not chosen & set(ranked) and len(set(ranked)) == len(ranked)
        assert all(0 <= p < length for p in ranked)
        scores = brute_force_scores(cache, 0, q[row], w[row], slots[row], length)
        tol = 1e-4 * (1 + scores.abs().max())
        assert all(scores[x] >= scores[y] - tol for x, y in zip(ranked, ranked[1:], strict=False)), "best first"
        rest = [p for p in range(length) if p not in chosen and p not in ranked]
        if ranked and rest:
            assert scores[ranked].min() >= scores[rest].max() - tol


def test_runners_up_are_the_next_best_candidates_best_first():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(6, 12, generator=g)
    positions = torch.tensor([1, 3, 5, 7, 9, 11])
    scores = scores.masked_fill(torch.arange(12)[None, :] > positions[:, None], float("-inf"))  # causal
    picked = IndexSelector.select_reference(scores, 3)
    ranked = runners_up(scores, picked, num_next=4)
    assert ranked.shape == (6, 4) and ranked.dtype == torch.int64
    for t, p in enumerate(positions.tolist()):
        order = sorted(range(p + 1), key=lambda s: -float(scores[t, s]))  # distinct random scores: no ties
        chosen = [s for s in picked[t].tolist() if s >= 0]
        assert sorted(chosen) == sorted(order[:3])  # every past position when there are at most 3
        expected = order[len(chosen):len(chosen) + 4]
        assert ranked[t].tolist() == expected + [-1] * (4 - len(expected))
    assert runners_up(scores, picked, num_next=0).shape == (6, 0)
