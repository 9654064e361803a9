"""LRFU, an eviction policy that weighs how often a position was selected, not only how recently.

Not in `EVICTION_POLICIES` (so not a `hisparse_config` choice): on held-out top-k traces of the default
model it closes only 2-3% of LRU's excess over Belady's optimum at 2x and 3x top_k, and loses 1% at
1.5x (`python -m hisparse.bench_missrate`): selection history predicts little beyond recency there. Use
it as an object:
`swap_in(..., policy=LRFUPolicy(num_rows=R, num_slots=S))`, one per layer; on CPU tensors `auto` runs it
on the reference backend.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from hisparse.memory.eviction import EvictionPolicy


class LRFUPolicy(EvictionPolicy):
    """Least recently/frequently used (Lee et al., 1999): evict the slot with the lowest decayed count of
    selections, so a position the indexer picked on most recent steps outlives one picked once.

    State: `score[R, S]` int32, a fixed-point count (`ONE` = 1.0). Each step every slot's score decays by
    `decay` (out of `ONE`, rounded down); a hit adds `ONE`; a loaded slot restarts at `load_score`, so a
    newcomer is protected less than a position with a history. Victims: the evictable slots with the lowest
    scores, ties in eviction order. The new order is all slots by new score, ties as LRU orders them
    (untouched evictables, then loaded, then hits), so the order stays sorted by score and with `decay`
    0 and `load_score` `ONE` the policy is exactly LRU.
    """

    name = "lrfu"
    state_names = ("score",)
    ONE: ClassVar[int] = 1 << 16
    # Tuned on train-split traces (python -m hisparse.bench_missrate --split train --tune): 0.7 and 0.25.
    decay: ClassVar[int] = 45875  # 0.7 x ONE
    load_score: ClassVar[int] = 1 << 14  # 0.25 x ONE

    def __init__(self, num_rows: int | None = None, num_slots: int | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__(num_rows, num_slots, device)
        self.state = {key: tensor.to(torch.int32) for key, tensor in self.state.items()}

    def choose(self, order, is_hit, num_misses, state):
        score = state["score"]
        evictable = sorted((s for s in order if not is_hit[s]), key=lambda s: score[s])  # stable: ties in order
        victims = evictable[:num_misses]
        taken = set(victims)
        untouched = [s for s in order if not is_hit[s] and s not in taken]
        hits = [s for s in order if is_hit[s]]
        new_score = [(v * self.decay) >> 16 for v in score]
        for s in hits:
            new_score[s] += self.ONE
        for s in victims:
            new_score[s] = self.load_score
        new_order = sorted(untouched + victims + hits, key=lambda s: new_score[s])
        return victims, new_order, {"score": new_score}
