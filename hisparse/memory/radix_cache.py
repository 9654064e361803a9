"""A radix tree of token prefixes whose values are cache slots, one token at a time (SGLang's RadixCache).

Each edge holds a run of tokens and, per token, one slot in each of the cache's pools (a row of `value`,
`width` columns: the device pool's row and the indexer-key slot, or the host pool's row and the indexer-key
slot). A running request locks the path of the prefix it reuses (`lock_ref` on every node up to the root),
so those slots cannot be evicted under it; unlocked leaves are evicted least recently used first, and a
parent whose last child goes becomes a leaf in its turn. The tree owns the slots it holds: whoever evicts
gives them back to the allocators.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import numpy as np


class TreeNode:
    __slots__ = ("key", "value", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: np.ndarray, value: np.ndarray, parent: TreeNode | None) -> None:
        self.key = key  # int64 [n]: the tokens on the edge into this node
        self.value = value  # int64 [n, width]: their slots
        self.children: dict[int, TreeNode] = {}  # by first token
        self.parent = parent
        self.lock_ref = 0  # running requests whose reused prefix passes through this node
        self.last_access = 0


def _common_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differs = np.flatnonzero(a[:n] != b[:n])
    return int(differs[0]) if differs.size else n


class RadixCache:
    def __init__(self, width: int) -> None:
        self.width = width
        self._clock = itertools.count(1)
        self._empty()

    def _empty(self) -> None:
        self.root = TreeNode(np.empty(0, np.int64), np.empty((0, self.width), np.int64), None)
        self.root.lock_ref = 1  # never evicted
        self.evictable_size = 0  # tokens in unlocked nodes
        self.protected_size = 0  # tokens in locked nodes

    def reset(self) -> np.ndarray:
        """Empty the tree; returns the slots it held [n, width]. Refused while a request holds a lock."""
        if self.protected_size:
            raise RuntimeError("the prefix cache is in use: a running request references it")
        held = self.all_values()
        self._empty()
        return held

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def match_prefix(self, tokens: Sequence[int]) -> tuple[np.ndarray, TreeNode]:
        """The slots [m, width] of the longest cached prefix of `tokens`, and the node where it ends (split so
        that it ends exactly there: lock it to keep the prefix)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        now = next(self._clock)
        node, values, i = self.root, [], 0
        while i < len(tokens):
            child = node.children.get(int(tokens[i]))
            if child is None:
                break
            n = _common_length(child.key, tokens[i:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            values.append(child.value)
            node, i = child, i + n
        return (np.concatenate(values) if values else np.empty((0, self.width), np.int64)), node

    def insert(self, tokens: Sequence[int], value: np.ndarray) -> int:
        """Cache `tokens` with their slots `value` [n, width]; returns how many leading tokens were cached
        already (their slots in `value` stay the caller's: the tree keeps its own)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if value.shape != (len(tokens), self.width):
            raise ValueError(f"value must be [{len(tokens)}, {self.width}], got {list(value.shape)}")
        now = next(self._clock)
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(int(tokens[i]))
            if child is None:
                leaf = TreeNode(tokens[i:].copy(), value[i:].copy(), node)
                leaf.last_access = now
                node.children[int(tokens[i])] = leaf
                self.evictable_size += len(leaf.key)
                return i
            n = _common_length(child.key, tokens[i:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, i = child, i + n
        return i

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child`'s edge after n tokens; returns the new upper node (same locks, same time)."""
        upper = TreeNode(child.key[:n], child.value[:n], child.parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        upper.children = {int(child.key[n]): child}
        child.parent.children[int(child.key[0])] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        return upper

    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("unlocking a prefix that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node = node.parent

    def evict(self, num_tokens: int) -> np.ndarray:
        """Drop unlocked leaves, least recently used first, until at least `num_tokens` tokens are gone (or
        nothing unlocked is left); returns their slots [k, width] (k >= num_tokens, whole edges)."""
        order = itertools.count()
        heap = [(n.last_access, next(order), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed, count = [], 0
        while count < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[int(leaf.key[0])]
            freed.append(leaf.value)
            count += len(leaf.key)
            self.evictable_size -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return np.concatenate(freed) if freed else np.empty((0, self.width), np.int64)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_values(self) -> np.ndarray:
        """Every slot the tree holds [total_size, width]."""
        values = [n.value for n in self._nodes()]
        return np.concatenate(values) if values else np.empty((0, self.width), np.int64)
