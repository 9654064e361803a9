"""Hands out token-sized slots of a pool and takes them back; the only place slots change owner."""

from __future__ import annotations

import numpy as np


class OutOfSlots(RuntimeError):
    pass


class SlotAllocator:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        # A stack of free slots; low slots come out first so small workloads touch little memory.
        self._free = np.arange(num_slots - 1, -1, -1, dtype=np.int64)
        self._top = num_slots
        self._owned = np.zeros(num_slots, dtype=bool)

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.num_slots - self._top

    def allocate(self, n: int) -> np.ndarray:
        if n > self._top:
            raise OutOfSlots(f"asked for {n} slots, {self._top} free")
        out = self._free[self._top - n:self._top][::-1].copy()
        self._top -= n
        self._owned[out] = True
        return out

    def free(self, slots: np.ndarray) -> None:
        slots = np.asarray(slots, dtype=np.int64)
        if slots.size == 0:
            return
        if not self._owned[slots].all() or np.unique(slots).size != slots.size:
            raise ValueError("freeing slots that are not allocated (double free)")
        self._owned[slots] = False
        self._free[self._top:self._top + slots.size] = slots[::-1]
        self._top += slots.size
