"""Eviction policies of the per-request hot buffer, and the slot tables they act on.

Every layer of every request has a hot buffer of S slots described by two int32 tables row-indexed by
request (one row per request, tables sized for the maximum number of concurrent requests R):

- `slot_pos[R, S]`: the token position each slot holds, -1 when empty. It is the one source of truth
  for "where is token p": a position is on the device iff some slot of its row holds it.
- `lru[R, S]`: the eviction order, a permutation of the slot ids, next victim candidate first. The name
  is the reference system's; for FIFO it is the insertion order and for CLOCK the ring read from the
  hand. Empty slots sit at the front, so they are filled before anything is evicted.

A swap-in selects `top_k` positions; those in the buffer are hits, the others misses. Slots whose
position is not selected (empty slots included) are evictable. The policy decides which evictable slot
each miss is loaded into and how the order changes. A policy that needs more than the order (CLOCK's
reference bits) owns that state as tensors in `policy.state`, so a stateful policy object belongs to
one layer, exactly like that layer's `slot_pos` and `lru`.

A swap-in may also pass `next_ranked`: the positions the indexer ranked just below the top-k this step,
the best first. They are not loaded; a policy that reads them (`num_next_ranks` > 0: `score_lru`, `lrfu`)
uses them as evidence of what the next steps will select. The others ignore them. A policy may also keep
a history of its own per row, as [R, S] tables: `lrfu`'s decayed selection count of each slot, and its
ghosts (a list of the last S tokens evicted and their counts).

`EvictionPolicy.plan_row` is the plain-Python statement of a policy, used by the reference swap-in
(`memory.swap_in_reference`) and by tests; the CPU and Triton kernels implement the same rules, reading a
policy only through `kernel_view`, and are tested against it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from hisparse.formats.kernel_policy import KernelPolicy, PolicyConstants


@dataclass
class RowPlan:
    """What one swap-in does to one request's hot buffer (one layer)."""

    slots: list[int]  # per top_k column: the slot holding that position after the step, -1 for padding
    miss_columns: list[int]  # top_k columns that missed, in column order
    victims: list[int]  # the slot each miss is loaded into, parallel to miss_columns
    order: list[int]  # the new eviction order
    state: dict[str, list[int]] = field(default_factory=dict)  # the policy's extra row state afterwards


class EvictionPolicy(ABC):
    """One eviction rule: which evictable slots the misses take, and the eviction order afterwards.

    Subclasses implement `choose`. Stateful subclasses list their per-row state of S entries (one per slot,
    or lrfu's ghost list) in `state_names` (an entry's value for an empty row in `state_fill`, 0 if not
    listed), make it in `__init__` as int tensors of shape [num_rows, num_slots] in `self.state`, and
    return its new row values from `choose`.
    A policy the cpu and Triton kernels also implement hands them its state and its constants through
    `kernel_view` (`formats.kernel_policy.KernelPolicy`): the kernels import nothing of this module.
    """

    name: ClassVar[str]
    state_names: ClassVar[tuple[str, ...]] = ()
    state_fill: ClassVar[dict[str, int]] = {}
    state_dtype: ClassVar[torch.dtype] = torch.int8

    def __init__(self, num_rows: int | None = None, num_slots: int | None = None,
                 device: torch.device | str | None = None) -> None:
        self.num_slots = num_slots  # the buffer's size, for a policy whose runners-up depend on it
        self.state: dict[str, torch.Tensor] = {}
        if self.state_names:
            if num_rows is None or num_slots is None:
                raise ValueError(
                    f"eviction policy {self.name!r} keeps per-slot state ({', '.join(self.state_names)}): "
                    f"make one per layer with get_policy({self.name!r}, num_rows=R, num_slots=S)"
                )
            for key in self.state_names:
                self.state[key] = torch.full((num_rows, num_slots), self.state_fill.get(key, 0),
                                             dtype=self.state_dtype, device=device)

    def num_next_ranks(self, top_k: int) -> int:
        """How many positions ranked below the top-k the policy wants per swap-in (0: it ignores them)."""
        return 0

    def kernel_view(self) -> KernelPolicy:
        """What the compiled swap-in kernels read of this policy: its name, constants and state tensors
        (the same tensors, which the kernels update in place)."""
        return KernelPolicy(self.name, referenced=self.state.get("referenced"))

    def reset_row(self, row: int, num_held: int = 0) -> None:
        """Forget a row's history, for a new request or a rebuilt buffer whose slots 0..num_held-1 hold
        tokens and the rest are empty (as the module's `reset_row` leaves them)."""
        for key, tensor in self.state.items():
            tensor[row] = self.state_fill.get(key, 0)

    def plan_row(self, top_k: Sequence[int], slot_pos: Sequence[int], order: Sequence[int],
                 state: Mapping[str, Sequence[int]] | None = None, next_ranked: Sequence[int] = ()) -> RowPlan:
        """Classify hits and misses of one request, then let the policy place the misses.

        The classification is the same for every policy: a slot is a hit iff its position is selected;
        misses are the selected positions not in the buffer, in top_k column order. `next_ranked` (-1
        padded, the best first) gives each slot whose position is listed and not selected its rank below
        the top-k, 1 for the best; a position listed twice keeps its best rank.
        """
        valid = [p for p in top_k if p >= 0]
        if len(valid) > len(slot_pos):
            raise ValueError(f"{len(valid)} selected positions do not fit in {len(slot_pos)} hot slots")
        if len(set(valid)) != len(valid):
            raise ValueError("top_k row selects a position twice")
        selected = set(valid)
        slot_of = {p: s for s, p in enumerate(slot_pos) if p >= 0}
        is_hit = [p >= 0 and p in selected for p in slot_pos]
        miss_columns = [j for j, p in enumerate(top_k) if p >= 0 and p not in slot_of]
        next_rank = [0] * len(slot_pos)
        for rank, p in enumerate(next_ranked, start=1):
            s = slot_of.get(p, -1) if p >= 0 else -1
            if s >= 0 and not is_hit[s] and next_rank[s] == 0:
                next_rank[s] = rank
        state = state or {}
        row_state = {k: list(state.get(k, [self.state_fill.get(k, 0)] * len(slot_pos))) for k in self.state_names}
        victims, new_order, new_state = self.choose(list(order), is_hit, len(miss_columns), row_state,
                                                    next_rank, len(top_k), list(slot_pos),
                                                    [top_k[j] for j in miss_columns])
        slots = [slot_of.get(p, -1) if p >= 0 else -1 for p in top_k]
        for j, s in zip(miss_columns, victims, strict=True):
            slots[j] = s
        return RowPlan(slots, miss_columns, victims, new_order, new_state)

    @abstractmethod
    def choose(self, order: list[int], is_hit: list[bool], num_misses: int, state: dict[str, list[int]],
               next_rank: list[int], width: int, positions: list[int],
               missed: list[int]) -> tuple[list[int], list[int], dict[str, list[int]]]:
        """Victim slot of each miss (in miss order), the new order, and the new extra row state.

        Victims must be evictable (`not is_hit[slot]`) and distinct; there are always enough of them
        because the number of selected positions is at most the number of slots. `next_rank[slot]` is
        the slot's rank below the top-k (0: not ranked), `width` the number of top_k columns,
        `positions[slot]` the position the slot holds before the step (-1: empty), `missed` the missed
        positions in miss order.
        """


class LRUPolicy(EvictionPolicy):
    """Least recently used, exactly as SGLang HiSparse: selected slots (hits and loads) become newest.

    New order: untouched evictables (oldest first), then the loaded slots in miss order, then the hits
    in their old relative order.
    """

    name = "lru"

    def choose(self, order, is_hit, num_misses, state, next_rank, width, positions, missed):
        evictable = [s for s in order if not is_hit[s]]
        hits = [s for s in order if is_hit[s]]
        victims = evictable[:num_misses]
        return victims, evictable[num_misses:] + victims + hits, state


class FIFOPolicy(EvictionPolicy):
    """First in, first out: a hit does not refresh a slot, so the order is the load order."""

    name = "fifo"

    def choose(self, order, is_hit, num_misses, state, next_rank, width, positions, missed):
        victims = [s for s in order if not is_hit[s]][:num_misses]
        taken = set(victims)
        return victims, [s for s in order if s not in taken] + victims, state


class ClockPolicy(EvictionPolicy):
    """CLOCK (second chance): LRU's hit rate for common traces at FIFO's bookkeeping cost.

    State: `referenced[R, S]` int8, set on a hit and on a load. The ring is the `lru` row and the hand
    is its first entry, so the order tensor stays a permutation and no separate hand tensor is needed.
    For each miss the hand sweeps the ring: slots selected this step (hits, and slots loaded earlier in
    the same step) are skipped untouched; a referenced slot loses its bit and is passed over; the first
    unreferenced one is the victim, is loaded, gets its bit, and the hand moves past it. Empty slots are
    never referenced, so they go first. The new order is the ring rotated to the hand.
    """

    name = "clock"
    state_names = ("referenced",)

    def choose(self, order, is_hit, num_misses, state, next_rank, width, positions, missed):
        referenced = state["referenced"]
        pinned = list(is_hit)
        for s, hit in enumerate(is_hit):
            if hit:
                referenced[s] = 1
        victims: list[int] = []
        hand = 0
        size = len(order)
        while len(victims) < num_misses:
            s = order[hand]
            hand = (hand + 1) % size
            if pinned[s]:
                continue
            if referenced[s]:
                referenced[s] = 0
                continue
            victims.append(s)
            referenced[s] = 1
            pinned[s] = True
        return victims, order[hand:] + order[:hand], {"referenced": referenced}


class ScoreLRUPolicy(EvictionPolicy):
    """LRU that also counts the indexer's near misses as uses, graded by how near they came.

    Why: a position the indexer ranks just below the top-k at step t is far likelier to be selected in
    the next steps than one selected long ago and ranked low now (on the default model's traces, about
    a third of the positions ranked 1-32 below the top-k are selected at t+1, under 1% of those ranked
    below 512). LRU knows only when a slot was last selected; this policy keeps, per slot, an age that
    says how long ago its position last *looked* used. With K = width (the top_k columns of the swap-in)
    and S the buffer size:

    - ages count in 1/K of a step; every step every age grows by K (one step), saturating at `AGE_LIMIT`;
    - a hit sets the age to 0; a loaded slot starts `LOAD_AGE_STEPS` steps old (a newcomer that is not
      selected again soon was probably passing through);
    - a slot whose position is ranked r-th below the top-k (`next_ranked`, which is never loaded) takes
      the age `TOUCH_AGE_PER_RANK x r x (S - K) / K` (rounded down) if that is younger: r/K steps read
      on the buffer's own time scale, which grows with its spare room S - K (4, 8 and 16 x r/K steps at
      1.5x, 2x and 3x top_k; tuned per buffer size, the best scales had grown the same way);
    - a reset (`reset_row`) puts the held tokens at `HELD_AGE`: they were never selected.

    The policy reads `NEXT_RANKS_PER_SPARE_SLOT x (S - K)` ranks (`num_next_ranks`). Victims: the
    evictable slots with the largest ages, ties in eviction order (empty slots start at the limit, see
    `reset_row`, so they go first). The new order is LRU's new order (untouched evictables, loaded, hits)
    stably sorted by descending new age, so `lru` stays the eviction order; with no ranks passed and
    `LOAD_AGE_STEPS` 0 the policy is exactly LRU. Without ranks but with the default ages it misses 0-4%
    less than LRU on the train traces.

    The constants were chosen on train-split traces (`python -m hisparse.bench_missrate --split train
    --tune`) and the policy evaluated on held-out ones; the README has the figures. Knowing the next
    step's selection exactly removes only 11-14% of LRU's excess over Belady's optimum at 2x top_k (the
    next 8 steps': 55-59%): most of the gap needs foresight several steps ahead, which a history of
    selections gives better than this step's runners-up (`lrfu`). State: `age[R, S]` int32.
    """

    name = "score_lru"
    state_names = ("age",)
    state_dtype = torch.int32
    AGE_LIMIT: ClassVar[int] = 1 << 30
    HELD_AGE: ClassVar[int] = 1 << 29  # a token put in the buffer by a reset, never selected: very old
    TOUCH_AGE_PER_RANK: ClassVar[int] = 8
    LOAD_AGE_STEPS: ClassVar[int] = 4
    NEXT_RANKS_PER_SPARE_SLOT: ClassVar[int] = 2

    def num_next_ranks(self, top_k: int) -> int:
        return self.NEXT_RANKS_PER_SPARE_SLOT * max(self.num_slots - top_k, 0)

    def kernel_view(self) -> KernelPolicy:
        constants = PolicyConstants(touch_age_per_rank=self.TOUCH_AGE_PER_RANK, load_age_steps=self.LOAD_AGE_STEPS,
                                    age_limit=self.AGE_LIMIT)
        return KernelPolicy(self.name, constants, values=self.state["age"])

    def reset_row(self, row: int, num_held: int = 0) -> None:
        """Held slots start at `HELD_AGE`: the prompt tail a reset loads was never selected, so any slot
        used since, or ranked, is younger (their order stays the reset's, the earliest token first). Empty
        slots start at the limit, older than any token, so they are always filled before one is evicted."""
        self.state["age"][row, :num_held] = self.HELD_AGE
        self.state["age"][row, num_held:] = self.AGE_LIMIT

    def choose(self, order, is_hit, num_misses, state, next_rank, width, positions, missed):
        limit = self.AGE_LIMIT
        width = max(width, 1)
        spare = max(len(order) - width, 0)
        age = [min(a + width, limit) for a in state["age"]]
        for s, rank in enumerate(next_rank):
            if rank > 0:
                age[s] = min(age[s], self.TOUCH_AGE_PER_RANK * rank * spare // width)
        evictable = sorted((s for s in order if not is_hit[s]), key=lambda s: -age[s])  # stable: ties in order
        victims = evictable[:num_misses]
        taken = set(victims)
        lru_order = ([s for s in order if not is_hit[s] and s not in taken] + victims
                     + [s for s in order if is_hit[s]])
        for s in victims:
            age[s] = min(self.LOAD_AGE_STEPS * width, limit)
        for s, hit in enumerate(is_hit):
            if hit:
                age[s] = 0
        return victims, sorted(lru_order, key=lambda s: -age[s]), {"age": age}


class LRFUPolicy(EvictionPolicy):
    """Least recently / frequently used: evict the slot whose position the indexer has selected least,
    counting recent selections more (LRFU, Lee et al. 1999, kept per slot), and crediting this step's
    runners-up.

    Why: the selections of a sparse-attention layer mix tokens it keeps coming back to (a heading, a
    name, an instruction) with tokens it reads once while they are relevant. LRU keeps a once-read token
    as long as one read at every step until then; a decayed count of selections tells them apart. A
    token the indexer ranks just below the top-k now is the likeliest of the unselected to be selected in
    the next steps (on the default model's traces, 60% of those ranked 1-32 below are selected within 8
    steps, 2% of the unranked), which no history of selections knows yet.

    State: `value[R, S]` int32, in units of 1/`HIT` selections. Every step every value decays by
    1/2**`DECAY_SHIFT` (rounded down: `v - (v >> DECAY_SHIFT)`, 31/32 a step, a half-life of about 22
    steps; a value below 2**DECAY_SHIFT no longer decays, a floor far below one selection); then a hit
    adds `HIT` and a loaded slot starts at `HIT` (it was selected this step), so values stay below
    2**`DECAY_SHIFT` x `HIT` = 2**21. Victims: the evictable slots of lowest key, ties in eviction order,
    where the key is the decayed value plus, for a slot whose position is the j-th (0-based) of
    `next_ranked` (the best rank of a position listed twice), the credit
    `RANK_BONUS x (span - j) // span` with span = `RANKS_PER_TOP_K` x width: `RANK_BONUS` = 4 selections
    for the first runner-up, falling linearly to RANK_BONUS / span for the last credited one (rank span).
    The credit is this step's only; it is not added to the state. The policy asks for span runners-up
    (`num_next_ranks`: both the default model's and the DSA models' caches pass them); passed none it is
    plain LRFU. The new order is LRU's (untouched evictables, loaded, hits), so among equal keys the least
    recently used goes first.

    Ghosts: an evicted token's count is not forgotten at once (LRFU proper keeps it for every block; ARC
    keeps a list of recently evicted ones). The row keeps the last S evicted positions and their values
    (`ghost_pos`, `ghost_value` [R, S], the oldest first, empty entries -1 / 0 at the front), decaying by
    1/2**`GHOST_DECAY_SHIFT` a step (7/8: a twentieth of itself after 22 steps; an entry stays listed until
    S newer evictions push it out). A miss whose position is a ghost starts at `HIT` +
    `GHOST_WEIGHT_QUARTERS` / 4 x its ghost value instead of `HIT` (at most HIT x 2**DECAY_SHIFT, the value
    of a slot selected at every step, so that no value outgrows the int32 state however often a token
    returns), and leaves the list; each evicted token joins it with its
    decayed value this step, in miss order, the oldest falling off. Why: a token the layer keeps coming
    back to is sometimes evicted all the same, and LRFU without ghosts takes it back as a newcomer, first
    in line to be evicted again. In a simulation on the default model's traces, ghosts forgotten 16 steps
    after their eviction gained as much as ghosts kept for ever: it is the quick returns that count.

    A reset puts every value at 0 and empties the ghosts (held tokens were never selected; empty slots
    sit first in the order, so they are filled first).

    Tuning (`python -m hisparse.bench_missrate --split train --tune`, train-split traces): the decay among
    7/8, 15/16 and 31/32 a step and `RANK_BONUS` among 2-6 selections (a span of 2 x top_k did as well as
    one growing with the buffer's spare room; an exponential fall-off, a credit for positions near the
    newest token, or one for how recently a slot was selected or loaded gained under 1 point more), then
    the ghosts' decay among 3/4, 7/8, 15/16 and their weight among 1-2 at 1.5x-3x top_k (at 1x the buffer
    is the top-k and a policy only chooses among the few slots padding leaves free). On held-out traces at
    2x top_k it removes 45% of LRU's excess misses over Belady's optimum (without ghosts 39%, without the
    runners-up either 29%; score_lru 21%) over 192 decode steps; over 1024, 49-50% of each text's gap over
    8 requests, 37-58% over 4: the share depends on the text far more than on the constants. The README
    has the figures. Ghosts kept for every position (not only the last S) did no better (44.6% with the
    slots' own decay); a ghost list kept per slot (its last occupant) did worse at 1.5x and 2x (31% and
    42%).
    """

    name = "lrfu"
    state_names = ("value", "ghost_pos", "ghost_value")
    state_fill = {"ghost_pos": -1}
    state_dtype = torch.int32
    HIT: ClassVar[int] = 1 << 16
    DECAY_SHIFT: ClassVar[int] = 5
    RANK_BONUS: ClassVar[int] = 4 << 16  # the first runner-up's credit: 4 selections (4 x HIT)
    RANKS_PER_TOP_K: ClassVar[int] = 2  # runners-up read (and credited) per top_k column
    GHOST_DECAY_SHIFT: ClassVar[int] = 3  # a ghost keeps 7/8 of its value a step
    GHOST_WEIGHT_QUARTERS: ClassVar[int] = 6  # a returning ghost starts at HIT + 6/4 of its value

    def num_next_ranks(self, top_k: int) -> int:
        """`RANKS_PER_TOP_K` x top_k runners-up, none for a buffer with no slot to spare (nothing to choose)."""
        return self.RANKS_PER_TOP_K * top_k if self.num_slots > top_k and self.RANK_BONUS else 0

    def constants(self) -> tuple[int, int]:
        """(HIT, DECAY_SHIFT), checked: a slot hit every step tends to HIT x 2**DECAY_SHIFT, which the
        int32 state must hold (the kernels would wrap around silently); the key adds at most RANK_BONUS."""
        if self.HIT < 1 or self.DECAY_SHIFT < 1 or (self.HIT + 1) << self.DECAY_SHIFT >= 1 << 31:
            raise ValueError(f"lrfu's HIT ({self.HIT}) and DECAY_SHIFT ({self.DECAY_SHIFT}) must be >= 1 with "
                             f"(HIT + 1) << DECAY_SHIFT below 2**31")
        if not 0 <= self.RANK_BONUS < 1 << 30 or self.RANKS_PER_TOP_K < 1:
            raise ValueError(f"lrfu's RANK_BONUS ({self.RANK_BONUS}) must be in [0, 2**30) and its "
                             f"RANKS_PER_TOP_K ({self.RANKS_PER_TOP_K}) >= 1")
        if not 1 <= self.GHOST_DECAY_SHIFT <= 30 or not 0 <= self.GHOST_WEIGHT_QUARTERS <= 8:
            raise ValueError(f"lrfu's GHOST_DECAY_SHIFT ({self.GHOST_DECAY_SHIFT}) must be in [1, 30] and its "
                             f"GHOST_WEIGHT_QUARTERS ({self.GHOST_WEIGHT_QUARTERS}) in [0, 8]")
        return self.HIT, self.DECAY_SHIFT

    def kernel_view(self) -> KernelPolicy:
        """The constants checked by `constants`."""
        hit, decay_shift = self.constants()
        constants = PolicyConstants(hit=hit, decay_shift=decay_shift, rank_bonus=self.RANK_BONUS,
                                    ranks_per_top_k=self.RANKS_PER_TOP_K, ghost_decay_shift=self.GHOST_DECAY_SHIFT,
                                    ghost_weight_quarters=self.GHOST_WEIGHT_QUARTERS)
        return KernelPolicy(self.name, constants, values=self.state["value"], ghost_pos=self.state["ghost_pos"],
                            ghost_value=self.state["ghost_value"])

    def rank_credit(self, rank: int, width: int) -> int:
        """The key credit of a slot whose position is ranked `rank` (1 for the best) below the top-k."""
        span = self.RANKS_PER_TOP_K * max(width, 1)
        return self.RANK_BONUS * max(span - (rank - 1), 0) // span if rank > 0 else 0

    def choose(self, order, is_hit, num_misses, state, next_rank, width, positions, missed):
        hit, shift = self.constants()
        value = [v - (v >> shift) for v in state["value"]]
        ghosts = [(p, g - (g >> self.GHOST_DECAY_SHIFT))
                  for p, g in zip(state["ghost_pos"], state["ghost_value"], strict=True) if p >= 0]
        key = [v + self.rank_credit(rank, width) for v, rank in zip(value, next_rank, strict=True)]
        evictable = [s for s in order if not is_hit[s]]
        victims = sorted(evictable, key=lambda s: key[s])[:num_misses]  # stable: ties in order
        taken = set(victims)
        new_order = [s for s in evictable if s not in taken] + victims + [s for s in order if is_hit[s]]
        evicted = [(positions[s], value[s]) for s in victims if positions[s] >= 0]  # in miss order
        entry_of = {p: i for i, (p, _) in enumerate(ghosts)}  # (listed twice, which no step makes: the newest)
        for s, selected in enumerate(is_hit):
            if selected:
                value[s] += hit
        returned = {entry_of[p] for p in missed if p in entry_of}
        for s, p in zip(victims, missed, strict=True):
            ghost = ghosts[entry_of[p]][1] if p in entry_of else 0
            value[s] = min(hit + self.GHOST_WEIGHT_QUARTERS * ghost // 4, hit << shift)
        kept = ([entry for i, entry in enumerate(ghosts) if i not in returned] + evicted)[-len(order):]
        empty = [(-1, 0)] * (len(order) - len(kept))
        return victims, new_order, {"value": value, "ghost_pos": [p for p, _ in empty + kept],
                                    "ghost_value": [g for _, g in empty + kept]}


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, FIFOPolicy, ClockPolicy, ScoreLRUPolicy, LRFUPolicy)
}


def get_policy(name: str, num_rows: int | None = None, num_slots: int | None = None,
               device: torch.device | str | None = None) -> EvictionPolicy:
    """A policy by name. Stateful ones (clock) need the table shape and belong to one layer."""
    if name not in EVICTION_POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(EVICTION_POLICIES)}")
    return EVICTION_POLICIES[name](num_rows, num_slots, device)


def resolve_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    """Accept a name for stateless policies, an object for any (what `swap_in(policy=...)` takes)."""
    if isinstance(policy, EvictionPolicy):
        return policy
    if isinstance(policy, str):
        return get_policy(policy)
    raise ValueError(f"policy must be a name or an EvictionPolicy, got {type(policy).__name__}")


def new_slot_tables(num_rows: int, num_slots: int,
                    device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh `slot_pos` (all empty) and `lru` (identity order) for one layer."""
    slot_pos = torch.full((num_rows, num_slots), -1, dtype=torch.int32, device=device)
    lru = torch.arange(num_slots, dtype=torch.int32, device=device).repeat(num_rows, 1)
    return slot_pos, lru


def reset_row(slot_pos: torch.Tensor, lru: torch.Tensor, row: int,
              positions: Sequence[int] | torch.Tensor = (), policy: EvictionPolicy | None = None) -> None:
    """Set a row to "slots 0..n-1 hold `positions`, the rest are empty", empty slots oldest.

    Used when a request is admitted or leaves the dense fast path: the buffer then holds its last
    tokens in order (typically `range(p0, p0 + n)`). The order is [n..S-1, 0..n-1], so empty slots
    are filled before any token is evicted and the earliest of the given positions goes first. It is
    also CLOCK's ring with the hand on the first empty slot. `policy`, if given, forgets the row's
    history too.
    """
    num_slots = slot_pos.shape[1]
    pos = torch.as_tensor(positions, dtype=torch.int32).to(slot_pos.device).flatten()
    n = pos.numel()
    if n > num_slots:
        raise ValueError(f"{n} positions do not fit in {num_slots} hot slots")
    if n and torch.unique(pos).numel() != n:
        raise ValueError("positions must be distinct")
    slot_pos[row] = -1
    slot_pos[row, :n] = pos
    ids = torch.arange(num_slots, dtype=lru.dtype, device=lru.device)
    lru[row] = torch.cat((ids[n:], ids[:n]))
    if policy is not None:
        policy.reset_row(row, n)
