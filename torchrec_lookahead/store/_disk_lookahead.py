"""The lookahead host policy of :class:`~torchrec_lookahead.store.DiskStore`: the planner's hints of the rows
each coming step gathers and looks up, the next use of each row of the host tier, the eviction score built from
them and the room made by it for gathered and written rows, and the background thread that reads the rows of
the steps within ``disk_prefetch_depth`` into the host tier.

The host tier sees the device cache's miss stream: the rows it gathers (fetches) and the rows it writes back
(evictions). A row the device cache gathered is held there until its write-back, which replaces the host copy,
so that copy is never read again (``dead``): the policy keeps the host tier exclusive of the device cache and
ranks the rows by their next use in the fetch stream (Belady over the hinted steps), then, for the rows no
hinted step reads, by how often the device cache fetched them (a row's popularity is the best guess of its
next fetch past the hints), least recently used last.

The hints decide only where rows are, never a value: a background read keeps no row written (or reset by a
load) while it read, and a gather waits for a read in flight of its own rows instead of reading them twice.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from torchrec_lookahead._arrays import sorted_unique
from torchrec_lookahead.store._disk_file import DiskFile
from torchrec_lookahead.store._host_tier import HostTier

__all__: List[str] = []

NEVER = np.iinfo(np.int64).max  # the next use of a row no known step reads

# Eviction score classes (higher is evicted first): a row some hinted step fetches scores its distance to that
# step (below 2**40); a row none fetches scores its class, then (live rows) 255 - its fetch count, then its age.
# in the device cache (gathered, not written back since), dirty: evicting it writes a row that the device cache's
# write-back replaces anyway, so it stays until that write-back unless nothing else can go
_DEAD_DIRTY = 1 << 60
_LIVE = 2 << 60  # not in the device cache: its next fetch is past the hints
_DEAD = 3 << 60  # in the device cache, clean: free to drop
_AGE_MAX = (1 << 40) - 1
# when full, evict at least 1/32 of the tier at once, among the rows no hinted step fetches (one scoring of the
# tier per batch of calls)
_SCORE_EVICT_FRACTION = 32


def _members(ids: np.ndarray, hinted: np.ndarray) -> np.ndarray:
    """The mask of ``ids`` in ``hinted`` (sorted and distinct, as :meth:`LookaheadReads._hint` keeps every hint):
    a binary search of each id, where ``np.isin`` would sort both arrays again (for the hints that arrived after
    :class:`_FirstSteps` merged the others).

    Example:
        >>> _members(np.array([5, 1, 9, 3]), np.array([1, 3, 4])).tolist()
        [False, True, False, True]
    """
    return _search(hinted, ids)[1]


def _search(sorted_ids: np.ndarray, ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Each of ``ids``'s position in ``sorted_ids`` (sorted, distinct) and whether it is there (the position is
    meaningful only where it is)."""
    if sorted_ids.size == 0:
        return np.zeros(ids.size, dtype=np.int64), np.zeros(ids.size, dtype=bool)
    at = np.minimum(np.searchsorted(sorted_ids, ids), sorted_ids.size - 1)
    return at, sorted_ids[at] == ids


class _FirstSteps:
    """Per id, the first step after ``after`` whose hint of one kind (``_uses`` or ``_hints``) names it: the hints
    merged into one sorted index of distinct ids when built (at each new gathered step, once asked), and those
    recorded since kept as they came (``late``), so that a row's next use is one search instead of one per hinted
    step.

    Example:
        >>> first = _FirstSteps({3: np.array([1, 4]), 5: np.array([4, 7]), 2: np.array([9])}, after=2)
        >>> first.late.append((6, np.array([2, 7])))
        >>> [int(s) if s != NEVER else None for s in first.of(np.array([4, 7, 9, 2]))]
        [3, 5, None, 6]
    """

    def __init__(self, hints: Dict[int, np.ndarray], after: int) -> None:
        steps = sorted(s for s in hints if s > after)
        ids = np.concatenate([hints[s] for s in steps]) if steps else np.empty(0, dtype=np.int64)
        at = np.repeat(np.asarray(steps, dtype=np.int64), [hints[s].size for s in steps])
        # an id's entries together, in any order (a stable sort is several times slower): its first step is
        # the least of them
        order = np.argsort(ids)
        ids, at = ids[order], at[order]
        first = np.ones(ids.size, dtype=bool)
        first[1:] = ids[1:] != ids[:-1]
        starts = np.flatnonzero(first)
        self.ids = ids[starts]
        self.at = np.minimum.reduceat(at, starts) if starts.size else at
        self.late: List[Tuple[int, np.ndarray]] = []

    def parts(self) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
        """The (distinct ids, their step) parts: the index, then each late hint."""
        yield self.ids, self.at
        for step, ids in self.late:
            yield ids, np.full(ids.size, step, dtype=np.int64)

    def of(self, ids: np.ndarray) -> np.ndarray:
        """The first step of each of ``ids`` (:data:`NEVER` where no hint names it)."""
        nxt = np.full(ids.size, NEVER, dtype=np.int64)
        at, found = _search(self.ids, ids)
        nxt[found] = self.at[at[found]]
        for step, hinted in self.late:
            nxt[_members(ids, hinted) & (nxt > step)] = step
        return nxt


def _held(tier: HostTier, ids: np.ndarray, live_only: bool) -> Tuple[np.ndarray, np.ndarray]:
    """The slot of each of ``ids`` in ``tier`` and whether the tier holds it there; with ``live_only``, not where
    the device cache holds the row too (``dead``)."""
    slots = tier.find(ids)
    held = slots >= 0
    if live_only:
        held[held] = ~tier.dead[slots[held]]
    return slots, held


def _mark(nxt: np.ndarray, tier: HostTier, ids: np.ndarray, at: np.ndarray, live_only: bool) -> None:
    """Lower ``nxt`` (a step per slot of ``tier``) to ``at`` at the slots of ``ids`` (distinct) that the tier
    holds (see :func:`_held`)."""
    slots, held = _held(tier, ids, live_only)
    slots, at = slots[held], at[held]
    nxt[slots] = np.minimum(nxt[slots], at)


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
    _uses: Dict[int, np.ndarray]
    _first: Optional[Tuple[_FirstSteps, _FirstSteps]]
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

        def _read_uncounted(self, ids: np.ndarray) -> Tuple[np.ndarray, int, np.ndarray]: ...

        def _evict(self, victims: np.ndarray) -> None: ...

    def plan_reads(self, step: int, ids: torch.Tensor) -> None:
        """Step ``step`` will gather ``ids`` (a hint from the planner; ignored under the LRU policy). Under the
        lookahead policy the rows are read into the host tier in the background once the gathered step is within
        ``disk_prefetch_depth`` of ``step``, and the host tier keeps them until then in preference to rows
        needed later. A hint never changes a value: out-of-range ids are dropped, and a wrong hint costs only
        reads."""
        self._hint(self._hints, step, ids)

    def plan_uses(self, step: int, ids: torch.Tensor) -> None:
        """Step ``step``'s batch looks up ``ids`` (a hint from the planner as it reads the batch, the oracle's
        horizon before the step's plan; ignored under the LRU policy). A row of the host tier that the device
        cache does not hold is fetched at its next use: the lookahead policy ranks those rows by it. A hint never
        changes a value."""
        self._hint(self._uses, step, ids)

    def _hint(self, hints: Dict[int, np.ndarray], step: int, ids: torch.Tensor) -> None:
        """Record ``ids`` (in range, sorted, distinct) as step ``step``'s in ``hints`` (``_hints`` or ``_uses``),
        unless the step was gathered already (lookahead policy only)."""
        if self._policy != "lookahead":
            return
        # few calls that release the GIL: on the planner thread each one waits for the GIL to come back
        if ids.dtype == torch.int64 and ids.device.type == "cpu" and not ids.requires_grad:
            arr = sorted_unique(ids.numpy())
        else:
            arr = sorted_unique(ids.detach().to("cpu", torch.int64).numpy())
        if arr.size and (arr[0] < 0 or arr[-1] >= self.num_embeddings):  # sorted: the range is its two ends
            arr = arr[(arr >= 0) & (arr < self.num_embeddings)]
        with self._lock:
            if step <= self._step or self._closing:
                return
            step = int(step)
            if self._first is not None:
                if step in hints:  # a step hinted again: its old ids are in the index
                    self._first = None
                else:
                    self._first[0 if hints is self._uses else 1].late.append((step, arr))
            hints[step] = arr
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
                self._uses = {s: v for s, v in self._uses.items() if s >= step}
                self._read_upto = step - 1
            else:
                for s in [s for s in self._hints if s < step]:
                    del self._hints[s]
                for s in [s for s in self._uses if s <= step]:
                    del self._uses[s]
            self._step = step
            self._first = None
            self._wake.notify_all()

    def _first_steps(self) -> Tuple[_FirstSteps, _FirstSteps]:
        """The first use and the first read hinted after the gathered step, per id (under the lock): built once
        per gathered step, kept current by :meth:`_hint`."""
        if self._first is None:
            self._first = (_FirstSteps(self._uses, self._step), _FirstSteps(self._hints, self._step))
        return self._first

    def _next_use(self) -> np.ndarray:
        """Per slot of the host tier, the first step from the gathered one on that fetches its row (:data:`NEVER`
        when none is known): a hinted fetch, or for a row the device cache does not hold, a hinted use after the
        gathered step. A row gathered (at the gathered step) is not counted as fetched by it."""
        tier = self._tier
        nxt = np.full(tier.capacity, NEVER, dtype=np.int64)
        uses, reads = self._first_steps()
        for ids, at in uses.parts():
            _mark(nxt, tier, ids, at, live_only=True)
        for ids, at in reads.parts():
            _mark(nxt, tier, ids, at, live_only=False)
        now = self._hints.get(self._step)
        if now is not None:
            _mark(nxt, tier, now, np.full(now.size, self._step, dtype=np.int64), live_only=True)
        return nxt

    def _next_use_of(self, ids: np.ndarray) -> np.ndarray:
        """The first step after the gathered one that fetches or uses each of ``ids`` (rows the device cache
        writes back now; :data:`NEVER` when none is known)."""
        uses, reads = self._first_steps()
        return np.minimum(uses.of(ids), reads.of(ids))

    def _score(self, nxt: np.ndarray) -> np.ndarray:
        """Per slot, the eviction score (higher is evicted first) from ``nxt`` (:meth:`_next_use`): the rows
        some hinted step fetches by that step (the furthest first); above them the rows none fetches: first the
        clean rows the device cache holds (their copy here is never read again), then the rows it does not hold,
        those it fetched least often first, least recently used first among equals, and last the dirty rows it
        holds (evicting one writes a row that its write-back replaces anyway)."""
        tier = self._tier
        age = np.minimum(tier.tick - tier.stamp_of(np.arange(tier.capacity)), _AGE_MAX)
        freq = tier.freq[tier.id_of].astype(np.int64) if tier.freq.size else np.zeros(tier.capacity, np.int64)
        unknown = np.where(
            tier.dead, np.where(tier.dirty, _DEAD_DIRTY, _DEAD) + age, _LIVE + ((255 - freq) << 40) + age
        )
        return np.where(nxt == NEVER, unknown, nxt - self._step)

    def _room_for_gathered(self, count: int, protect: np.ndarray) -> int:
        """Lookahead: free up to ``count`` slots for rows a gather read, evicting only clean rows the device cache
        holds and no hinted step fetches (the rows read now will be such rows), never the ``protect`` slots (the
        call's hits); returns the free slots (those rows are kept only where there is room)."""
        tier = self._tier
        need = count - tier.num_free
        if need > 0:
            score = self._score(self._next_use())
            eligible = score >= _DEAD
            eligible[protect] = False
            # past what is needed, at least 1/32 of the tier: the tier is scored once per batch of calls
            self._evict(tier.highest(max(need, tier.capacity // _SCORE_EVICT_FRACTION), score, eligible))
        return min(count, tier.num_free)

    def _room_for_written(self, ids: np.ndarray, protect: np.ndarray) -> np.ndarray:
        """Lookahead: free slots for the written rows ``ids`` the tier lacks, never evicting the ``protect`` slots
        (the call's hits). Belady with bypass: the rows of the tier and the written ones compete on their
        eviction score, and a written row scored above the rows it would evict goes to the file instead; returns
        the mask of ``ids`` to keep. Past what is needed, at least 1/32 of the tier is evicted among the rows no
        hinted step fetches (not the dirty ones the device cache holds), so that the tier is scored once per
        batch of calls."""
        tier = self._tier
        keep = np.ones(ids.size, dtype=bool)
        need = ids.size - tier.num_free
        if need <= 0:
            return keep
        score = self._score(self._next_use())
        eligible = tier.id_of >= 0
        eligible[protect] = False
        occ = np.flatnonzero(eligible)
        both = np.concatenate([score[occ], self._incoming_score(ids)])
        unknown = int((both >= _LIVE).sum())
        k = min(both.size, max(need, min(tier.capacity // _SCORE_EVICT_FRACTION, unknown)))
        worst = np.argpartition(-both, k - 1)[:k] if k < both.size else np.arange(both.size)
        keep[worst[worst >= occ.size] - occ.size] = False
        self._evict(occ[worst[worst < occ.size]])
        return keep

    def _incoming_score(self, ids: np.ndarray) -> np.ndarray:
        """The eviction score of rows written back now (live, just used) that the host tier lacks."""
        nxt = self._next_use_of(ids)
        tier = self._tier
        freq = tier.freq[ids].astype(np.int64) if tier.freq.size else np.zeros(ids.size, np.int64)
        return np.where(nxt == NEVER, _LIVE + ((255 - freq) << 40), nxt - self._step)

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
        if sorted_unique(np.concatenate(window)).size > self._tier.capacity:
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
                records, units, _ = self._read_uncounted(miss)
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

    def _needed_by(self, step: int) -> int:
        """How many rows of the host tier some hinted step up to ``step`` fetches (under the lock): those whose
        :meth:`_next_use` is ``step`` or sooner, found from the hints of those steps alone (a background read may
        take every other slot)."""
        tier = self._tier
        near = [(ids, True) for s, ids in self._uses.items() if self._step < s <= step]
        near += [(ids, s == self._step) for s, ids in self._hints.items() if self._step <= s <= step]
        slots = []
        for ids, live_only in near:
            found, held = _held(tier, ids, live_only)
            slots.append(found[held])
        return int(sorted_unique(np.concatenate(slots)).size) if slots else 0

    def _prefetch_begin(self, step: int) -> Optional[np.ndarray]:
        """Under the lock: the rows of ``step`` to read (neither in the host tier nor held by the device cache, as
        many as it has room for without evicting a row needed by ``step`` or sooner); starts recording the file's
        writes."""
        if self._file.closed:
            return None
        ids = self._hints[step]
        if ids.size == 0:
            return None
        tier = self._tier
        miss = ids[tier.find(ids) < 0]
        miss = miss[self._file.on_disk(miss)]  # a row never written is computed when gathered, without I/O
        # a row the device cache holds comes back with its write-back, before the device cache can fetch it again
        miss = miss[~tier.device_holds(miss)]
        if miss.size == 0:
            return None
        miss = miss[: tier.capacity - self._needed_by(step)]
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
        tier = self._tier
        self._counts["rows_first_read"] += tier.mark_held(miss)
        if self._reset or self._file.closed:
            keep[:] = False
        elif self._written:
            keep &= ~np.isin(miss, np.concatenate(self._written))
        keep &= tier.find(miss) < 0
        idx = np.flatnonzero(keep)
        if idx.size > tier.num_free:
            nxt = self._next_use()
            later = tier.highest(idx.size - tier.num_free, self._score(nxt), nxt > step)
            self._evict(later)
            idx = idx[: tier.num_free]
        self._counts["prefetch_discarded"] += miss.size - idx.size
        if idx.size == 0:
            return
        new = tier.put(miss[idx], dirty=False)
        tier.rows[torch.from_numpy(new)] = torch.from_numpy(records[idx])
        tier.touch(new)
        self._counts["rows_prefetched"] += idx.size
