"""The lrfu eviction policy: its rule on hand-worked rows, LRU as its limit, and swap-in's invariants."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hisparse.kernels.swap_in import resolve_backend, swap_in
from hisparse.memory.eviction import EVICTION_POLICIES, get_policy, new_slot_tables
from hisparse.memory.eviction_lrfu import LRFUPolicy

# The swap-in tests' random decode runs and per-step invariant checks (tests/ has no packages).
_spec = importlib.util.spec_from_file_location(
    "swap_in_test_helpers", Path(__file__).resolve().parents[1] / "kernels" / "test_swap_in.py")
helpers = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(helpers)

ONE = LRFUPolicy.ONE
FULL = [10, 11, 12, 13]
ORDER = [0, 1, 2, 3]
FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Params(LRFUPolicy):
    """lrfu with chosen parameters (the registered class carries the tuned ones)."""

    def __init__(self, decay: int, load_score: int, *args) -> None:
        super().__init__(*args)
        self.decay, self.load_score = decay, load_score


def test_stateful_and_not_an_engine_choice():
    assert "lrfu" not in EVICTION_POLICIES  # it does not beat LRU on recorded traces
    with pytest.raises(ValueError, match="per-slot state"):
        LRFUPolicy()
    policy = LRFUPolicy(num_rows=2, num_slots=4)
    assert policy.state["score"].dtype == torch.int32 and policy.state["score"].shape == (2, 4)


def test_evicts_the_lowest_score_not_the_least_recent():
    # slot 0 is least recent but was selected often; slot 1 is more recent with a lower score.
    policy = Params(ONE // 2, ONE // 2, 1, 4)
    plan = policy.plan_row([12, 20], FULL, ORDER, {"score": [3 * ONE, ONE, 2 * ONE, ONE]})
    assert plan.victims == [1]  # lowest score among 0, 1, 3; the tie of 1 and 3 goes to the order
    # decay halves every score, the hit adds ONE, the load starts at load_score
    assert plan.state["score"] == [3 * ONE // 2, ONE // 2, 2 * ONE, ONE // 2]
    # by score, ties as LRU would order them: untouched (3), then loaded (1)
    assert plan.order == [3, 1, 0, 2]


def test_without_decay_and_full_load_score_it_is_lru():
    lru = get_policy("lru")
    lrfu = Params(0, ONE, 1, 4)
    for top_k, order in (([12, 20, 10, -1], ORDER), ([30, 31], [3, 2, 1, 0]), ([13, 40], [1, 3, 0, 2])):
        a = lru.plan_row(top_k, FULL, order)
        b = lrfu.plan_row(top_k, FULL, order, {"score": [0, 0, 0, 0]})
        assert (a.victims, a.order, a.slots) == (b.victims, b.order, b.slots)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_swap_in_runs_it_on_the_reference_on_cpu(backend):
    assert resolve_backend("auto", LRFUPolicy(1, 4), torch.device("cpu")) == "reference"
    slot_pos, lru = new_slot_tables(1, 4)
    policy = LRFUPolicy(num_rows=1, num_slots=4)
    res = swap_in(torch.tensor([[3, 1]]), torch.tensor([0]), slot_pos, lru, torch.arange(4).view(1, -1),
                  torch.arange(8).view(1, -1), torch.randn(8, 2), torch.zeros(4, 2), policy=policy,
                  backend=backend)
    assert res.misses.tolist() == [2]
    assert sorted(p for p in slot_pos[0].tolist() if p >= 0) == [1, 3]


@FAST
@given(case=helpers.cases(), decay=st.integers(0, ONE), load_score=st.integers(0, 2 * ONE))
def test_swap_in_invariants_hold(case, decay, load_score):
    """lru stays a permutation, no position twice, every selected row in place, and the order stays
    sorted by score (the next victim candidate first)."""
    case = case.clone()
    policy = Params(decay, load_score, case.num_rows, case.num_slots)
    for top_k in case.steps:
        slot_before, lru_before = case.slot_pos.clone(), case.lru.clone()
        res = swap_in(top_k, case.rows, case.slot_pos, case.lru, case.device_rows, case.host_rows,
                      case.host_kv, case.device_kv, policy=policy, backend="reference")
        helpers.check_step(case, top_k, slot_before, lru_before, res)
        for r in case.rows.tolist():
            scores = policy.state["score"][r][case.lru[r].long()].tolist()
            assert scores == sorted(scores)
