"""The bounded host-memory tier of a :class:`~torchrec_lookahead.store.DiskStore`: rows by slot, dirty bits, and
the choice of the rows to evict (least recently used, or furthest next use first when the next uses are known)."""

from __future__ import annotations

from typing import List

import numpy as np
import torch

__all__: List[str] = []


class HostTier:
    """``capacity`` rows of ``width`` float32 columns, addressed by slot, for a table of ``num_rows`` rows.

    The row -> slot map is one int32 per table row, allocated zeroed (the kernel maps its pages on first
    write); slot memory is allocated up front but touched only as slots fill.
    """

    def __init__(self, capacity: int, width: int, num_rows: int) -> None:
        self.capacity = int(capacity)
        self.rows = torch.empty(self.capacity, width, dtype=torch.float32)
        self._slot_of = np.zeros(num_rows, dtype=np.int32)  # slot + 1; 0: not in the tier
        self.id_of = np.full(self.capacity, -1, dtype=np.int64)
        self.dirty = np.zeros(self.capacity, dtype=bool)
        self._stamp = np.zeros(self.capacity, dtype=np.int64)
        self._free = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)  # a stack: slot 0 on top
        self._num_free = self.capacity
        self._tick = 0

    @property
    def num_free(self) -> int:
        """Slots holding no row."""
        return self._num_free

    @property
    def occupied(self) -> np.ndarray:
        """Slots holding a row."""
        return np.flatnonzero(self.id_of >= 0)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, -1 where the id is not in the tier."""
        return self._slot_of[ids].astype(np.int64) - 1

    def touch(self, slots: np.ndarray) -> None:
        """Mark ``slots`` used now (one tick per call: rows of one call are equally recent)."""
        self._tick += 1
        self._stamp[slots] = self._tick

    def victims(self, count: int) -> np.ndarray:
        """The ``count`` least recently used occupied slots (all of them if fewer). Slots touched by the current
        call are the most recent, so they are chosen only when ``count`` exceeds the others."""
        occ = self.occupied
        if count >= occ.size:
            return occ
        return occ[np.argpartition(self._stamp[occ], count)[:count]]

    def furthest(self, count: int, next_use: np.ndarray, eligible: np.ndarray) -> np.ndarray:
        """At most ``count`` occupied slots among ``eligible`` (a mask over slots), the furthest ``next_use``
        first (a step, or a value past every step when none is known), ties broken least recently used first."""
        occ = np.flatnonzero((self.id_of >= 0) & eligible)
        if count >= occ.size:
            return occ
        order = np.lexsort((self._stamp[occ], -next_use[occ]))
        return occ[order[:count]]

    def drop(self, slots: np.ndarray) -> None:
        """Forget the rows of ``slots`` (already written back where dirty) and free the slots."""
        if slots.size == 0:
            return
        self._slot_of[self.id_of[slots]] = 0
        self.id_of[slots] = -1
        self.dirty[slots] = False
        self._free[self._num_free : self._num_free + slots.size] = slots
        self._num_free += slots.size

    def put(self, ids: np.ndarray, dirty: bool) -> np.ndarray:
        """Give each of ``ids`` (distinct, not in the tier, at most :attr:`num_free`) a free slot; returns the slots
        (the caller writes the rows)."""
        n = ids.size
        slots = self._free[self._num_free - n : self._num_free][::-1].copy()
        self._num_free -= n
        self.id_of[slots] = ids
        self._slot_of[ids] = (slots + 1).astype(np.int32)
        self.dirty[slots] = dirty
        return slots

    def clear(self) -> None:
        """Forget every row (nothing is written back)."""
        self.drop(self.occupied)
