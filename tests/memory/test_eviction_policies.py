"""Eviction policies on hand-worked examples, the registry, and the slot-table helpers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse.memory.eviction import (
    EVICTION_POLICIES,
    ClockPolicy,
    FIFOPolicy,
    LRFUPolicy,
    LRUPolicy,
    ScoreLRUPolicy,
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


def test_score_lru_spares_a_runner_up_and_ages_a_newcomer():
    # 4 slots, 2 top_k columns: ages count in halves of a step, a step adds 2, and rank r below the top-k
    # means 8 x r x (4 - 2) / 2 = 8r. Every slot was 20 old; slot 1 (position 11) is the oldest in order.
    policy = ScoreLRUPolicy(num_rows=1, num_slots=4)
    plan = policy.plan_row([12, 20], FULL, [1, 0, 2, 3], {"age": [20] * 4}, next_ranked=[11, 99, -1])
    # aged: 22 each; slot 1 ranked 1st below the top-k: min(22, 8) = 8; slot 2 is a hit
    assert plan.victims == [0]  # LRU would take slot 1
    assert plan.slots == [2, 0]
    assert plan.state["age"] == [8, 8, 0, 22]  # the newcomer in slot 0 starts 4 steps (8) old
    # LRU's order [1, 3, 0, 2] stably sorted by descending age
    assert plan.order == [3, 1, 0, 2]


def test_score_lru_takes_the_worst_ranked_runner_up_when_all_are_ranked():
    # Every slot 40 old (42 after this step); ranked 3rd, 2nd, 4th, 1st: ages 8r = [24, 16, 32, 8].
    policy = ScoreLRUPolicy(num_rows=1, num_slots=4)
    plan = policy.plan_row([20, -1], FULL, ORDER, {"age": [40] * 4}, next_ranked=[13, 11, 10, 12, 13])
    assert plan.victims == [2]  # position 12, ranked last
    assert plan.state["age"] == [24, 16, 8, 8]
    assert plan.order == [0, 1, 3, 2]


def test_score_lru_ages_saturate():
    policy = ScoreLRUPolicy(num_rows=1, num_slots=4)
    limit = ScoreLRUPolicy.AGE_LIMIT
    plan = policy.plan_row([20], FULL, ORDER, {"age": [limit, limit - 1, 5, 0]})
    assert plan.victims == [0]
    assert plan.state["age"][1:] == [limit, 6, 1]


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=5, unique=True), min_size=1, max_size=12),
       held=st.integers(0, 6))
def test_score_lru_without_ranks_or_load_age_is_exactly_lru(steps, held):
    slot_pos, order = new_slot_tables(1, 6)
    score = ScoreLRUPolicy(num_rows=1, num_slots=6)
    score.LOAD_AGE_STEPS = 0
    reset_row(slot_pos, order, 0, range(40, 40 + held), score)
    pos, lru_order, score_order = slot_pos[0].tolist(), order[0].tolist(), order[0].tolist()
    age = score.state["age"][0].tolist()
    for top_k in steps:
        want = LRUPolicy().plan_row(top_k, pos, lru_order)
        got = score.plan_row(top_k, pos, score_order, {"age": age})
        assert (got.victims, got.order, got.slots) == (want.victims, want.order, want.slots)
        for j, s in zip(want.miss_columns, want.victims, strict=True):
            pos[s] = top_k[j]
        lru_order, score_order, age = want.order, got.order, got.state["age"]


def test_score_lru_fills_empty_slots_before_evicting_even_though_newcomers_start_old():
    slot_pos, lru = new_slot_tables(1, 4)
    policy = get_policy("score_lru", num_rows=1, num_slots=4)
    reset_row(slot_pos, lru, 0, [5], policy)
    assert policy.state["age"][0].tolist() == [ScoreLRUPolicy.HELD_AGE] + [ScoreLRUPolicy.AGE_LIMIT] * 3
    pos, order, age = slot_pos[0].tolist(), lru[0].tolist(), policy.state["age"][0].tolist()
    filled = []
    for p in (7, 8, 9):
        plan = policy.plan_row([p], pos, order, {"age": age})
        filled += plan.victims
        pos[plan.victims[0]] = p
        order, age = plan.order, plan.state["age"]
    assert sorted(filled) == [1, 2, 3] and pos[0] == 5


def test_lrfu_keeps_the_often_selected_token_that_lru_would_evict():
    # Two slots holding 10 (slot 0) and 11 (slot 1); 10 is selected three steps running, then 11, then a
    # newcomer 20 arrives: LRU evicts 10 (least recently used), LRFU evicts 11 (selected once).
    policy = LRFUPolicy(num_rows=1, num_slots=2)
    pos, order, value = [10, 11], [0, 1], [0, 0]
    for top_k in ([10], [10], [10], [11]):
        plan = policy.plan_row(top_k, pos, order, {"value": value})
        assert plan.victims == []
        order, value = plan.order, plan.state["value"]
    hit, shift = LRFUPolicy.HIT, LRFUPolicy.DECAY_SHIFT

    def decay(v):
        return v - (v >> shift)

    assert value == [decay(decay(decay(hit) + hit) + hit), hit]  # three selections, decayed once since
    assert order == [0, 1]  # LRU's order: 10 is the older one
    assert LRUPolicy().plan_row([20], pos, order).victims == [0]
    plan = policy.plan_row([20], pos, order, {"value": value})
    assert plan.victims == [1] and plan.slots == [1]
    assert plan.state["value"] == [decay(value[0]), hit]  # the newcomer starts at one selection
    assert plan.order == [0, 1]


def test_lrfu_small_counts_stop_decaying_and_ties_go_in_lru_order():
    policy = LRFUPolicy(num_rows=1, num_slots=3)
    plan = policy.plan_row([20], [10, 11, 12], [2, 0, 1], {"value": [15, 15, 0]})
    assert plan.victims == [2]  # value 0, and first in order
    assert plan.state["value"][:2] == [15 - (15 >> LRFUPolicy.DECAY_SHIFT)] * 2 == [15, 15]
    plan = policy.plan_row([21], [10, 11, 20], [2, 0, 1], {"value": [0, 0, LRFUPolicy.HIT]})
    assert plan.victims == [0]  # slots 0 and 1 tie at 0: the older in order goes


def test_lrfu_credits_a_runner_up_for_this_step_only_by_its_rank():
    # Width 1: the credit falls from RANK_BONUS at rank 1 to RANK_BONUS / 2 at rank 2 and 0 past rank 2.
    policy = LRFUPolicy(num_rows=1, num_slots=3)
    bonus, hit = LRFUPolicy.RANK_BONUS, LRFUPolicy.HIT
    assert [policy.rank_credit(rank, 1) for rank in (0, 1, 2, 3)] == [0, bonus, bonus // 2, 0]
    value = [hit, hit, 2 * hit]
    # Without ranks slot 0 goes (lowest value, first in order); ranked first, 10 is kept and 11 goes.
    assert policy.plan_row([20], [10, 11, 12], [0, 1, 2], {"value": value}).victims == [0]
    plan = policy.plan_row([20], [10, 11, 12], [0, 1, 2], {"value": value}, next_ranked=[10])
    assert plan.victims == [1]
    assert plan.state["value"] == [hit - (hit >> 5), hit, 2 * hit - (2 * hit >> 5)]  # no credit in the state
    # Width 2 (credits down to rank 4): 11 listed first and third keeps rank 1's credit, so 10 (rank 2) goes;
    # with the third listing's credit it would stay.
    plan = policy.plan_row([20, -1], [10, 11, 12], [0, 1, 2], {"value": [hit, hit, 9 * hit]},
                           next_ranked=[11, 10, 11])
    assert plan.victims == [0]
    # Ranks are columns of next_ranked: a selected (12) or unheld (5, 6) position listed before 11 still
    # takes its rank, so 11 is credited as rank 4 (a quarter) and goes before 10, two selections ahead.
    plan = policy.plan_row([20, 12], [10, 11, 12], [0, 1, 2], {"value": [3 * hit, hit, hit]},
                           next_ranked=[12, 5, 6, 11])
    assert plan.victims == [1]
    # 4 selections of credit outweigh 3 of history: the runner-up stays, the often selected token goes.
    plan = policy.plan_row([20], [10, 11, 12], [0, 1, 2], {"value": [3 * hit, 4 * hit, 5 * hit]}, next_ranked=[10])
    assert plan.victims == [1]


def test_lrfu_refuses_constants_its_int32_state_cannot_hold():
    policy = LRFUPolicy(num_rows=1, num_slots=2)
    assert policy.constants() == (LRFUPolicy.HIT, LRFUPolicy.DECAY_SHIFT)
    policy.DECAY_SHIFT = 15  # a slot hit every step would reach 2**31
    with pytest.raises(ValueError, match="DECAY_SHIFT"):
        policy.plan_row([20], [10, 11], [0, 1], {"value": [0, 0]})


@pytest.mark.parametrize(("name", "value"), [("GHOST_WEIGHT_QUARTERS", 9), ("GHOST_WEIGHT_QUARTERS", -1),
                                             ("GHOST_DECAY_SHIFT", 0), ("GHOST_DECAY_SHIFT", 31)])
def test_lrfu_ghost_weight_and_decay_are_checked(name, value):
    """A shift of 32 or more is undefined for int32 on a GPU (the cpu kernel gave other values at 64)."""
    policy = LRFUPolicy(num_rows=1, num_slots=2)
    setattr(policy, name, value)
    with pytest.raises(ValueError, match=name):
        policy.plan_row([20], [10, 11], [0, 1])


@pytest.mark.parametrize(("weight", "third_victim"), [(LRFUPolicy.GHOST_WEIGHT_QUARTERS, 1), (0, 0)])
def test_lrfu_ghost_a_token_evicted_and_selected_again_comes_back_with_its_count(weight, third_victim):
    """Two slots, width 1: 10 (4 selections) is evicted for 30 by 20 (6 selections); 10 is selected again
    (evicting 30) and then a newcomer arrives. With ghosts 10 came back worth 1 + 6/4 x its decayed count,
    so 20 goes; as a plain newcomer (weight 0) 10 would go again."""
    policy = LRFUPolicy(num_rows=1, num_slots=2)
    policy.GHOST_WEIGHT_QUARTERS = weight
    hit = LRFUPolicy.HIT
    plan = policy.plan_row([30], [10, 20], [0, 1], {"value": [4 * hit, 6 * hit]})
    assert plan.victims == [0] and plan.state["ghost_pos"] == [-1, 10]
    positions = [30, 20]
    plan = policy.plan_row([10], positions, plan.order, plan.state)
    assert plan.victims == [0]
    assert plan.state["ghost_pos"] == [-1, 30]  # 10 left the ghosts when it returned; 30 joined them
    plan = policy.plan_row([40], [10, 20], plan.order, plan.state)
    assert plan.victims == [third_victim]


def test_lrfu_reset_forgets_the_ghosts():
    policy = LRFUPolicy(num_rows=1, num_slots=2)
    assert policy.state["ghost_pos"][0].tolist() == [-1, -1]  # a new row has none
    policy.state["ghost_pos"][0] = torch.tensor([7, 8], dtype=torch.int32)
    policy.state["ghost_value"][0] = 5
    policy.reset_row(0, 2)
    assert policy.state["ghost_pos"][0].tolist() == [-1, -1] and policy.state["ghost_value"][0].tolist() == [0, 0]


@pytest.mark.parametrize("name", ["lru", "fifo", "clock", "score_lru", "lrfu"])
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
    assert set(EVICTION_POLICIES) == {"lru", "fifo", "clock", "score_lru", "lrfu"}
    assert get_policy("lrfu", num_rows=1, num_slots=512).num_next_ranks(256) == 2 * 256
    assert get_policy("lrfu", num_rows=1, num_slots=256).num_next_ranks(256) == 0
    assert get_policy("score_lru", num_rows=1, num_slots=512).num_next_ranks(256) == 2 * (512 - 256)
    assert get_policy("score_lru", num_rows=1, num_slots=256).num_next_ranks(256) == 0
    assert get_policy("lru").num_next_ranks(256) == 0
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
