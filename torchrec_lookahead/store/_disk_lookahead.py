"""The lookahead host policy of :class:`~torchrec_lookahead.store.DiskStore`: the planner's hints of the rows
each coming step gathers, the next use of each row of the host tier (what the evictions rank by), and the
background thread that reads the rows of the steps within ``disk_prefetch_depth`` into the host tier.

The hints decide only where rows are, never a value: a background read keeps no row written (or reset by a
load) while it read, and a gather waits for a read in flight of its own rows instead of reading them twice.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import numpy as np
import torch

from torchrec_lookahead.store._disk_file import DiskFile
from torchrec_lookahead.store._host_tier import HostTier

__all__: List[str] = []

NEVER = np.iinfo(np.int64).max  # the next use of a row no known step reads


class LookaheadReads:
    """The planned reads of a disk store (mixed into :class:`~torchrec_lookahead.store.DiskStore`, whose state
    they share under its lock: ``_hints`` per planned step, ``_step`` gathered last, ``_read_upto`` read by the
    background thread, ``_inflight`` being read, ``_written`` / ``_reset`` while a read is in flight)."""

    _policy: str
    _depth: int
    _lock: threading.Lock
    _wake: threading.Condition
    _closing: bool
    _hints: Dict[int, np.ndarray]
    _step: int
    _read_upto: int
    _written: Optional[List[np.ndarray]]
    _reset: bool
    _inflight: Optional[np.ndarray]
    _tier: HostTier
    _file: DiskFile
    _counts: Dict[str, int]

    if TYPE_CHECKING:

        @property
        def num_embeddings(self) -> int: ...

        def _ensure_init(self, ids: Optional[torch.Tensor]) -> None: ...

        def _read_uncounted(self, ids: np.ndarray) -> Tuple[np.ndarray, int]: ...

        def _evict(self, victims: np.ndarray) -> None: ...

    def plan_reads(self, step: int, ids: torch.Tensor) -> None:
        """Step ``step`` will gather ``ids`` (a hint from the planner; ignored under the LRU policy). Under the
        lookahead policy the rows are read into the host tier in the background once the gathered step is within
        ``disk_prefetch_depth`` of ``step``, and the host tier keeps them until then in preference to rows
        needed later. A hint never changes a value: out-of-range ids are dropped, and a wrong hint costs only
        reads."""
        if self._policy != "lookahead":
            return
        arr = ids.detach().to("cpu", torch.int64).reshape(-1).numpy()
        arr = np.unique(arr[(arr >= 0) & (arr < self.num_embeddings)])
        with self._lock:
            if step <= self._step or self._closing:
                return
            self._hints[int(step)] = arr
            self._wake.notify_all()

    def at_step(self, step: int) -> None:
        """The stager gathers step ``step`` now: hints of earlier steps are dropped, and the background thread may
        read up to ``step + disk_prefetch_depth``. Steps go forward; a lower one (a new epoch) starts over."""
        if self._policy != "lookahead":
            return
        with self._lock:
            step = int(step)
            if step < self._step:  # a new iteration: earlier hints are of the old one
                self._hints = {s: v for s, v in self._hints.items() if s >= step}
                self._read_upto = step - 1
            else:
                for s in [s for s in self._hints if s < step]:
                    del self._hints[s]
            self._step = step
            self._wake.notify_all()

    def _next_use(self) -> np.ndarray:
        """Per slot of the host tier, the first hinted step from the gathered one on that reads its row
        (:data:`NEVER` when none)."""
        tier = self._tier
        nxt = np.full(tier.capacity, NEVER, dtype=np.int64)
        for s in sorted(self._hints, reverse=True):
            if s < self._step:
                continue
            slots = tier.find(self._hints[s])
            nxt[slots[slots >= 0]] = s
        return nxt

    def _next_prefetch(self) -> Optional[int]:
        """The first hinted step not read yet within the prefetch depth, if the rows of the steps from the
        gathered one to it fit in the host tier together (under the lock). Reading a step whose rows would
        not stay until it is gathered would only read them twice."""
        lo = max(self._read_upto, self._step)
        ready = [s for s in self._hints if lo < s <= self._step + self._depth]
        if not ready:
            return None
        step = min(ready)
        window = [v for s, v in self._hints.items() if self._step <= s <= step]
        if np.unique(np.concatenate(window)).size > self._tier.capacity:
            return None
        return step

    def _prefetch_loop(self) -> None:
        while True:
            with self._lock:
                while not self._closing and self._next_prefetch() is None:
                    self._wake.wait()
                if self._closing or self._file.closed:
                    return
                step = self._next_prefetch()
                assert step is not None
                self._read_upto = step
                try:
                    miss = self._prefetch_begin(step)
                except Exception:  # a failing disk: the gathers meet the error themselves
                    miss, self._written = None, None
            if miss is None or miss.size == 0:
                continue
            try:
                records, units = self._read_uncounted(miss)
            except Exception:
                with self._lock:
                    self._written = self._inflight = None
                    self._wake.notify_all()
                continue
            with self._lock:
                try:
                    self._prefetch_end(step, miss, records, units)
                except Exception:
                    pass
                finally:
                    self._written = self._inflight = None
                    self._reset = False
                    self._wake.notify_all()

    def _prefetch_begin(self, step: int) -> Optional[np.ndarray]:
        """Under the lock: the rows of ``step`` to read (not in the host tier, as many as it has room for
        without evicting a row needed by ``step`` or sooner); starts recording the file's writes."""
        if self._file.closed:
            return None
        ids = self._hints[step]
        if ids.size == 0:
            return None
        self._ensure_init(torch.from_numpy(ids))
        tier = self._tier
        miss = ids[tier.find(ids) < 0]
        if miss.size == 0:
            return None
        nxt = self._next_use()
        room = tier.num_free + int(((nxt > step) & (tier.id_of >= 0)).sum())
        miss = miss[:room]
        self._inflight = miss
        self._written = []
        self._reset = False
        return miss

    def _prefetch_end(self, step: int, miss: np.ndarray, records: np.ndarray, units: int) -> None:
        """Under the lock: keep the rows read for ``step`` that are still missing and were not written
        meanwhile, evicting for them only rows next needed after ``step``."""
        self._counts["rows_read"] += miss.size
        self._counts["unit_reads"] += units
        keep = np.ones(miss.size, dtype=bool)
        if self._reset or self._file.closed:
            keep[:] = False
        elif self._written:
            keep &= ~np.isin(miss, np.concatenate(self._written))
        tier = self._tier
        keep &= tier.find(miss) < 0
        idx = np.flatnonzero(keep)
        if idx.size > tier.num_free:
            nxt = self._next_use()
            later = tier.furthest(idx.size - tier.num_free, nxt, nxt > step)
            self._evict(later)
            idx = idx[: tier.num_free]
        self._counts["prefetch_discarded"] += miss.size - idx.size
        if idx.size == 0:
            return
        new = tier.put(miss[idx], dirty=False)
        tier.rows[torch.from_numpy(new)] = torch.from_numpy(records[idx])
        tier.touch(new)
        self._counts["rows_prefetched"] += idx.size
