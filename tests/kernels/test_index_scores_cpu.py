"""The compiled int8 indexer scorer against the PyTorch reference: same masks, same scores to float32 rounding."""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hisparse.attention.index_selection import IndexSelector
from hisparse.formats.index_key import IndexKeyFormat
from hisparse.kernels import index_scores_cpu
from hisparse.memory.indexer_cache import IndexerKeyCache


def random_cache(seed: int, head_dim: int, num_slots: int, layers: int = 2) -> IndexSelector:
    g = torch.Generator().manual_seed(seed)
    cache = IndexerKeyCache(layers, num_slots, IndexKeyFormat("int8", head_dim))
    for layer in range(layers):
        cache.write(layer, torch.arange(num_slots), torch.randn(num_slots, head_dim, generator=g) * 3)
    return IndexSelector(cache)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 5), width=st.integers(1, 700), heads=st.integers(1, 6),
       head_dim=st.sampled_from([4, 12, 64, 128]), parallel=st.booleans(), weight_dtype=st.sampled_from(
           [torch.float32, torch.bfloat16]))
def test_compiled_scores_match_the_reference(seed, batch, width, heads, head_dim, parallel, weight_dtype):
    g = torch.Generator().manual_seed(seed + 1)
    cache = random_cache(seed, head_dim, num_slots=width + 50)
    assert cache.compiled_scores
    slots = torch.stack([torch.randperm(width + 50, generator=g)[:width] for _ in range(batch)])
    lengths = torch.randint(1, width + 1, (batch,), generator=g)
    q = torch.randn(batch, heads, head_dim, generator=g)
    w = torch.randn(batch, heads, generator=g).to(weight_dtype)  # negative weights too: ReLU before weighting
    # The small cases would all run serially.
    with patch.object(index_scores_cpu, "PARALLEL_MIN_KEYS", 0 if parallel else 1 << 60):
        got = cache._past_scores(1, q, w, slots, lengths)
    want = cache.past_scores_reference(1, q, w, slots, lengths)
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape == (batch, width)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)) and torch.equal(got[~finite], want[~finite]), "masks differ"
    for b in range(batch):
        n = int(lengths[b])
        assert got[b, n - 1] == float("inf") and (got[b, n:] == float("-inf")).all()
    if finite.any():  # (every request may be one token long: only masks)
        assert (got[finite] - want[finite]).abs().max() <= 1e-5 * (1 + want[finite].abs().max())


def test_selection_uses_the_compiled_scorer_only_where_it_applies():
    assert random_cache(0, 64, 8).compiled_scores
    for key_format in (IndexKeyFormat("fp8", 64), IndexKeyFormat("float32", 64),
                       IndexKeyFormat("int8", 6)):  # the last: its scale is not on an fp32 word
        assert not IndexSelector(IndexerKeyCache(1, 8, key_format)).compiled_scores
    # The compiled scorer sets the newest score to +inf: a model whose indexer scores it (DSA) takes PyTorch's.
    assert not IndexSelector(IndexerKeyCache(1, 8, IndexKeyFormat("int8", 64)), select_newest=False).compiled_scores


def test_the_compiled_scorer_really_runs(monkeypatch):
    """A decode step's selection is one compiled call, scores and top-k; the runners-up path scores apart."""
    calls = []

    def spy(name):
        real = getattr(index_scores_cpu, name)
        monkeypatch.setattr(f"hisparse.attention.index_selection.{name}",
                            lambda *args: calls.append(name) or real(*args))

    spy("int8_top_k"), spy("int8_past_scores")
    cache = random_cache(1, 64, 40)
    args = (0, torch.randn(2, 4, 64), torch.rand(2, 4), torch.arange(40).repeat(2, 1), torch.tensor([40, 30]))
    picked = cache.select(*args, top_k=8)
    assert calls == ["int8_top_k"] and picked.shape == (2, 8)
    picked_again, _ = cache.select_with_next(*args, top_k=8, num_next=4)
    assert calls == ["int8_top_k", "int8_past_scores"] and torch.equal(picked_again, picked)


def test_scores_of_positions_past_the_length_are_never_read():
    """Padding slots (0 for a short request in a batch) may point anywhere: only masks come out there."""
    cache = random_cache(2, 64, 16)
    slots = torch.tensor([[3, 4, 5, 0, 0, 0]])
    out = cache._past_scores(0, torch.randn(1, 2, 64), torch.rand(1, 2), slots, torch.tensor([3]))
    assert torch.isfinite(out[0, :2]).all() and out[0, 2] == float("inf") and (out[0, 3:] == float("-inf")).all()


def test_a_slot_outside_the_key_rows_is_refused():
    cache = random_cache(3, 64, 16)
    with pytest.raises(ValueError, match=r"a slot is outside the key rows \[0, 16\)"):
        cache._past_scores(0, torch.randn(1, 2, 64), torch.rand(1, 2), torch.tensor([[3, 16, 5]]), torch.tensor([3]))


def test_lengths_past_the_slots_width_are_refused():
    cache = random_cache(4, 64, 16)
    with pytest.raises(ValueError, match=r"lengths must be in \[0, 3\]"):
        cache._past_scores(0, torch.randn(1, 2, 64), torch.rand(1, 2), torch.tensor([[3, 4, 5]]), torch.tensor([100]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), batch=st.integers(1, 5), width=st.integers(1, 700), top_k=st.integers(1, 300),
       levels=st.sampled_from([3, 256]), parallel=st.booleans())
def test_fused_top_k_selects_what_the_two_kernels_select(seed, batch, width, top_k, levels, parallel):
    """int8_top_k against top_k_ascending over int8_past_scores: the same positions, ties (few key levels, few
    query levels: many equal scores) to the earlier, -inf never, -1 padding."""
    from hisparse.kernels.top_k_cpu import top_k_ascending

    g = torch.Generator().manual_seed(seed)
    head_dim, heads, num_slots = 64, 4, width + 50
    rows = torch.randint(0, levels, (num_slots, head_dim + 4), dtype=torch.uint8, generator=g)
    rows[:, head_dim:] = torch.full((num_slots, 1), 0.25).view(torch.uint8)  # every scale 0.25
    slots = torch.stack([torch.randperm(num_slots, generator=g)[:width] for _ in range(batch)])
    lengths = torch.randint(0, width + 1, (batch,), generator=g)
    q = torch.randint(-1, 2, (batch, heads, head_dim), generator=g).float()
    w = torch.randn(batch, heads, generator=g)
    k = min(top_k, width)
    with patch.object(index_scores_cpu, "PARALLEL_MIN_KEYS", 0 if parallel else 1 << 60):
        got = index_scores_cpu.int8_top_k(rows, head_dim, slots, q, w, lengths, k)
        want = top_k_ascending(index_scores_cpu.int8_past_scores(rows, head_dim, slots, q, w, lengths), k)
    assert got.dtype == torch.int64 and torch.equal(got, want)


def test_fused_top_k_refuses_what_it_cannot_read():
    rows = torch.zeros(10, 68, dtype=torch.uint8)
    q, w = torch.zeros(1, 4, 64), torch.zeros(1, 4)
    with pytest.raises(ValueError, match="a slot is outside the key rows"):
        index_scores_cpu.int8_top_k(rows, 64, torch.tensor([[0, 12, 1]]), q, w, torch.tensor([3]), 2)
    with pytest.raises(ValueError, match="lengths must be in"):
        index_scores_cpu.int8_top_k(rows, 64, torch.tensor([[0, 1, 2]]), q, w, torch.tensor([4]), 2)
    with pytest.raises(ValueError, match="k must be in"):
        index_scores_cpu.int8_top_k(rows, 64, torch.tensor([[0, 1, 2]]), q, w, torch.tensor([3]), 4)


def test_fused_top_k_of_nothing_is_empty():
    """A batch with no past positions (width 0) selects none, as the two kernels do."""
    from hisparse.kernels.top_k_cpu import top_k_ascending

    rows, slots = torch.zeros(4, 68, dtype=torch.uint8), torch.zeros(2, 0, dtype=torch.int64)
    q, w, lengths = torch.zeros(2, 4, 64), torch.zeros(2, 4), torch.zeros(2, dtype=torch.int64)
    got = index_scores_cpu.int8_top_k(rows, 64, slots, q, w, lengths, 0)
    assert got.shape == (2, 0) and got.dtype == torch.int64
    assert torch.equal(got, top_k_ascending(index_scores_cpu.int8_past_scores(rows, 64, slots, q, w, lengths), 0))
