"""Belady over the lookahead horizon: a fixed-capacity cache that evicts the furthest next use.

On a miss the oracle evicts resident ids in the order

1. ids with no use within the horizon (next use ``INF``): with ``past_horizon="reuse"`` (default) first those not
   read again since they were fetched, least recently used first, then the others by the step their last
   interval between two reads predicts (last read + that interval), furthest first, ties least recently used
   first; with ``past_horizon="lru"`` all of them least recently used first;
2. then ids by next use, furthest first, ties least recently used first;

and never an id whose next use is at most ``step + prefetch_depth`` (the current batch and the batches the
stager is already loading), so a row is never fetched before its write-back landed. "Least recently used"
compares ``(last use step, position of the id among that batch's unique ids in order of first occurrence)``.

Example:
    >>> import torch
    >>> from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig
    >>> oracle = LookaheadOracle(OracleConfig(capacity={"t": 3}, horizon=4, prefetch_depth=0))
    >>> batches = [{"t": torch.tensor(b)} for b in ([1, 2, 3], [4, 1], [2, 5], [1])]
    >>> [p.tables["t"].evict_ids.tolist() for p in oracle.plan_stream(batches)]
    [[], [3], [4], []]

Why the second rule: at horizon 64 a cache row lives longer than the oracle sees, so which of the rows past the
horizon leave decides most of the warm cache's misses. In a skewed stream most rows are read once and never again;
a row read twice has shown how often it comes back.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np
import torch

from torchrec_lookahead.errors import CapacityError
from torchrec_lookahead.oracle._table import INF, _TablePlanner
from torchrec_lookahead.oracle.config import PastHorizon

__all__: List[str] = ["BeladyPlanner"]


def _top(cand: np.ndarray, keys_next: np.ndarray, keys_rk: np.ndarray, k: int) -> np.ndarray:
    """Indices into ``cand`` of its ``k`` best victims: largest next use, then smallest recency key."""
    if cand.size <= k:
        return np.arange(cand.size)
    kth = cand.size - k
    thr = np.partition(keys_next, kth)[kth]
    above = np.flatnonzero(keys_next > thr)
    tie = np.flatnonzero(keys_next == thr)
    tie = tie[np.argsort(keys_rk[tie], kind="stable")[: k - above.size]]
    return np.concatenate([above, tie])


class BeladyPlanner(_TablePlanner):
    """Per-table Belady planner (see the module docstring for the exact eviction order).

    Finite-next-use victims come from a pool: the best ``M`` candidates of the last full scan plus every slot
    whose next use changed since (``arrivals``). Every resident outside pool and arrivals ranks below the
    pool's weakest member ``kappa``, so while at least ``need`` candidates rank at or above ``kappa`` the pool
    gives exactly the victims a full scan would; otherwise the oracle rescans all slots.
    """

    policy_name = "belady"
    #: below this capacity a full scan is cheaper than pool bookkeeping.
    pool_min_capacity = 1 << 16

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._drop_pool()
        self.mark = np.zeros(self.capacity, dtype=np.int64)
        config = args[1] if len(args) > 1 else kwargs["config"]
        #: rank the ids past the horizon by their reuse (``past_horizon="reuse"``), else least recently used
        self.by_reuse = PastHorizon(config.past_horizon) is PastHorizon.REUSE
        #: per slot: its id was read again since it was fetched (``protected``), and then the step its last
        #: interval between two reads predicts for its next read (``predicted``)
        self.protected = np.zeros(self.capacity, dtype=bool)
        self.predicted = np.zeros(self.capacity, dtype=np.int64)

    def _drop_pool(self) -> None:
        self.pool: Optional[np.ndarray] = None
        self.kappa = (0, 0)
        self.arrivals: List[np.ndarray] = []
        self.n_arrivals = 0

    def note_next_changed(self, slots: np.ndarray) -> None:
        """Log slots whose next use became finite or changed (pool bookkeeping)."""
        if self.pool is None or not slots.size:
            return
        self.arrivals.append(slots)
        self.n_arrivals += slots.size
        if self.n_arrivals > self.capacity:
            self._drop_pool()

    def victims(self, t: int, need: int) -> np.ndarray:
        """Slots to evict at step ``t``: ``INF`` ids by recency, then furthest next use.

        Args:
            t: the planned step.
            need: how many slots to free.

        Returns:
            (need,) slots.

        Raises:
            CapacityError: fewer evictable ids than ``need`` (the window check normally raised earlier).
        """
        id_of_slot, rk, res_next, protected = self.id_of_slot, self.rk, self.res_next, self.protected
        out = self.q_pop(
            need,
            lambda s, i, r: (id_of_slot[s] == i) & (rk[s] == r) & (res_next[s] == INF) & ~protected[s],
        )
        if self.by_reuse and out.size < need:  # the protected ids past the horizon: furthest predicted read
            cand = np.flatnonzero((res_next == INF) & protected)
            if cand.size:
                pick = cand[_top(cand, self.predicted[cand], rk[cand], need - out.size)]
                out = np.concatenate([out, pick])
        rest = need - out.size
        if rest <= 0:
            return out
        res_next[out] = -2  # taken, exclude from the candidates below
        limit = t + self.depth
        if self.pool is not None:
            cand = np.concatenate([self.pool] + self.arrivals)
            pos = np.arange(cand.size, dtype=np.int64)
            self.mark[cand[::-1]] = pos[::-1]
            cand = cand[self.mark[cand] == pos]  # drop repeated slots
            nx, rr = res_next[cand], rk[cand]
            kn, kr = self.kappa
            ok = (nx > limit) & (nx < INF) & ((nx > kn) | ((nx == kn) & (rr <= kr)))
            good = np.flatnonzero(ok)
            if good.size >= rest:
                cand, nx, rr = cand[good], nx[good], rr[good]
                pick = _top(cand, nx, rr, rest)
                keep = np.ones(cand.size, dtype=bool)
                keep[pick] = False
                self.pool, self.arrivals, self.n_arrivals = cand[keep], [], 0
                return np.concatenate([out, cand[pick]])
        cand = np.flatnonzero((res_next > limit) & (res_next < INF))
        if cand.size < rest:
            raise CapacityError(
                f"table {self.name!r}: step {t} needs {need} evictable rows but only {out.size + cand.size} are "
                f"not needed within prefetch_depth={self.depth}; raise capacity[{self.name!r}]",
                table=self.name,
                batch=t,
                needed=int(need),
                available=int(out.size + cand.size),
            )
        nx, rr = res_next[cand], rk[cand]
        if self.capacity < self.pool_min_capacity:  # no pool: the victims straight from the scan
            self._drop_pool()
            return np.concatenate([out, cand[_top(cand, nx, rr, rest)]])
        size = min(cand.size, rest + max(4 * rest, self.capacity // 32))
        best = _top(cand, nx, rr, size)
        cand, nx, rr = cand[best], nx[best], rr[best]
        pick = _top(cand, nx, rr, rest)
        keep = np.ones(cand.size, dtype=bool)
        keep[pick] = False
        if keep.any():
            worst = np.flatnonzero(nx == nx.min())
            w = worst[np.argmax(rr[worst])]
            self.pool, self.kappa = cand[keep], (int(nx[w]), int(rr[w]))
            self.arrivals, self.n_arrivals = [], 0
        else:
            self._drop_pool()
        return np.concatenate([out, cand[pick]])

    def note_use(self, t: int, slots: np.ndarray, miss: np.ndarray) -> None:
        """Fetched ids are unprotected; an id read again is protected, its next read predicted at ``t`` plus the
        interval since its last read."""
        if not self.by_reuse:
            return
        # a fetched slot's prediction is never read while it is unprotected, and a later read rewrites it
        self.predicted[slots] = 2 * np.int64(t) - (self.rk[slots] >> np.int64(32))
        self.protected[slots] = True
        self.protected[slots[miss]] = False

    def after_step(self, slots: np.ndarray, uniq: np.ndarray, rks: np.ndarray, next_use: np.ndarray) -> None:
        """Queue the unprotected ids with no use within the horizon; log the others as pool arrivals."""
        beyond = next_use == INF
        idx = np.flatnonzero(beyond & ~self.protected[slots])
        self.q_append(slots[idx], uniq[idx], rks[idx])
        self.note_next_changed(slots[~beyond])

    def rebuild_queue(self) -> None:
        """The recency queue of the unprotected resident ids."""
        super().rebuild_queue()
        keep = np.flatnonzero(~self.protected[self.q_slot])
        self.q_slot, self.q_id, self.q_rk = self.q_slot[keep], self.q_id[keep], self.q_rk[keep]
        self.q_len = keep.size

    def state_dict(self) -> Dict[str, Any]:
        """The base state, and which resident ids are protected with their predicted next reads."""
        state = super().state_dict()
        if self.by_reuse:
            state["protected"] = torch.from_numpy(self.protected.copy())
            state["predicted"] = torch.from_numpy(self.predicted.copy())
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore the base state (a state saved without reuse ranking protects nothing); the victim pool is
        rebuilt on demand."""
        self.protected = np.zeros(self.capacity, dtype=bool)
        self.predicted = np.zeros(self.capacity, dtype=np.int64)
        if self.by_reuse and "protected" in state:
            self.protected = state["protected"].numpy().astype(bool).copy()
            self.predicted = state["predicted"].numpy().astype(np.int64).copy()
        super().load_state_dict(state)
        self._drop_pool()
