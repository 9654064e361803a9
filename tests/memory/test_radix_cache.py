"""The radix tree against a model that keeps one dictionary entry per cached token prefix."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from hisparse.memory.prefix_cache import PrefixCache
from hisparse.memory.radix_cache import RadixCache
from hisparse.memory.slot_allocator import SlotAllocator

sequences = st.lists(st.integers(0, 2), max_size=8)


class TreeAgainstDictionary(RuleBasedStateMachine):
    """Every prefix p of a cached sequence is a key: its last token's slot, the time an operation last passed
    through it, and how many held matches pass through it. A leaf is a key that no other key extends."""

    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        self.tree = RadixCache(width=2)
        self.slot: dict[tuple, tuple[int, int]] = {}
        self.time: dict[tuple, int] = {}
        self.locks: dict[tuple, int] = {}
        self.clock = itertools.count()
        self.next_slot = itertools.count()

    def _matched(self, seq: list[int]) -> int:
        n = 0
        while n < len(seq) and tuple(seq[:n + 1]) in self.slot:
            n += 1
        return n

    def _touch(self, seq: list[int], n: int) -> None:
        now = next(self.clock)
        for i in range(1, n + 1):
            self.time[tuple(seq[:i])] = now

    @rule(seq=sequences)
    def insert(self, seq):
        value = np.array([[next(self.next_slot), 1000 + len(seq)] for _ in seq], dtype=np.int64).reshape(-1, 2)
        expected = self._matched(seq)
        assert self.tree.insert(seq, value) == expected
        for i in range(expected, len(seq)):
            key = tuple(seq[:i + 1])
            self.slot[key], self.locks[key] = tuple(value[i]), 0
        self._touch(seq, len(seq))

    def _match(self, seq):
        got, node = self.tree.match_prefix(seq)
        n = self._matched(seq)
        assert [tuple(row) for row in got] == [self.slot[tuple(seq[:i + 1])] for i in range(n)]
        self._touch(seq, n)
        return node, seq[:n]

    @rule(seq=sequences)
    def match(self, seq):
        self._match(seq)

    @rule(target=handles, seq=sequences)
    def match_and_lock(self, seq):
        node, prefix = self._match(seq)
        self.tree.lock(node)
        for i in range(1, len(prefix) + 1):
            self.locks[tuple(prefix[:i])] += 1
        return node, prefix

    @rule(handle=consumes(handles))
    def unlock(self, handle):
        node, prefix = handle
        self.tree.unlock(node)
        for i in range(1, len(prefix) + 1):
            self.locks[tuple(prefix[:i])] -= 1

    @rule(n=st.integers(0, 12))
    def evict(self, n):
        freed = self.tree.evict(n)
        evictable = sum(1 for k in self.slot if self.locks[k] == 0)
        assert len(freed) >= min(n, evictable)
        removed = set()
        for _ in range(len(freed)):  # the model's own order: the least recently used unlocked leaf
            leaves = [k for k in self.slot if self.locks[k] == 0
                      and not any(len(o) == len(k) + 1 and o[:-1] == k for o in self.slot)]
            assert leaves, "the tree evicted more than the model can"
            victim = min(leaves, key=lambda k: self.time[k])
            removed.add(self.slot.pop(victim))
            del self.time[victim], self.locks[victim]
        assert {tuple(row) for row in freed} == removed

    @invariant()
    def sizes_and_slots_agree(self):
        assert self.tree.evictable_size == sum(1 for k in self.slot if self.locks[k] == 0)
        assert self.tree.protected_size == sum(1 for k in self.slot if self.locks[k] > 0)
        held = [tuple(row) for row in self.tree.all_values()]
        assert len(held) == len(set(held)) and set(held) == set(self.slot.values())


TestTreeAgainstDictionary = TreeAgainstDictionary.TestCase
TestTreeAgainstDictionary.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_locked_tree_is_not_reset():
    tree = RadixCache(width=1)
    tree.insert([1, 2, 3], np.arange(3).reshape(3, 1))
    _, node = tree.match_prefix([1, 2])
    tree.lock(node)
    with pytest.raises(RuntimeError, match="running request"):
        tree.reset()
    tree.unlock(node)
    assert sorted(tree.reset()[:, 0].tolist()) == [0, 1, 2] and tree.total_size == 0


def test_unlocking_twice_is_refused():
    tree = RadixCache(width=1)
    tree.insert([1], np.zeros((1, 1), np.int64))
    _, node = tree.match_prefix([1])
    tree.lock(node)
    tree.unlock(node)
    with pytest.raises(RuntimeError, match="not locked"):
        tree.unlock(node)


def test_a_claim_reuses_the_cached_prefix_and_allocates_the_rest():
    pools = [SlotAllocator(16), SlotAllocator(16)]
    cache = PrefixCache(pools)
    first = cache.claim([5, 6, 7, 8], total=6)
    assert first.cached == 0 and pools[0].num_used == 6
    cache.release(first, [5, 6, 7, 8, 9])  # 5 computed rows are cached, the sixth slot goes back
    assert cache.tree.total_size == 5 and pools[0].num_used == 5
    second = cache.claim([5, 6, 7, 8, 9, 1], total=8)  # all but its last prompt token are cached
    assert second.cached == 5 and np.array_equal(second.slots[:5], first.slots[:5])
    assert pools[0].num_used == 5 + 3 and cache.tree.protected_size == 5
    third = cache.claim([5, 6, 7], total=3)  # the last prompt token is never taken from the cache
    assert third.cached == 2
    cache.release(third, [5, 6, 7])  # its own row of 7 duplicates the tree's: given back
    cache.release(second, [5, 6, 7, 8, 9, 1, 2])
    assert cache.tree.total_size == pools[0].num_used == pools[1].num_used == 7
    assert cache.flush() and pools[0].num_used == pools[1].num_used == 0


def test_admission_evicts_only_unlocked_prefixes_and_only_as_far_as_needed():
    pool = SlotAllocator(10)
    cache = PrefixCache([pool])
    for prompt in ([1, 2, 3, 4], [7, 8, 9]):
        cache.release(cache.claim(prompt, len(prompt)), prompt)
    assert pool.num_free == 3 and cache.num_free == 10
    held = cache.claim([1, 2, 3, 4, 5], total=5)  # reuses and locks 1 2 3 4
    assert held.cached == 4 and pool.num_free == 2
    assert cache.claim([6], total=7) is None  # 2 free + 3 evictable: refused, nothing evicted
    assert cache.tree.total_size == 7
    fits = cache.claim([6], total=4)  # evicts 7 8 9, not the locked prefix
    assert fits is not None and cache.tree.total_size == 4 and cache.tree.protected_size == 4
    cache.release(fits, [6])
    cache.release(held, [1, 2, 3, 4, 5])
    assert pool.num_used == cache.tree.total_size == 6


def test_off_nothing_is_cached():
    pool = SlotAllocator(8)
    cache = PrefixCache([pool], enabled=False)
    cache.release(cache.claim([1, 2, 3], 4), [1, 2, 3])
    again = cache.claim([1, 2, 3], 4)
    assert again.cached == 0 and cache.tree.total_size == 0
    cache.release(again, [1, 2, 3])
    assert pool.num_used == 0
