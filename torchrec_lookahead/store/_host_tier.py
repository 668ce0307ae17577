"""The bounded host-memory tier of a :class:`~torchrec_lookahead.store.DiskStore`: rows by slot, dirty bits, and
the choice of the rows to evict (least recently used, or by the lookahead policy's score).

It also remembers which rows it ever held or read (for the count of first reads against re-reads) and, for the
lookahead policy, how often the device cache fetched each row and which rows the device cache holds (gathered and
not written back since: a copy here is ``dead``, the device cache's write-back will replace it)."""

from __future__ import annotations

from typing import List

import numpy as np
import torch

__all__: List[str] = []

_FREQ_MAX = 255  # fetch counts saturate at one byte


class HostTier:
    """``capacity`` rows of ``width`` float32 columns, addressed by slot, for a table of ``num_rows`` rows.

    The row -> slot map is one int32 per table row, allocated zeroed (the kernel maps its pages on first
    write); slot memory is allocated up front but touched only as slots fill. ``count_fetches``: also one byte
    per table row counting the row's gathers (saturating, halved every ``16 * capacity`` counted gathers so that
    old popularity fades), for the lookahead policy's ranking of rows no planned step reads.
    """

    def __init__(self, capacity: int, width: int, num_rows: int, count_fetches: bool = False) -> None:
        self.capacity = int(capacity)
        self.rows = torch.empty(self.capacity, width, dtype=torch.float32)
        # slot + 1; 0: never held nor read; -1: held or read before, not in the tier now; -2: not in the tier, and
        # the device cache holds it (gathered under the lookahead policy, not written since)
        self._slot_of = np.zeros(num_rows, dtype=np.int32)
        self.id_of = np.full(self.capacity, -1, dtype=np.int64)
        self.dirty = np.zeros(self.capacity, dtype=bool)
        self.dead = np.zeros(self.capacity, dtype=bool)  # gathered, not written since (the device holds it)
        self._stamp = np.zeros(self.capacity, dtype=np.int64)
        self._free = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)  # a stack: slot 0 on top
        self._num_free = self.capacity
        self._tick = 0
        self.freq = np.zeros(num_rows if count_fetches else 0, dtype=np.uint8)
        self._counted = 0  # gathers counted since the last halving

    @property
    def num_free(self) -> int:
        """Slots holding no row."""
        return self._num_free

    @property
    def tick(self) -> int:
        """The current call's tick (see :meth:`touch`)."""
        return self._tick

    @property
    def occupied(self) -> np.ndarray:
        """Slots holding a row."""
        return np.flatnonzero(self.id_of >= 0)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id, -1 where the id is not in the tier."""
        return np.maximum(self._slot_of[ids], 0).astype(np.int64) - 1

    def mark_held(self, ids: np.ndarray) -> int:
        """Mark ``ids`` (not in the tier) as held or read before; returns how many were not (their reads are
        first reads)."""
        new = self._slot_of[ids] == 0
        self._slot_of[ids[new]] = -1
        return int(new.sum())

    def mark_gathered(self, ids: np.ndarray) -> None:
        """Mark ``ids`` (not in the tier) as held by the device cache (see :meth:`device_holds`)."""
        self._slot_of[ids] = -2

    def mark_written(self, ids: np.ndarray) -> None:
        """Mark ``ids`` (not in the tier), written to the file, as held before and no longer by the device cache."""
        self._slot_of[ids] = -1

    def device_holds(self, ids: np.ndarray) -> np.ndarray:
        """Whether the device cache holds each of ``ids``: gathered (under the lookahead policy) and not written
        since, whether the tier still holds a copy or not."""
        at = self._slot_of[ids]
        out = at == -2
        mine = at > 0
        out[mine] = self.dead[at[mine] - 1]
        return out

    def count_fetches(self, ids: np.ndarray) -> None:
        """Count one gather of each of the distinct ``ids`` (no-op without ``count_fetches``)."""
        if self.freq.size == 0 or ids.size == 0:
            return
        f = self.freq[ids]
        self.freq[ids] = f + (f < _FREQ_MAX)
        self._counted += ids.size
        if self._counted >= 16 * self.capacity:
            self.freq >>= 1
            self._counted = 0

    def stamp_of(self, slots: np.ndarray) -> np.ndarray:
        """The tick each of ``slots`` was last touched."""
        return self._stamp[slots]

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

    def highest(self, count: int, score: np.ndarray, eligible: np.ndarray) -> np.ndarray:
        """At most ``count`` occupied slots among ``eligible`` (a mask over slots), those of the highest
        ``score`` (a value per slot) first."""
        occ = np.flatnonzero((self.id_of >= 0) & eligible)
        if count >= occ.size:
            return occ
        if count <= 0:
            return occ[:0]
        return occ[np.argpartition(-score[occ], count - 1)[:count]]

    def drop(self, slots: np.ndarray) -> None:
        """Forget the rows of ``slots`` (already written back where dirty) and free the slots."""
        if slots.size == 0:
            return
        self._slot_of[self.id_of[slots]] = np.where(self.dead[slots], -2, -1)
        self.id_of[slots] = -1
        self.dirty[slots] = False
        self.dead[slots] = False
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
        self.dead[slots] = False
        return slots

    def clear(self) -> None:
        """Forget every row (nothing is written back)."""
        self.drop(self.occupied)
