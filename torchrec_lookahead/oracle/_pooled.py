"""Private: the oracle's planning units. A unit is one slot space: a table of its own, or several tables that share
one cache (:attr:`OracleConfig.slot_spaces`).

A shared slot space is planned as one virtual table whose ids are the member tables' ids shifted by the rows of
the members before them (FBGEMM's ``cache_hash_size_cumsum`` does the same for its one cache per TBE): the
policy (Belady over the horizon, by default) then chooses victims across the tables, so capacity follows the
stream from table to table. Its plan is split back into one :class:`TablePlan` per member, whose slots are the
space's: two members never hold the same slot after a plan, and a plan's evictions free the slots its fetches
take, whichever member they belong to, so a cache applies every member's write-backs before any member's loads.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple, Type

import numpy as np
import torch

from torchrec_lookahead.errors import CapacityError, ConfigError
from torchrec_lookahead.oracle._fanout import MemberGroups
from torchrec_lookahead.oracle._table import _TablePlanner, check_range
from torchrec_lookahead.oracle.config import OracleConfig
from torchrec_lookahead.oracle.ranks import rank_of_sample
from torchrec_lookahead.oracle.types import RankAnnotation, TablePlan

__all__: List[str] = []

#: Parts of one table in one batch: (ids, sample index per id or None, batch size or None).
Part = Tuple[np.ndarray, Optional[np.ndarray], Optional[int]]

_COUNTED = ("steps", "lookups", "unique", "hits", "fetches", "evictions")


class _Unit:
    """One slot space of the oracle: its planner and the tables it plans."""

    def __init__(self, name: str, tables: Sequence[str], config: OracleConfig, cls: Type[_TablePlanner]):
        self.name = name
        self.tables = tuple(tables)
        self.planner = cls(name, config)

    @property
    def capacity(self) -> int:
        return self.planner.capacity

    def check_ids(self, parts: Dict[str, Part], step: int) -> None:
        self.planner.check_ids(parts[self.name][0], step)

    def push(self, step: int, parts: Dict[str, Part]) -> None:
        self.planner.push(step, *parts[self.name])

    def plan(self) -> Dict[str, TablePlan]:
        return {self.name: self.planner.plan()}

    def stats(self) -> Dict[str, Dict[str, int]]:
        return {self.name: dict(self.planner.stats)}

    def state_dict(self) -> Dict[str, Any]:
        return self.planner.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.planner.load_state_dict(state)


class _SharedUnit(_Unit):
    """Tables sharing one slot space, planned as one virtual table (see the module docstring)."""

    def __init__(
        self,
        name: str,
        tables: Sequence[str],
        config: OracleConfig,
        cls: Type[_TablePlanner],
        threads: int = 1,
    ):
        sizes = config.num_embeddings or {}
        missing = [t for t in tables if t not in sizes]
        if missing:
            raise ConfigError(
                f"slot space {name!r} shares one cache between tables {list(tables)} but num_embeddings does not "
                f"give the rows of {missing}; pass num_embeddings for every table of a shared slot space"
            )
        self.rows = np.array([int(sizes[t]) for t in tables], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.rows)]).astype(np.int64)
        inner = dataclasses.replace(
            config,
            capacity={name: sum(int(config.capacity[t]) for t in tables)},
            num_embeddings={name: int(self.offsets[-1])},
            feature_to_table=None,
            slot_spaces=None,
        )
        super().__init__(name, tables, inner, cls)
        self.num_ranks = config.num_ranks
        self.counters = {t: dict.fromkeys(_COUNTED, 0) for t in self.tables}
        #: per batch in the lookahead window, the number of ids of each member (to split the plan's slots)
        self._lengths: Deque[Tuple[List[int], List[int]]] = collections.deque()
        #: runs the members' per-id work of a batch (unique ids, next uses) on ``threads`` threads
        self.groups = MemberGroups(self.rows, threads)

    def check_ids(self, parts: Dict[str, Part], step: int) -> None:
        for t, rows in zip(self.tables, self.rows):
            check_range(t, parts[t][0], step, int(rows))

    def _too_small(self, err: CapacityError) -> CapacityError:
        """``err`` of the space's planner, in the words of its tables (capacity is set per table)."""
        detail = (
            str(err)
            .split(": ", 1)[-1]
            .split("; raise")[0]
            .replace(f"capacity[{self.name!r}] is", "it holds")
            .replace(f"capacity[{self.name!r}]", "its capacity")
        )
        return CapacityError(
            f"the cache shared by tables {list(self.tables)} (the sum of their capacities, {self.capacity} rows): "
            f"{detail}; raise the capacities of these tables (or the device budget), lower prefetch_depth, or "
            "use smaller batches",
            table=self.name,
            batch=err.batch,
            needed=err.needed,
            available=err.available,
        )

    def push(self, step: int, parts: Dict[str, Part]) -> None:
        try:
            self._push(step, parts)
        except CapacityError as err:
            raise self._too_small(err) from None

    def _push(self, step: int, parts: Dict[str, Part]) -> None:
        got = [parts[t] for t in self.tables]
        # each member's ids were checked (check_ids), so the offset ones lie within the space's sized arrays
        pieces = [p[0] + off for p, off in zip(got, self.offsets[:-1])]
        samples: Optional[np.ndarray] = None
        size: Optional[int] = None
        if (
            self.num_ranks > 1
        ):  # each id's rank from its own table's batch, passed as a sample of a batch of W
            samples = np.concatenate([_ranks(p, self.num_ranks) for p in got])
            size = self.num_ranks
        unique = self.planner.push_pieces(step, self.groups.pieces(pieces), samples, size, self.groups)
        self._lengths.append(([int(p[0].size) for p in got], unique))

    def plan(self) -> Dict[str, TablePlan]:
        # a direct-mapped space keeps a batch's raw ids and counts no unique ids
        count_unique = not self.planner.direct
        lengths, unique = self._lengths.popleft()
        try:
            whole = self.planner.plan()
        except CapacityError as err:
            raise self._too_small(err) from None
        ev_ids, ev_slots = whole.evict_ids.numpy(), whole.evict_slots.numpy()
        fe_ids, fe_slots = whole.fetch_ids.numpy(), whole.fetch_slots.numpy()
        # each member's fetches and evictions in the plan's order (a policy may interleave the members: the window
        # policy lists its fetches set by set)
        members = np.arange(len(self.tables) + 1)
        fe_ids, fe_slots, fe_at = self._by_member(fe_ids, fe_slots, members)
        ev_ids, ev_slots, ev_at = self._by_member(ev_ids, ev_slots, members)
        out: Dict[str, TablePlan] = {}
        start = 0
        for i, t in enumerate(self.tables):
            off, n = self.offsets[i], lengths[i]
            ev, fe = slice(ev_at[i], ev_at[i + 1]), slice(fe_at[i], fe_at[i + 1])
            ranks = None if whole.ranks is None else _member_ranks(whole.ranks, off, self.offsets[i + 1])
            out[t] = TablePlan(
                evict_ids=torch.from_numpy(ev_ids[ev] - off),
                evict_slots=torch.from_numpy(ev_slots[ev]),
                fetch_ids=torch.from_numpy(fe_ids[fe] - off),
                fetch_slots=torch.from_numpy(fe_slots[fe]),
                slots=whole.slots[start : start + n],
                ranks=ranks,
            )
            start += n
            fetches = int(fe_at[i + 1] - fe_at[i])
            c = self.counters[t]
            c["steps"] += 1
            c["lookups"] += n
            c["fetches"] += fetches
            c["evictions"] += int(ev_at[i + 1] - ev_at[i])
            if count_unique:
                c["unique"] += unique[i]
                c["hits"] += unique[i] - fetches
        return out

    def _member(self, ids: np.ndarray) -> np.ndarray:
        """The member table of each virtual id."""
        return np.searchsorted(self.offsets, ids, side="right") - 1

    def _by_member(
        self, ids: np.ndarray, slots: np.ndarray, members: np.ndarray
    ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``ids`` and ``slots`` grouped by member (stably: each member's in the plan's order), and where each
        member's group starts (``members``: ``0 .. len(tables)``)."""
        of = self._member(ids)
        if of.size > 1 and (of[1:] < of[:-1]).any():
            order = np.argsort(of, kind="stable")
            ids, slots, of = ids[order], slots[order], of[order]
        return ids, slots, np.searchsorted(of, members)

    def stats(self) -> Dict[str, Dict[str, int]]:
        peak = int(self.planner.stats["peak_rows"])
        return {t: {**c, "peak_rows": peak} for t, c in self.counters.items()}

    def state_dict(self) -> Dict[str, Any]:
        return {**self.planner.state_dict(), "tables": list(self.tables), "counters": dict(self.counters)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.planner.load_state_dict(state)
        self._lengths.clear()
        self.counters = {t: {k: int(v) for k, v in state["counters"][t].items()} for t in self.tables}


def _ranks(part: Part, num_ranks: int) -> np.ndarray:
    """The rank whose slice of the batch reads each id of one table's part (as :func:`readers` splits it)."""
    ids, samples, size = part
    if samples is None:
        return rank_of_sample(np.arange(ids.size, dtype=np.int64), max(ids.size, 1), num_ranks)
    return rank_of_sample(samples, max(int(size or ids.size), 1), num_ranks)


def _member_ranks(ranks: RankAnnotation, lo: int, hi: int) -> RankAnnotation:
    """The part of a shared space's rank annotation that belongs to the member whose ids are ``[lo, hi)``."""
    ids = ranks.unique_ids
    a, b = int(torch.searchsorted(ids, lo)), int(torch.searchsorted(ids, hi))
    return RankAnnotation(
        unique_ids=ids[a:b] - lo,
        reader_mask=ranks.reader_mask[a:b],
        single_rank=ranks.single_rank[a:b],
        shared_next=ranks.shared_next[a:b],
        shared_delayed=ranks.shared_delayed[a:b],
    )
