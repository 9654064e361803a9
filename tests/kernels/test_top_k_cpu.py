"""The compiled top-k against the PyTorch reference, and its own rules: ascending, -inf never, ties earliest."""

from __future__ import annotations

from unittest.mock import patch

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hisparse.attention.index_selection import IndexSelector
from hisparse.kernels import top_k_cpu
from hisparse.kernels.top_k_cpu import top_k_and_runners_up, top_k_ascending

FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def random_scores(seed: int, batch: int, width: int, ties: bool) -> torch.Tensor:
    """Scores as the indexer leaves them: -inf past each row's length, +inf at its newest position."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 4, (batch, width), generator=g).float() if ties else torch.randn(batch, width,
                                                                                                generator=g)
    lengths = torch.randint(1, width + 1, (batch,), generator=g)
    for b, n in enumerate(lengths.tolist()):
        scores[b, n:] = float("-inf")
        scores[b, n - 1] = float("inf")
    return scores


def run(scores: torch.Tensor, k: int, parallel: bool) -> torch.Tensor:
    with patch.object(top_k_cpu, "PARALLEL_MIN_SCORES", 0 if parallel else top_k_cpu.PARALLEL_MIN_SCORES):
        return top_k_ascending(scores, k)


# Rows of scores and a k: (seed, batch, width, k <= width, parallel).
ROWS = st.tuples(st.integers(0, 2**16), st.integers(1, 6), st.integers(1, 400), st.integers(1, 400),
                 st.booleans()).map(lambda t: (t[0], t[1], t[2], min(t[3], t[2]), t[4]))


@FAST
@given(case=ROWS)
def test_matches_the_reference_without_ties(case):
    seed, batch, width, k, parallel = case
    scores = random_scores(seed, batch, width, ties=False)
    assert torch.equal(run(scores, k, parallel), IndexSelector.select_reference(scores, k))


@FAST
@given(case=ROWS)
def test_ties_go_to_the_earliest_positions(case):
    seed, batch, width, k, parallel = case
    scores = random_scores(seed, batch, width, ties=True)
    got = run(scores, k, parallel)
    reference = IndexSelector.select_reference(scores, k)
    assert got.shape == (batch, k) and got.dtype == torch.int64
    for b in range(batch):
        row = scores[b]
        finite_or_newest = (row > float("-inf")).nonzero().squeeze(1)
        picked = [p for p in got[b].tolist() if p >= 0]
        assert got[b].tolist()[len(picked):] == [-1] * (k - len(picked)), "padding last"
        assert len(picked) == min(k, finite_or_newest.numel())
        assert picked == sorted(set(picked)), "ascending, no repeats"
        # The expected set: a stable sort by descending score keeps the earliest of equal scores first.
        order = sorted(finite_or_newest.tolist(), key=lambda p: -float(row[p]))
        assert picked == sorted(order[:k])
        theirs = [p for p in reference[b].tolist() if p >= 0]
        assert sorted(row[picked].tolist()) == sorted(row[theirs].tolist()), "the reference's scores, ties aside"


@FAST
@given(case=ROWS, n=st.integers(0, 60), ties=st.booleans())
def test_runners_up_are_the_next_best_columns_best_first_ties_earliest(case, n, ties):
    """The top-k part is top_k_ascending's exactly; the runners-up are what a stable sort by descending
    score lists after the top-k (ties to the earlier column), -inf never, -1 padding last."""
    seed, batch, width, k, parallel = case
    scores = random_scores(seed, batch, width, ties=ties)
    with patch.object(top_k_cpu, "PARALLEL_MIN_SCORES", 0 if parallel else top_k_cpu.PARALLEL_MIN_SCORES):
        picked, following = top_k_and_runners_up(scores, k, n)
    assert torch.equal(picked, run(scores, k, parallel))
    assert following.shape == (batch, n) and following.dtype == torch.int64
    for b in range(batch):
        row = scores[b]
        chosen = set(picked[b].tolist()) - {-1}
        order = sorted((p for p in range(width) if row[p] > float("-inf")), key=lambda p: -float(row[p]))
        expected = [p for p in order if p not in chosen][:n]
        assert following[b].tolist() == expected + [-1] * (n - len(expected))


def test_a_row_of_one_token_selects_it():
    scores = torch.tensor([[float("inf"), float("-inf"), float("-inf")]])
    assert top_k_ascending(scores, 2).tolist() == [[0, -1]]


def test_serial_and_parallel_kernels_are_separate_functions():
    """numba's disk cache keys compiled code by the Python function and the argument types, not by
    `parallel`: one function compiled both ways would load one variant's code for both."""
    from hisparse.kernels import swap_in_cpu

    pairs = [(top_k_cpu._top_k_serial, top_k_cpu._top_k_parallel),
             (top_k_cpu._top_k_runners_up_serial, top_k_cpu._top_k_runners_up_parallel),
             (swap_in_cpu._plan_batch_serial, swap_in_cpu._plan_batch_parallel),
             (swap_in_cpu._copy_rows_serial, swap_in_cpu._copy_rows_parallel)]
    for serial, parallel in pairs:
        assert serial.py_func is not parallel.py_func
        assert not serial.targetoptions.get("parallel") and parallel.targetoptions.get("parallel")
