"""cDLRM's window cache: every ``window`` batches, place the next window's ids in a set-associative cache.

At a window boundary (steps ``0, L, 2L, ...`` with ``L = window``) the oracle takes ``W``, the unique ids of
batches ``t .. t+L-1`` (in order of first occurrence) and pins, for the window, every resident id of batches
``t .. t + max(L, prefetch_depth + 1) - 1``. Then:

* a table whose rows fit in its capacity (``num_embeddings <= capacity``) is direct mapped: slot = id, the
  window's missing ids are fetched and nothing is ever evicted;
* otherwise slots ``[0, S * ways)`` form ``S`` sets of ``ways`` ways (``S`` the largest prime with
  ``S * ways <= capacity - victim_rows``, see :meth:`OracleConfig.num_sets`) and the remaining rows are
  victim rows. Id ``j`` belongs to set ``j % S``. Unpinned victim rows are written back. For each set, the
  set's missing ids (in ``W`` order) take its free ways first (lowest way first), then its unpinned
  occupied ways in increasing order of a uniform random key drawn per window (``rng.random((S, ways))``
  from ``numpy.random.Generator(PCG64([seed, crc32(table)]))``), whose occupants are written back; ids that
  find no way (conflict victims) go to the free victim rows, lowest first.

Between boundaries plans fetch and evict nothing. A window needing more victim rows than are free raises
:class:`~torchrec_lookahead.errors.CapacityError`.

Example:
    >>> import torch
    >>> from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig
    >>> cfg = OracleConfig(capacity={"t": 16}, num_embeddings={"t": 100}, horizon=2, window=2, ways=2,
    ...                    policy="window")
    >>> oracle = LookaheadOracle(cfg)
    >>> plans = list(oracle.plan_stream([{"t": torch.tensor(b)} for b in ([1, 2], [3], [1, 4], [5])]))
    >>> [len(p.tables["t"].fetch_ids) for p in plans]
    [3, 0, 2, 0]
"""

from __future__ import annotations

import zlib
from typing import Any, Dict, List

import numpy as np

from torchrec_lookahead.errors import CapacityError
from torchrec_lookahead.oracle._table import _EMPTY, _TablePlanner
from torchrec_lookahead.oracle.config import OracleConfig
from torchrec_lookahead.oracle.types import TablePlan

__all__: List[str] = ["WindowPlanner", "window_rng"]


def window_rng(seed: int, table: str) -> np.random.Generator:
    """The random generator of the window policy for one table.

    Args:
        seed: ``OracleConfig.seed``.
        table: table name.

    Returns:
        A fresh generator.
    """
    return np.random.Generator(np.random.PCG64([seed, zlib.crc32(table.encode())]))


class WindowPlanner(_TablePlanner):
    """Per-table cDLRM window planner."""

    policy_name = "window"
    fixed_capacity = False
    track_next = False
    supports_direct = False

    def __init__(self, name: str, config: OracleConfig) -> None:
        super().__init__(name, config)
        self.window = config.window
        self.pin_span = max(config.window, config.prefetch_depth + 1)
        self.direct_window = config.direct_mapped(name)
        self.sets = config.num_sets(name)
        self.ways = config.ways
        self.victim_hint = (
            " or victim_rows" if config.victim_rows is not None else " (an eighth of it are victim rows)"
        )
        self.rng = window_rng(config.seed, name)
        self.n_resident = 0

    def resident_rows(self) -> int:
        return self.n_resident

    def _union(self, count: int) -> np.ndarray:
        recs = list(self.recs)[:count]
        if not recs:
            return _EMPTY
        return self.dedup(np.concatenate([r.uniq for r in recs]))[0]

    def _boundary(self, t: int) -> tuple:
        win = self._union(self.window)
        pin_ids = self._union(self.pin_span)
        miss = win[self.slot_of[win] < 0]
        if self.direct_window:
            return _EMPTY, _EMPTY, miss, miss.copy()
        cap, ways, sets = self.capacity, self.ways, self.sets
        sw = sets * ways
        pinned = np.zeros(cap, dtype=bool)
        ps = self.slot_of[pin_ids]
        pinned[ps[ps >= 0]] = True
        occupied = self.id_of_slot >= 0
        ev_victim = sw + np.flatnonzero(occupied[sw:] & ~pinned[sw:])
        occ = occupied[:sw].reshape(sets, ways)
        pin = pinned[:sw].reshape(sets, ways)
        key = np.where(occ, np.where(pin, 2.0, self.rng.random((sets, ways))), -1.0)
        order = np.argsort(key, axis=1, kind="stable")
        avail = ways - pin.sum(axis=1)
        set_of = miss % sets
        o = np.argsort(set_of, kind="stable")
        ms, ss = miss[o], set_of[o]
        rank = np.arange(ms.size) - np.searchsorted(ss, ss, side="left")
        ok = rank < avail[ss]
        set_slots = ss[ok] * ways + order[ss[ok], rank[ok]]
        displaced = set_slots[occupied[set_slots]]
        ev_slots = np.concatenate([ev_victim, displaced])
        ev_ids = self.id_of_slot[ev_slots]
        self.slot_of[ev_ids] = -1
        self.id_of_slot[ev_slots] = -1
        over = ms[~ok]
        free_victim = sw + np.flatnonzero(self.id_of_slot[sw:] < 0)
        if over.size > free_victim.size:
            raise CapacityError(
                f"table {self.name!r}: the window of batches {t}..{t + self.window - 1} has {over.size} set "
                f"conflicts but {free_victim.size} free victim rows (capacity {cap}, {sets} sets x {ways} ways); "
                f"raise capacity[{self.name!r}]{self.victim_hint}, raise ways, or "
                "lower window (a set-associative cache: policy 'belady' needs no conflict rows)",
                table=self.name,
                batch=t,
                needed=int(over.size),
                available=int(free_victim.size),
            )
        fetch_ids = np.concatenate([ms[ok], over])
        fetch_slots = np.concatenate([set_slots, free_victim[: over.size]])
        return ev_ids, ev_slots, fetch_ids, fetch_slots

    def plan(self) -> TablePlan:
        """Plan one step: the whole window's traffic at a boundary, nothing in between.

        Returns:
            The table plan.

        Raises:
            CapacityError: more set conflicts in a window than free victim rows.
        """
        t = self.next_step
        ev_ids, ev_slots, fetch_ids, fetch_slots = _EMPTY, _EMPTY, _EMPTY, _EMPTY
        if t % self.window == 0:
            ev_ids, ev_slots, fetch_ids, fetch_slots = self._boundary(t)
            self.place(fetch_ids, fetch_slots)
            self.n_resident += fetch_ids.size - ev_ids.size
        rec, next_use = self.consume()
        slots = self.slot_of[rec.uniq]
        return self.finish_plan(t, rec, next_use, slots, ev_ids, ev_slots, fetch_ids, fetch_slots)

    def state_dict(self) -> Dict[str, Any]:
        """Base state plus the random generator's state."""
        state = super().state_dict()
        state["rng"] = self.rng.bit_generator.state
        state["n_resident"] = self.n_resident
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        super().load_state_dict(state)
        self.rng.bit_generator.state = state["rng"]
        self.n_resident = int(state["n_resident"])
