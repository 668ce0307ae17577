"""The host-tier half of the capacity check (contract 2 for the disk tier): per table in a disk store, the rows
each window of steps reads from each shard's host tier, checked against the rows that tier holds, one batch at
a time (:class:`HostWindowCheck`). The pre-scan (:func:`~torchrec_lookahead.runtime.capacity.check_stream`) and
the planner thread (:class:`~torchrec_lookahead.runtime._planning.StepPlanner`, as it reads each batch
``horizon`` batches ahead of training) run the same check, so both refuse the same windows.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from torchrec_lookahead._arrays import sorted_unique
from torchrec_lookahead.errors import CapacityError
from torchrec_lookahead.store.types import HostWindow

__all__: List[str] = []


@dataclass(frozen=True)
class HostShortfall:
    """A window whose rows on one shard do not fit that shard's host tier.

    Attributes:
        table: the table.
        lo: the window's first batch.
        hi: its last batch (the batch whose reading completed it).
        shard: the shard, and ``shards`` of them.
        needed: the window's distinct ids on the shard (the error's ``needed`` is the table's largest window
            need over the batches checked, when given: the number its message names).
        available: the rows the shard's host tier holds.
        window: the table's host window (depth, bounds, policy).
    """

    table: str
    lo: int
    hi: int
    shard: int
    needed: int
    available: int
    window: HostWindow

    def _whole_budget(self, largest: Optional[Mapping[str, int]]) -> int:
        """The one-int ``host_budget_bytes`` whose share gives this table the rows (0: budgets are per table)."""
        w, rows = self.window, max(self.needed, (largest or {}).get(self.table, 0))
        total, share = w.budget_split
        return -(-rows * w.row_bytes * total // share) if w.row_bytes and share else 0

    def error(
        self, largest: Optional[Mapping[str, int]] = None, others: Sequence[HostShortfall] = ()
    ) -> CapacityError:
        """The :class:`~torchrec_lookahead.errors.CapacityError` (``tier="host"``) that refuses this window;
        ``largest``: the largest window need of each short table over the batches checked, and ``others``: the
        other short tables' first windows, for the message (the one-int budget that holds them all)."""
        w = self.window
        where = f"batch {self.hi}" if self.lo == self.hi else f"batches {self.lo}..{self.hi}"
        if w.policy == "lookahead":
            why = (
                f"host_policy='lookahead' reads the rows of the gathered step and of the disk_prefetch_depth="
                f"{w.depth} steps after it into the host tier together"
            )
        else:
            why = "every row a step fetches into the device cache passes through the host tier"
        shard = ""
        if len(w.rows) > 1:
            lo, hi = w.bounds[self.shard], w.bounds[self.shard + 1]
            shard = f" (shard {self.shard} of {len(w.rows)}, rows [{lo}, {hi}))"
        at_least = max(self.needed, (largest or {}).get(self.table, 0))
        size = f" ({at_least * w.row_bytes:,} bytes)" if w.row_bytes else ""
        whole = max(s._whole_budget(largest) for s in (self, *others))
        if whole:
            size += f"; one int for all tables: host_budget_bytes >= {whole:,}"
        also = ""
        if largest:
            also = f"; the checked batches' largest host windows need {dict(largest)} rows"
        depth = ", lower disk_prefetch_depth" if w.policy == "lookahead" and w.depth > 0 else ""
        return CapacityError(
            f"table {self.table!r}: {where} need{'s' if self.lo == self.hi else ''} {self.needed} rows in the host "
            f"tier of its disk store{shard} but it holds {self.available} ({why}){also}: raise host_budget_bytes "
            f"so that the table's share holds at least {at_least} rows{size}{depth}, or use smaller batches "
            "(a host tier below one window would read its rows from disk on the step's critical path)",
            table=self.table,
            batch=self.hi,
            needed=at_least,  # what the tier must hold: the number the message names (the largest window)
            available=self.available,
            tier="host",
        )


class _TableWindows:
    """One table's sliding window: the distinct ids of its last ``depth + 1`` batches per shard, kept by a count
    per table row of the window's batches holding it (one byte per row while the window is at most 255 batches;
    allocated zeroed, so untouched pages cost no memory)."""

    def __init__(self, name: str, window: HostWindow) -> None:
        self.name = name
        self.window = window
        self.rows = np.asarray(window.rows, dtype=np.int64)
        self.inside = np.zeros(len(window.rows), dtype=np.int64)  # distinct ids of the window per shard
        self.batches: Deque[Tuple[np.ndarray, np.ndarray]] = deque()  # (unique ids, their shards)
        self.count: Optional[np.ndarray] = None
        if window.depth > 0:
            dtype = np.uint8 if window.depth < 255 else np.uint16 if window.depth < 65535 else np.uint32
            self.count = np.zeros(window.num_rows, dtype=dtype)
        self.largest = 0

    def push(self, step: int, uniq: np.ndarray) -> Optional[HostShortfall]:
        shards = self.window.shard_of(uniq)
        width = len(self.window.rows)
        if self.count is None:
            self.inside = np.bincount(shards, minlength=width)
        else:
            if len(self.batches) == self.window.depth + 1:
                old, old_shards = self.batches.popleft()
                self.count[old] -= 1
                self.inside -= np.bincount(old_shards[self.count[old] == 0], minlength=width)
            self.count[uniq] += 1
            self.inside += np.bincount(shards[self.count[uniq] == 1], minlength=width)
            self.batches.append((uniq, shards))
        self.largest = max(self.largest, int(self.inside.max(initial=0)))
        over = np.flatnonzero(self.inside > self.rows)
        if over.size == 0:
            return None
        shard = int(over[0])
        return HostShortfall(
            self.name,
            max(step - self.window.depth, 0),
            step,
            shard,
            int(self.inside[shard]),
            int(self.rows[shard]),
            self.window,
        )


class HostWindowCheck:
    """Per table with a host window, the rows each window of batches reads from each shard's host tier, checked
    batch by batch (see :class:`~torchrec_lookahead.store.types.HostWindow`).

    Args:
        windows: table -> its host window (tables without one are not checked).

    Example:
        >>> w = HostWindow(depth=1, bounds=(0, 100), rows=(2,), policy="lookahead")
        >>> check = HostWindowCheck({"t": w})
        >>> check.push({"t": np.array([1, 2, 1])}), check.push({"t": np.array([2, 5])})[0].needed
        ([], 3)
    """

    def __init__(self, windows: Mapping[str, HostWindow]) -> None:
        self._tables = {name: _TableWindows(name, w) for name, w in sorted(windows.items())}
        self._step = 0

    def __bool__(self) -> bool:
        return bool(self._tables)

    @property
    def tables(self) -> List[str]:
        """The checked tables, sorted."""
        return list(self._tables)

    @property
    def largest(self) -> Dict[str, int]:
        """Per checked table, the most rows a window checked so far needs on one shard."""
        return {name: tab.largest for name, tab in self._tables.items()}

    def push(self, ids: Mapping[str, np.ndarray]) -> List[HostShortfall]:
        """Read the next batch: per checked table its ids (in range; any order, repeats allowed; a table
        missing from ``ids`` reads none). Returns the tables whose window ending at this batch does not fit (in
        table order; empty when all fit)."""
        step = self._step
        self._step += 1
        empty = np.zeros(0, dtype=np.int64)
        short = []
        for name, tab in self._tables.items():
            found = tab.push(step, sorted_unique(ids.get(name, empty)))
            if found is not None:
                short.append(found)
        return short
