"""Least recently used with ``prefetch_depth`` batches of prefetch: the comparison baseline.

This is what FBGEMM's cache does (evict the least recently used row on a miss, rows of the batch being
prefetched are locked). Ids of the current batch and of the next ``prefetch_depth`` batches are never
evicted; among the others the least recently used goes first (ties: position among the unique ids of the
batch that last used them, in order of first occurrence).

Example:
    >>> import torch
    >>> from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig
    >>> oracle = LookaheadOracle(OracleConfig(capacity={"t": 3}, horizon=4, prefetch_depth=0, policy="lru"))
    >>> batches = [{"t": torch.tensor(b)} for b in ([1, 2, 3], [4, 1], [2, 5], [1])]
    >>> [p.tables["t"].evict_ids.tolist() for p in oracle.plan_stream(batches)]
    [[], [2], [3, 4], []]
"""

from __future__ import annotations

from typing import List

import numpy as np

from torchrec_lookahead.errors import CapacityError
from torchrec_lookahead.oracle._table import _TablePlanner

__all__: List[str] = ["LRUPlanner"]


class LRUPlanner(_TablePlanner):
    """Per-table LRU planner."""

    policy_name = "lru"

    def victims(self, t: int, need: int) -> np.ndarray:
        """The ``need`` least recently used resident slots not needed within ``prefetch_depth`` steps.

        Args:
            t: the planned step.
            need: how many slots to free.

        Returns:
            (need,) slots.

        Raises:
            CapacityError: fewer evictable ids than ``need``.
        """
        id_of_slot, rk, res_next = self.id_of_slot, self.rk, self.res_next
        limit = t + self.depth
        out = self.q_pop(need, lambda s, i, r: (id_of_slot[s] == i) & (rk[s] == r) & (res_next[s] > limit))
        if out.size < need:
            raise CapacityError(
                f"table {self.name!r}: step {t} needs {need} evictable rows but only {out.size} are not needed "
                f"within prefetch_depth={self.depth}; raise capacity[{self.name!r}]",
                table=self.name,
                batch=t,
                needed=int(need),
                available=int(out.size),
            )
        return out

    def after_step(self, slots: np.ndarray, uniq: np.ndarray, rks: np.ndarray, next_use: np.ndarray) -> None:
        """Every id of the batch becomes the most recently used, in order of first occurrence."""
        self.q_append(slots, uniq, rks)
