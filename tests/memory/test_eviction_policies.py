"""Eviction policies on hand-worked examples, the registry, and the slot-table helpers."""

from __future__ import annotations

import pytest
import torch

from hisparse.memory.eviction import (
    EVICTION_POLICIES,
    ClockPolicy,
    FIFOPolicy,
    LRUPolicy,
    get_policy,
    new_slot_tables,
    reset_row,
    resolve_policy,
)

# Four full slots, slot 0 oldest; the step selects 12 (slot 2), 20 (new) and 10 (slot 0).
FULL = [10, 11, 12, 13]
ORDER = [0, 1, 2, 3]
TOP_K = [12, 20, 10, -1]


def test_lru_loads_into_oldest_unselected_slot_and_refreshes_hits():
    plan = LRUPolicy().plan_row(TOP_K, FULL, ORDER)
    assert plan.miss_columns == [1]
    assert plan.victims == [1]
    assert plan.slots == [2, 1, 0, -1]
    # untouched evictables, then loaded, then hits in their old relative order
    assert plan.order == [3, 1, 0, 2]


def test_lru_misses_take_evictables_in_column_order():
    plan = LRUPolicy().plan_row([30, 31], FULL, [3, 2, 1, 0])
    assert plan.victims == [3, 2]
    assert plan.order == [1, 0, 3, 2]


def test_fifo_hit_does_not_refresh():
    plan = FIFOPolicy().plan_row(TOP_K, FULL, ORDER)
    assert plan.victims == [1]
    assert plan.order == [0, 2, 3, 1]


def test_clock_gives_referenced_slot_a_second_chance_and_skips_selected_ones():
    clock = ClockPolicy(num_rows=1, num_slots=4)
    # slot 1 was referenced before; slot 2 is hit now; two misses.
    plan = clock.plan_row([12, 20, 21], FULL, ORDER, {"referenced": [0, 1, 0, 0]})
    assert plan.victims == [0, 3]  # slot 0 unreferenced; slot 1 loses its bit; slot 2 pinned
    assert plan.state["referenced"] == [1, 0, 1, 1]
    assert plan.order == [0, 1, 2, 3]  # the hand wrapped back to slot 0


def test_clock_order_is_the_ring_rotated_to_the_hand():
    plan = ClockPolicy(1, 4).plan_row([20], FULL, [2, 3, 0, 1], {"referenced": [0, 0, 0, 0]})
    assert plan.victims == [2]
    assert plan.order == [3, 0, 1, 2]


@pytest.mark.parametrize("name", ["lru", "fifo", "clock"])
def test_empty_slots_are_used_before_any_token_is_evicted(name):
    slot_pos, lru = new_slot_tables(1, 4)
    policy = get_policy(name, num_rows=1, num_slots=4)
    reset_row(slot_pos, lru, 0, [5, 6], policy)
    assert slot_pos[0].tolist() == [5, 6, -1, -1]
    assert lru[0].tolist() == [2, 3, 0, 1]
    state = {k: v[0].tolist() for k, v in policy.state.items()}
    plan = policy.plan_row([7, 8], slot_pos[0].tolist(), lru[0].tolist(), state)
    assert sorted(plan.victims) == [2, 3]


@pytest.mark.parametrize("name", ["lru", "fifo"])
def test_plan_rejects_more_selected_positions_than_slots(name):
    with pytest.raises(ValueError, match="do not fit"):
        get_policy(name).plan_row([1, 2, 3, 4, 5], FULL, ORDER)


def test_plan_rejects_duplicate_selection():
    with pytest.raises(ValueError, match="twice"):
        LRUPolicy().plan_row([1, 1], FULL, ORDER)


def test_registry_names_and_unknown_policy():
    assert set(EVICTION_POLICIES) == {"lru", "fifo", "clock"}
    assert isinstance(get_policy("fifo"), FIFOPolicy)
    with pytest.raises(ValueError, match="'belady'.*lru"):
        get_policy("belady")
    with pytest.raises(ValueError, match="policy"):
        resolve_policy(3)


def test_clock_needs_its_state_shape():
    with pytest.raises(ValueError, match="per-slot state"):
        get_policy("clock")
    with pytest.raises(ValueError, match="per-slot state"):
        resolve_policy("clock")
    clock = get_policy("clock", num_rows=3, num_slots=8)
    assert clock.state["referenced"].shape == (3, 8)
    clock.state["referenced"][1] = 1
    clock.reset_row(1)
    assert int(clock.state["referenced"].sum()) == 0


def test_reset_row_only_touches_its_row_and_checks_capacity():
    slot_pos, lru = new_slot_tables(2, 4)
    reset_row(slot_pos, lru, 1, range(10, 14))
    assert slot_pos.tolist() == [[-1, -1, -1, -1], [10, 11, 12, 13]]
    assert lru.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    reset_row(slot_pos, lru, 1, torch.tensor([3]))
    assert slot_pos[1].tolist() == [3, -1, -1, -1]
    assert lru[1].tolist() == [1, 2, 3, 0]
    with pytest.raises(ValueError, match="do not fit"):
        reset_row(slot_pos, lru, 0, range(5))
    with pytest.raises(ValueError, match="distinct"):
        reset_row(slot_pos, lru, 0, [1, 1])
