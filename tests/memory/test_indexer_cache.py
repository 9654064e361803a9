"""IndexerKeyCache: FP8 and int8 key rows, and select() against a brute-force reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse.layers.dsa_indexer import IndexKeyFormat, hadamard
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


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4), top_k=st.integers(1, 48),
       heads=st.integers(1, 4), seed=st.integers(0, 2**16), fp8=st.booleans())
def test_select_matches_brute_force(lengths, top_k, heads, seed, fp8):
    cache, slots, q, w, lengths_t = random_batch(lengths, heads, seed, layer=1, key_format=FP8 if fp8 else INT8)
    b, width = slots.shape
    picked = cache.select(1, q, w, slots, lengths_t, top_k)
    assert picked.shape == (b, min(top_k, width)) and picked.dtype == torch.int64
    for row, length in enumerate(lengths):
        chosen = [p for p in picked[row].tolist() if p >= 0]
        assert chosen == sorted(set(chosen)), "ascending, no repeats"
        assert picked[row].tolist()[len(chosen):] == [-1] * (picked.shape[1] - len(chosen)), "padding last"
        assert len(chosen) == min(top_k, length)
        assert length - 1 in chosen, "the newest position is always selected"
        if length <= top_k:
            assert chosen == list(range(length)), "short context: exactly dense"
            continue
        scores = brute_force_scores(cache, 1, q[row], w[row], slots[row], length)
        scores[length - 1] = float("inf")
        rest = [p for p in range(length) if p not in chosen]
        # Every selected position scores at least as high as every one left out (ties may go either way).
        assert scores[chosen].min() >= scores[rest].max() - 1e-4 * (1 + scores[rest].abs().max())


def test_keys_survive_fp8_with_small_error_and_68_bytes():
    cache = IndexerKeyCache(3, 16, FP8)
    assert cache.rows.shape == (3, 16, 68) and cache.bytes_per_token == 3 * 68
    keys = torch.randn(16, D)
    cache.write(2, torch.arange(16), keys)
    back = cache.keys(2, torch.arange(16))
    keys = hadamard(keys)  # rows hold the Hadamard-rotated key (dot products with a rotated query unchanged)
    rel = (back - keys).norm(dim=-1) / keys.norm(dim=-1)
    assert rel.max() < 0.06  # e4m3 keeps 3 mantissa bits
    assert cache.rows[0].abs().sum() == 0, "other layers untouched"


def test_keys_survive_int8_within_half_a_step_and_68_bytes():
    cache = IndexerKeyCache(2, 16, INT8)
    assert cache.rows.shape == (2, 16, 68) and cache.bytes_per_token == 2 * 68
    keys = torch.randn(16, D)
    keys[3] = 0.0  # an all-zero key stays zero (no division by a zero scale)
    cache.write(1, torch.arange(16), keys)
    back = cache.keys(1, torch.arange(16))
    step = keys.abs().amax(dim=-1, keepdim=True) / 127  # no rotation: the key itself, rounded to its step
    assert back.dtype == torch.float32 and ((back - keys).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(back[3], keys[3])
    assert torch.equal(cache.format.prepare_query(keys), keys)


def test_each_key_is_read_back_from_the_slot_it_was_written_to():
    """Slots in the order a request holds them, not sorted (a request reuses slots others gave back)."""
    cache = IndexerKeyCache(2, 32, IndexKeyFormat("float32", D))
    slots = torch.tensor([17, 3, 30, 8, 0, 21])
    keys = torch.randn(6, D, generator=torch.Generator().manual_seed(0))
    cache.write(1, slots, keys)
    assert torch.equal(cache.keys(1, slots), keys)  # float32 rows: exact
    assert torch.equal(cache.keys(1, slots[[4, 0]]), keys[[4, 0]])
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert cache.rows[1, untouched].abs().sum() == 0 and cache.rows[0].abs().sum() == 0


def test_selection_works_in_positions_not_slots():
    cache = IndexerKeyCache(1, 64, INT8)
    slots = torch.tensor([[40, 3, 17, 9, 60]])
    keys = torch.zeros(5, D)
    keys[2, 0] = 10.0  # position 2 (slot 17) is the only key that matches the query
    cache.write(0, slots[0], keys)
    q = torch.zeros(1, 1, D)
    q[0, 0, 0] = 1.0
    picked = cache.select(0, q, torch.ones(1, 1), slots, torch.tensor([5]), top_k=2)
    assert picked.tolist() == [[2, 4]]


@pytest.mark.parametrize("compiled", [True, False])
@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4), top_k=st.integers(1, 24),
       num_next=st.integers(0, 30), seed=st.integers(0, 2**16))
def test_select_with_next_ranks_the_runners_up_and_selects_exactly_as_select(compiled, lengths, top_k, num_next,
                                                                              seed):
    """Both paths: the compiled top-k with its runners-up (the CPU's) and PyTorch's (every other device)."""
    cache, slots, q, w, lengths_t = random_batch(lengths, 2, seed, layer=0)
    cache.compiled_top_k = compiled
    b = slots.shape[0]
    picked, following = cache.select_with_next(0, q, w, slots, lengths_t, top_k, num_next)
    assert torch.equal(picked, cache.select(0, q, w, slots, lengths_t, top_k))
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
