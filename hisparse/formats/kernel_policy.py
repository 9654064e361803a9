"""An eviction policy as the compiled swap-in kernels see it: its name, its constants by name, its state.

The rules of each policy are written once in Python (`memory.eviction`, the definition the reference swap-in
runs) and once per compiled kernel (`kernels.swap_in_cpu`, `kernels.swap_in_triton`); this is all the kernels
need from the Python side, so they import nothing from `memory`. The state tensors are the policy's own,
which the kernels update in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class PolicyConstants(NamedTuple):
    """The integers a policy's kernels read; a policy sets the ones it uses, the rest stay 0."""

    # lrfu: one selection's value, its decay per step (a shift), the first runner-up's credit, runners-up per
    # top_k column, a ghost's decay per step, and how much of a returning ghost's value it starts with (x 1/4)
    hit: int = 0
    decay_shift: int = 0
    rank_bonus: int = 0
    ranks_per_top_k: int = 0
    ghost_decay_shift: int = 0
    ghost_weight_quarters: int = 0
    # score_lru: the age a runner-up's rank stands for, a loaded token's age in steps, the oldest age
    touch_age_per_rank: int = 0
    load_age_steps: int = 0
    age_limit: int = 0


@dataclass(frozen=True)
class KernelPolicy:
    name: str  # lru, fifo, clock, score_lru or lrfu
    constants: PolicyConstants = PolicyConstants()
    values: torch.Tensor | None = None  # int32 [R, S]: score_lru's ages, lrfu's decayed counts
    ghost_pos: torch.Tensor | None = None  # int32 [R, S]: lrfu's recently evicted positions (-1: none)...
    ghost_value: torch.Tensor | None = None  # ...and their values
    referenced: torch.Tensor | None = None  # int8 [R, S]: clock's reference bits
