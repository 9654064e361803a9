"""Prefix reuse over a cache's pools: a request takes its longest cached prefix and allocates only the rest.

One `PrefixCache` serves one cache and the allocators whose slots a token holds (one column each: the
device pool and the indexer keys for the baseline, the host pool and the indexer keys for HiSparse; a
HiSparse hot buffer is per request and never shared). Admission locks the reused prefix and evicts
unlocked cached prefixes only as far as the new request needs, so caching never refuses a request that
would fit without it. Release hands the request's computed rows to the tree; what the tree already had,
and what was never computed, goes back to the allocators. A prompt's rows join the tree chunk by chunk as
prefill computes them (`share`), so requests that arrive together reuse the first one's shared prefix.
Off (`enabled=False`), nothing is ever cached and the same path allocates every slot fresh.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hisparse.memory.radix_cache import RadixCache, TreeNode
from hisparse.memory.slot_allocator import SlotAllocator


@dataclass
class PrefixClaim:
    node: TreeNode  # where the request's cached prefix ends in the tree; locked until the request is released
    slots: np.ndarray  # int64 [total, width]: the reused prefix's slots, then the request's own
    cached: int  # tokens reused at admission
    private: np.ndarray  # bool [total]: the slot is the request's, not the tree's (given back at release)
    shared: int = 0  # leading tokens the tree holds for it (`node` ends there)

    def column(self, i: int) -> np.ndarray:
        return np.ascontiguousarray(self.slots[:, i])


class PrefixCache:
    def __init__(self, allocators: list[SlotAllocator], enabled: bool = True) -> None:
        self.allocators = allocators
        self.enabled = enabled
        self.tree = RadixCache(len(allocators))

    @property
    def num_free(self) -> int:
        """Slots a new request could take in every pool: free ones and those held by unlocked prefixes."""
        return min(a.num_free for a in self.allocators) + self.tree.evictable_size

    def claim(self, prompt: Sequence[int], total: int) -> PrefixClaim | None:
        """Slots for `total` positions of a request with this prompt, reusing the longest cached prefix of all
        but its last token (whose logits the request must compute); None when they do not fit now (nothing
        is changed then, beyond the order of recent use)."""
        if self.enabled and len(prompt) > 1:
            cached_slots, node = self.tree.match_prefix(prompt[:-1])
        else:
            cached_slots, node = np.empty((0, len(self.allocators)), np.int64), self.tree.root
        cached = len(cached_slots)
        own = total - cached
        self.tree.lock(node)
        short = own - min(a.num_free for a in self.allocators)
        if short > 0:
            if short > self.tree.evictable_size:
                self.tree.unlock(node)
                return None
            self._give_back(self.tree.evict(short))
        taken = []
        try:
            for allocator in self.allocators:
                taken.append(allocator.allocate(own))
        except Exception:  # a refusal leaks nothing
            for allocator, slots in zip(self.allocators, taken, strict=False):
                allocator.free(slots)
            self.tree.unlock(node)
            raise
        private = np.arange(total) >= cached
        return PrefixClaim(node, np.concatenate([cached_slots, np.stack(taken, axis=1)]), cached, private, cached)

    def share(self, claim: PrefixClaim, tokens: Sequence[int]) -> None:
        """Put a running request's first computed `tokens` in the tree (a prompt chunk done), so that requests
        admitted from now on reuse them; the request's lock moves to their end. Where the tree has some of
        them already (from another request), the request keeps its own rows there, private."""
        n = len(tokens)
        if not self.enabled or n <= claim.shared:
            return
        already = self.tree.insert(tokens, claim.slots[:n])
        claim.private[already:n] = False
        _, node = self.tree.match_prefix(tokens)
        self.tree.lock(node)
        self.tree.unlock(claim.node)
        claim.node, claim.shared = node, n

    def release(self, claim: PrefixClaim, tokens: Sequence[int]) -> None:
        """Retire a claim: its first computed `tokens` stay in the tree, its other slots go back."""
        self.share(claim, tokens)
        self._give_back(claim.slots[claim.private])
        self.tree.unlock(claim.node)

    def flush(self) -> bool:
        """Drop every cached prefix; False (and nothing dropped) while a running request reuses one."""
        if self.tree.protected_size:
            return False
        self._give_back(self.tree.reset())
        return True

    def _give_back(self, slots: np.ndarray) -> None:
        for i, allocator in enumerate(self.allocators):
            allocator.free(slots[:, i])

    def usage(self) -> dict[str, int]:
        return {"prefix_cache_tokens": self.tree.total_size, "prefix_cache_evictable_tokens": self.tree.evictable_size}
