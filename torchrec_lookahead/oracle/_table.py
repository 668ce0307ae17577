"""Private: per-table planner state shared by every policy.

A ``_TablePlanner`` holds, for one cached table:

* the cache: ``id_of_slot`` (C,), ``slot_of`` (one entry per table row, -1 when not resident), a stack of
  free slots, per-slot ``res_next`` (next use of the resident id, ``INF`` beyond the horizon) and ``rk``
  (recency key ``last_use << 32 | position in that batch's unique ids``);
* the lookahead window: the unique ids of every read but not yet planned batch and, per unique id, the step
  of its next occurrence (a flat buffer of ``next`` pointers filled in as later batches arrive, so a batch
  costs O(its unique ids), never O(horizon x batch));
* an LRU queue of (slot, id, rk) in ascending rk with lazy deletion.

Unique ids of a batch are listed in order of first occurrence (deterministic, and a dense-array dedup is
several times faster than a sort on CPU).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from torchrec_lookahead.errors import CapacityError, InvalidIdError
from torchrec_lookahead.oracle._fanout import Fanout, serial_map
from torchrec_lookahead.oracle.config import OracleConfig
from torchrec_lookahead.oracle.ranks import RankInfo, annotate, readers
from torchrec_lookahead.oracle.types import TablePlan, describe_window

__all__: List[str] = []

INF = np.int64(1 << 62)
FREE = np.int64(-1)
_LOW32 = np.int64(0xFFFFFFFF)
_EMPTY = np.zeros(0, dtype=np.int64)


def check_range(name: str, ids: np.ndarray, step: int, rows: Optional[int]) -> int:
    """Refuse (``InvalidIdError``) a negative id, or one of ``rows`` or more (any size when ``None``); returns the
    largest id (-1 for no ids)."""
    if ids.size == 0:
        return -1
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= (rows if rows is not None else (1 << 62)):
        bad = low if low < 0 else high
        valid = f"[0, {rows})" if rows is not None else "[0, 2**62)"
        raise InvalidIdError(
            f"table {name!r}: id {bad} in batch {step} is outside the valid range {valid}; fix the input ids or "
            f"set num_embeddings[{name!r}] to the table's number of rows",
            table=name,
            batch=step,
            id=bad,
            num_rows=rows,
        )
    return high


def _tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))


class _Record:
    """One read batch of one table inside the lookahead window."""

    __slots__ = ("step", "uniq", "inv", "prev_step", "ranks")

    def __init__(
        self, step: int, uniq: np.ndarray, inv: np.ndarray, prev_step: np.ndarray, ranks: Any
    ) -> None:
        self.step = step
        self.uniq = uniq
        self.inv = inv
        self.prev_step = prev_step
        self.ranks: Optional[RankInfo] = ranks


class _TablePlanner:
    """Base class: lookahead window, slot maps, free stack and LRU queue of one table."""

    #: policies with a fixed capacity check the prefetch window's working set when a batch is read.
    fixed_capacity = True
    #: keep ``res_next`` of resident ids up to date as batches arrive.
    track_next = True
    #: a table whose rows all fit (``num_embeddings <= capacity``) is mapped slot = id and never evicts.
    supports_direct = True
    policy_name = "base"

    def __init__(self, name: str, config: OracleConfig) -> None:
        self.name = name
        self.capacity = int(config.capacity[name])
        self.horizon = config.horizon
        self.depth = config.prefetch_depth
        self.num_ranks = config.num_ranks
        rows = None if config.num_embeddings is None else config.num_embeddings.get(name)
        self.rows: Optional[int] = None if rows is None else int(rows)
        n = self.rows if self.rows is not None else 1024
        # np.full touches every page now: first touches in the hot loop cost page faults
        # --- per table row (id)
        #: slot holding each id, -1 when the id is not resident
        self.slot_of = np.full(n, -1, dtype=np.int64)
        #: each id's last occurrence in the window: ``step << 32 | position in that batch's unique ids``, -1 never
        self.last_occ = np.full(n, -1, dtype=np.int64)
        #: per-id scratch of the dense-array dedup (position of an id in the batch being read, -1 elsewhere)
        self.scratch = np.full(n, -1, dtype=np.int32)
        self._arange = np.arange(1024, dtype=np.int32)
        cap = self.capacity
        # --- per cache slot
        #: id held by each slot, -1 when free
        self.id_of_slot = np.full(cap, -1, dtype=np.int64)
        #: step of the next use of each slot's id (``INF`` beyond the horizon, ``FREE`` for a free slot)
        self.res_next = np.full(cap, FREE, dtype=np.int64)
        #: recency key of each slot's id: ``last use step << 32 | position in that batch's unique ids``
        self.rk = np.zeros(cap, dtype=np.int64)
        #: stack of free slots (the top is ``free[n_free - 1]``)
        self.free = np.arange(cap - 1, -1, -1, dtype=np.int64)
        self.n_free = cap
        #: the step the next :meth:`consume` plans
        self.next_step = 0
        # --- the lookahead window
        #: the read but not yet planned batches, oldest first
        self.recs: Deque[_Record] = collections.deque()
        #: next-occurrence buffer: per unique id of every batch in the window, the step at which it occurs next
        #: (``INF`` until a later batch reads it); the live part is ``occ[lo:hi]``
        self.occ = np.empty(4096, dtype=np.int64)
        #: start of the live part of :attr:`occ` (the oldest unplanned batch's entries)
        self.lo = 0
        #: end of the live part of :attr:`occ`
        self.hi = 0
        #: offset in :attr:`occ` of each window batch's entries, indexed by ``step % ring.size``
        self.ring = np.zeros(self.horizon + 2, dtype=np.int64)
        # --- the LRU queue: (slot, id, rk) in ascending rk; an entry whose slot no longer holds that id with that
        # rk is stale and skipped when popped (lazy deletion)
        #: slots of the queue's compacted part
        self.q_slot = _EMPTY
        #: ids of the queue's compacted part
        self.q_id = _EMPTY
        #: recency keys of the queue's compacted part
        self.q_rk = _EMPTY
        #: first live entry of the compacted part
        self.q_head = 0
        #: entries appended since the last compaction, merged in on the next pop
        self.q_pending: List[Tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        #: entries in the queue, stale ones included (compacted when it grows past ``2 x capacity + 65536``)
        self.q_len = 0
        # Without a table size, a table is planned as direct mapped while every id read fits in its capacity
        # (``provisional``); the first larger id converts it to the fixed-capacity planner (``_leave_direct``).
        self.provisional = self.supports_direct and self.rows is None and self.num_ranks == 1
        self.direct = self.provisional or (
            self.supports_direct
            and self.rows is not None
            and self.rows <= self.capacity
            and self.num_ranks == 1
        )
        self.stats: Dict[str, int] = dict(
            steps=0, lookups=0, unique=0, hits=0, fetches=0, evictions=0, peak_rows=0
        )

    # ------------------------------------------------------------------ ids
    def arange(self, n: int) -> np.ndarray:
        if n > self._arange.size:
            self._arange = np.arange(max(n, 2 * self._arange.size), dtype=np.int32)
        return self._arange[:n]

    def check_ids(self, ids: np.ndarray, step: int) -> None:
        """Refuse negative or out-of-range ids; grow the per-id arrays when the table size is unknown."""
        high = check_range(self.name, ids, step, self.rows)
        if high < 0:
            return
        if high >= self.slot_of.size:
            self._grow(high + 1)
        if self.provisional and high >= self.capacity:
            self._leave_direct()

    def _grow(self, n: int) -> None:
        # geometric (at least doubling, so a stream whose largest id creeps up reallocates O(log n) times), with
        # a quarter to spare past the largest id: hashed ids reach near the table's end in the first batches
        n = max(n + (n >> 2), 2 * self.slot_of.size)
        old = self.slot_of.size

        def grown(arr: np.ndarray) -> np.ndarray:
            new = np.full(n, -1, dtype=arr.dtype)
            new[:old] = arr
            return new

        self.slot_of, self.last_occ, self.scratch = (
            grown(self.slot_of),
            grown(self.last_occ),
            grown(self.scratch),
        )

    def dedup(self, ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Unique ids in order of first occurrence, and the index of each input id among them."""
        uniq, inv, _ = self.dedup_first(ids)
        return uniq, inv

    def dedup_first(self, ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`dedup`, and the position in ``ids`` of each unique id's first occurrence (ascending)."""
        n = ids.size
        pos = self.arange(n)
        scratch = self.scratch
        scratch[ids[::-1]] = pos[::-1]
        first = np.flatnonzero(scratch[ids] == pos)
        uniq = ids[first]
        scratch[uniq] = self.arange(uniq.size)
        return uniq, scratch[ids], first

    def _leave_direct(self) -> None:
        """A provisionally direct-mapped table read an id beyond its capacity: plan it by the policy from now on.

        The resident rows stay where they are (slot = id); the free list, the next uses and the recency queue
        are rebuilt, and the batches in the lookahead window are read again by the policy's path.
        """
        self.provisional = self.direct = False
        empty = self.id_of_slot < 0
        self.free = np.flatnonzero(empty)[::-1].copy()
        self.n_free = self.free.size
        self.free = np.concatenate([self.free, np.zeros(self.capacity - self.n_free, dtype=np.int64)])
        self.res_next[:] = INF
        self.res_next[empty] = FREE
        self.rebuild_queue()
        window = list(self.recs)
        self.recs.clear()
        self.lo = self.hi = 0
        for rec in window:
            self.push(rec.step, rec.uniq, None, None)

    # ------------------------------------------------------------ lookahead
    def push(
        self, step: int, ids: np.ndarray, samples: Optional[np.ndarray], batch_size: Optional[int]
    ) -> None:
        """Read batch ``step`` of this table into the lookahead window."""
        self.push_pieces(step, [(ids, None)], samples, batch_size)

    def push_pieces(
        self,
        step: int,
        pieces: Sequence[Tuple[np.ndarray, Optional[np.ndarray]]],
        samples: Optional[np.ndarray],
        batch_size: Optional[int],
        fanout: Fanout = serial_map,
    ) -> List[int]:
        """Read batch ``step``, the concatenation of the ids of ``pieces``, into the lookahead window.

        A piece is ``(ids, cuts)``: the id ranges of the pieces are disjoint and increasing (groups of a shared
        slot space's members); ``cuts`` (or ``None``) splits a piece's ids into parts (its members) whose unique
        ids are counted apart. The per-id work of a piece (unique ids, last occurrences, next uses) touches its
        own part of the per-id arrays, so ``fanout`` may run the pieces on several threads; the result does not
        depend on it.

        Returns:
            The number of unique ids of each part, piece after piece (of each id, for a direct-mapped table).
        """
        if self.direct:
            ids = pieces[0][0] if len(pieces) == 1 else np.concatenate([p for p, _ in pieces])
            self.recs.append(_Record(step, ids, _EMPTY, _EMPTY, None))
            return [int(n) for p, cuts in pieces for n in (np.diff(cuts) if cuts is not None else [p.size])]
        self.arange(max(int(p.size) for p, _ in pieces))  # grown here, never inside the fan-out
        got = fanout(self._read_piece, pieces)
        counts = [int(u.size) for u, _, _ in got]
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        n = int(starts[-1])
        # the buffer may move when it grows: before the earlier batches' entries are written
        base = self._alloc(n)
        self.ring[step % self.ring.size] = base
        marked = fanout(self._mark, [(step, u, i, int(a)) for (u, i, _), a in zip(got, starts)])
        if len(got) == 1:
            uniq, (inv, prev_step, changed) = got[0][0], marked[0]
        else:
            uniq = np.concatenate([u for u, _, _ in got])
            inv, prev_step, changed = (np.concatenate([m[k] for m in marked]) for k in range(3))
        if self.track_next and changed.size:
            self.note_next_changed(changed)
        ranks = readers(inv, samples, batch_size, n, self.num_ranks) if self.num_ranks > 1 else None
        self.recs.append(_Record(step, uniq, inv, prev_step, ranks))
        if self.fixed_capacity:
            self._check_window(step)
        return [c for _, _, parts in got for c in parts]

    def _read_piece(
        self, piece: Tuple[np.ndarray, Optional[np.ndarray]]
    ) -> Tuple[np.ndarray, np.ndarray, List[int]]:
        """The unique ids of a piece, the index of each of its ids among them, and each part's unique count."""
        ids, cuts = piece
        uniq, inv, first = self.dedup_first(ids)
        parts = [int(uniq.size)] if cuts is None else np.diff(np.searchsorted(first, cuts)).tolist()
        return uniq, inv, parts

    def _mark(
        self, job: Tuple[int, np.ndarray, np.ndarray, int]
    ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Record the unique ids ``uniq`` of batch ``step`` (positions from ``start`` on among the batch's unique
        ids) as their ids' last occurrence, point their previous occurrences in the window at ``step``, and give
        resident ids with no known next use this step. Returns the index ``inv`` among the batch's unique ids,
        the steps of the previous occurrences, and the slots given this step."""
        step, uniq, inv, start = job
        n = uniq.size
        if start:
            inv = inv + np.int64(start)
        prev = self.last_occ[uniq]
        self.last_occ[uniq] = (np.int64(step) << np.int64(32)) | (
            self.arange(n) + np.int64(start) if start else self.arange(n)
        )
        prev_step = prev >> np.int64(32)
        inw = np.flatnonzero(prev_step >= self.next_step)
        if inw.size:
            p = prev[inw]
            self.occ[self.ring[prev_step[inw] % self.ring.size] + (p & _LOW32)] = step
        if not (self.track_next and n):
            return inv, prev_step, _EMPTY
        slots = self.slot_of[uniq]
        slots = slots[slots >= 0]
        slots = slots[self.res_next[slots] == INF]
        self.res_next[slots] = step
        return inv, prev_step, slots

    def _alloc(self, n: int) -> int:
        if self.hi + n > self.occ.size:
            live = self.hi - self.lo
            if live + n <= self.occ.size // 2:  # shift in place: fresh memory costs page faults
                self.occ[:live] = self.occ[self.lo : self.hi].copy()
            else:  # twice what is live: a shift every horizon or so, and half the memory of more room
                new = np.empty(2 * (live + n), dtype=np.int64)
                new[:live] = self.occ[self.lo : self.hi]
                self.occ = new
            self.ring -= self.lo
            self.hi, self.lo = live, 0
        base = self.hi
        self.occ[base : base + n] = INF
        self.hi += n
        return base

    def _check_window(self, step: int) -> None:
        first = max(step - self.depth, 0)  # at the start of the stream the window is shorter
        recs = [r for r in list(self.recs)[-(self.depth + 1) :] if r.step >= first]
        need = sum(int(np.count_nonzero(r.prev_step < first)) for r in recs)
        if need > self.capacity:
            lo = recs[0].step
            raise CapacityError(
                f"table {self.name!r}: {describe_window(lo, step, self.depth)} need{'s' if lo == step else ''} "
                f"{need} cache rows but capacity[{self.name!r}] is {self.capacity}; raise "
                f"capacity[{self.name!r}] to at least {need}, lower prefetch_depth, or use smaller batches",
                table=self.name,
                batch=step,
                needed=need,
                available=self.capacity,
            )

    def consume(self) -> Tuple[_Record, np.ndarray]:
        """Pop the oldest window batch; returns it and the next-use step of each of its unique ids."""
        rec = self.recs.popleft()
        n = rec.uniq.size
        base = int(self.ring[rec.step % self.ring.size])
        next_use = self.occ[base : base + n].copy()
        self.lo = base + n
        return rec, next_use

    # ---------------------------------------------------------------- slots
    def pop_free(self, k: int) -> np.ndarray:
        out = self.free[self.n_free - k : self.n_free][::-1].copy()
        self.n_free -= k
        return out

    def push_free(self, slots: np.ndarray) -> None:
        k = slots.size
        self.free[self.n_free : self.n_free + k] = slots[::-1]
        self.n_free += k

    def evict(self, slots: np.ndarray) -> np.ndarray:
        """Free ``slots``; returns the ids they held."""
        ids = self.id_of_slot[slots]
        self.slot_of[ids] = -1
        self.id_of_slot[slots] = -1
        self.res_next[slots] = FREE
        self.push_free(slots)
        return ids

    def place(self, ids: np.ndarray, slots: np.ndarray) -> None:
        self.slot_of[ids] = slots
        self.id_of_slot[slots] = ids

    # ---------------------------------------------------------------- queue
    def q_append(self, slots: np.ndarray, ids: np.ndarray, rks: np.ndarray) -> None:
        if slots.size:
            self.q_pending.append((slots, ids, rks))
            self.q_len += slots.size
        if self.q_len > 2 * self.capacity + 65536:
            self._q_consolidate()
            keep = np.flatnonzero(
                (self.id_of_slot[self.q_slot] == self.q_id) & (self.rk[self.q_slot] == self.q_rk)
            )
            self.q_slot, self.q_id, self.q_rk = self.q_slot[keep], self.q_id[keep], self.q_rk[keep]
            self.q_len = keep.size

    def _q_consolidate(self) -> None:
        h = self.q_head
        parts = [(self.q_slot[h:], self.q_id[h:], self.q_rk[h:])] + self.q_pending
        self.q_slot = np.concatenate([p[0] for p in parts])
        self.q_id = np.concatenate([p[1] for p in parts])
        self.q_rk = np.concatenate([p[2] for p in parts])
        self.q_head = 0
        self.q_pending = []

    def q_pop(
        self, need: int, valid: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
    ) -> np.ndarray:
        """Take the first ``need`` entries that pass ``valid``; entries skipped on the way are dropped."""
        out: List[np.ndarray] = []
        while need > 0:
            if self.q_head >= self.q_slot.size:
                if not self.q_pending:
                    break
                self._q_consolidate()
            h = self.q_head
            end = min(self.q_slot.size, h + max(2 * need, 1024))
            s = self.q_slot[h:end]
            ok = np.flatnonzero(valid(s, self.q_id[h:end], self.q_rk[h:end]))
            if ok.size >= need:
                take = ok[:need]
                out.append(s[take])
                self.q_head = h + int(take[-1]) + 1
                self.q_len -= int(take[-1]) + 1
                need = 0
            else:
                out.append(s[ok])
                need -= ok.size
                self.q_len -= end - h
                self.q_head = end
        return np.concatenate(out) if out else _EMPTY

    def rebuild_queue(self) -> None:
        res = np.flatnonzero(self.id_of_slot >= 0)
        res = res[np.argsort(self.rk[res], kind="stable")]
        self.q_slot, self.q_id, self.q_rk = res, self.id_of_slot[res], self.rk[res]
        self.q_head, self.q_pending, self.q_len = 0, [], res.size

    # ----------------------------------------------------------------- plan
    def plan_direct(self) -> TablePlan:
        """A table that fits: fetch ids on first use into slot = id, never evict (uniques are not counted)."""
        t = self.next_step
        rec = self.recs.popleft()
        ids = rec.uniq
        st = self.stats
        if self.provisional:
            # keep the recency of every id, as the policy's path does, in case the table leaves direct mapping
            uniq = self.dedup(ids)[0]
            miss = np.flatnonzero(self.slot_of[uniq] < 0)
            fetch = uniq[miss]
            self.note_use(t, uniq, miss)  # slot = id
            self.rk[uniq] = (np.int64(t) << np.int64(32)) | self.arange(uniq.size)
            st["unique"] += uniq.size
            st["hits"] += uniq.size - fetch.size
        else:
            new = np.flatnonzero(self.slot_of[ids] < 0)
            fetch = self.dedup(ids[new])[0] if new.size else _EMPTY
            self.rk[fetch] = (np.int64(t) << np.int64(32)) | self.arange(fetch.size)
        self.place(fetch, fetch)
        self.n_free -= fetch.size
        st["steps"] += 1
        st["lookups"] += ids.size
        st["fetches"] += fetch.size
        st["peak_rows"] = max(st["peak_rows"], self.resident_rows())
        self.next_step = t + 1
        return TablePlan(
            evict_ids=_tensor(_EMPTY),
            evict_slots=_tensor(_EMPTY),
            fetch_ids=_tensor(fetch),
            fetch_slots=_tensor(fetch.copy()),
            slots=_tensor(ids.copy()),
        )

    def plan(self) -> TablePlan:
        """Plan the oldest window batch (a fixed-capacity policy: belady or lru)."""
        if self.direct:
            return self.plan_direct()
        t = self.next_step
        rec, next_use = self.consume()
        uniq = rec.uniq
        n = uniq.size
        slots = self.slot_of[uniq]
        miss = np.flatnonzero(slots < 0)
        m = miss.size
        ev_slots, ev_ids = _EMPTY, _EMPTY
        if m > self.n_free:
            ev_slots = self.victims(t, m - self.n_free)
            ev_ids = self.evict(ev_slots)
        fetch_ids = uniq[miss]
        fetch_slots = self.pop_free(m)
        self.place(fetch_ids, fetch_slots)
        slots[miss] = fetch_slots
        self.res_next[slots] = next_use
        self.note_use(t, slots, miss)
        rks = (np.int64(t) << np.int64(32)) | self.arange(n)
        self.rk[slots] = rks
        self.after_step(slots, uniq, rks, next_use)
        return self.finish_plan(t, rec, next_use, slots, ev_ids, ev_slots, fetch_ids, fetch_slots)

    def victims(self, t: int, need: int) -> np.ndarray:
        """Choose ``need`` resident slots to evict at step ``t``; the policy's rule."""
        raise NotImplementedError

    def note_next_changed(self, slots: np.ndarray) -> None:
        """Policy hook: the next use of these resident slots became finite or changed."""

    def note_use(self, t: int, slots: np.ndarray, miss: np.ndarray) -> None:
        """Policy hook: step ``t`` reads ``slots`` (its unique ids' slots; ``miss`` indexes those fetched for
        it), before their recency keys move to ``t``."""

    def after_step(self, slots: np.ndarray, uniq: np.ndarray, rks: np.ndarray, next_use: np.ndarray) -> None:
        """Policy hook after the batch's ids were placed (queue bookkeeping): ``slots`` of its unique ids
        ``uniq``, their new recency keys ``rks`` and the step of their next use ``next_use``."""

    def finish_plan(
        self,
        t: int,
        rec: _Record,
        next_use: np.ndarray,
        slots: np.ndarray,
        ev_ids: np.ndarray,
        ev_slots: np.ndarray,
        fetch_ids: np.ndarray,
        fetch_slots: np.ndarray,
    ) -> TablePlan:
        st = self.stats
        n = rec.uniq.size
        st["steps"] += 1
        st["lookups"] += rec.inv.size
        st["unique"] += n
        st["hits"] += n - fetch_ids.size
        st["fetches"] += fetch_ids.size
        st["evictions"] += ev_ids.size
        st["peak_rows"] = max(st["peak_rows"], self.resident_rows())
        self.next_step = t + 1
        # With horizon 0, step t is planned before batch t + 1 is read: its next uses are unknown.
        ranks = (
            annotate(rec.uniq, rec.ranks, next_use, t, next_known=self.horizon >= 1)
            if rec.ranks is not None
            else None
        )
        return TablePlan(
            evict_ids=_tensor(ev_ids),
            evict_slots=_tensor(ev_slots),
            fetch_ids=_tensor(fetch_ids),
            fetch_slots=_tensor(fetch_slots),
            slots=_tensor(slots[rec.inv]),
            ranks=ranks,
        )

    def resident_rows(self) -> int:
        return self.capacity - self.n_free

    # ---------------------------------------------------------------- state
    def state_dict(self) -> Dict[str, Any]:
        """Committed state after the last planned step (the lookahead window is not part of it)."""
        return {
            "policy": self.policy_name,
            "capacity": self.capacity,
            "next_step": self.next_step,
            "id_of_slot": torch.from_numpy(self.id_of_slot.copy()),
            "rk": torch.from_numpy(self.rk.copy()),
            "free": torch.from_numpy(self._free_slots()),
            "stats": dict(self.stats),
        }

    def _free_slots(self) -> np.ndarray:
        if self.direct:  # direct mapping does not keep the free list: the empty slots, in pop order
            return np.flatnonzero(self.id_of_slot < 0)[::-1].copy()
        return self.free[: self.n_free].copy()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the lookahead window starts empty at ``next_step``."""
        self.next_step = int(state["next_step"])
        self.id_of_slot = state["id_of_slot"].numpy().astype(np.int64).copy()
        self.rk = state["rk"].numpy().astype(np.int64).copy()
        free = state["free"].numpy().astype(np.int64)
        self.free = np.zeros(self.capacity, dtype=np.int64)
        self.free[: free.size] = free
        self.n_free = free.size
        self.stats = {k: int(v) for k, v in state["stats"].items()}
        res = np.flatnonzero(self.id_of_slot >= 0)
        ids = self.id_of_slot[res]
        self.slot_of[:] = -1
        self.last_occ[:] = -1
        self.recs.clear()
        if self.provisional and not np.array_equal(ids, res):  # saved by the policy's path: stay on it
            self.provisional = self.direct = False
        if ids.size:
            self.check_ids(ids, self.next_step)
            self.slot_of[ids] = res
        self.res_next[:] = FREE
        self.res_next[res] = INF
        if self.direct:
            self.n_free = self.capacity - res.size
        self.recs.clear()
        self.lo = self.hi = 0
        self.rebuild_queue()
