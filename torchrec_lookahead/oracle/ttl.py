"""Bagpipe's oracle cacher (Algorithm 1): keep an id iff it is used again within the horizon.

After step ``t`` an id of batch ``t`` stays cached when its next use is at most ``t + horizon``; otherwise it
is written back by the plan of step ``t + 1`` (before that step runs), whose fetches can reuse the freed
slots. There is no replacement decision, so the cache holds what the stream needs: ``stats()['t']
['peak_rows']`` reports the most rows ever resident, and the configured capacity is an upper bound
(:class:`~torchrec_lookahead.errors.CapacityError` when a step would need more).

Bagpipe's Figure 6 (horizon 2):

    >>> import torch
    >>> from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig
    >>> oracle = LookaheadOracle(OracleConfig(capacity={"t": 8}, horizon=2, policy="ttl"))
    >>> batches = [{"t": torch.tensor(b)} for b in ([3, 9], [3, 4], [3, 6], [6, 1])]
    >>> [sorted(p.tables["t"].fetch_ids.tolist()) for p in oracle.plan_stream(batches)]
    [[3, 9], [4], [6], [1]]
    >>> oracle.stats()["t"]["peak_rows"]
    2
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from torchrec_lookahead.errors import CapacityError
from torchrec_lookahead.oracle._table import _EMPTY, FREE, INF, _TablePlanner
from torchrec_lookahead.oracle.types import TablePlan

__all__: List[str] = ["TTLPlanner", "Shortfall"]


@dataclass(frozen=True)
class Shortfall:
    """What a ``ttl`` cache held beyond its capacity over a stream measured with
    :meth:`LookaheadOracle.measure <torchrec_lookahead.oracle.LookaheadOracle.measure>`: the policy has no
    replacement decision, so the rows it holds do not depend on the capacity, and the largest is the capacity
    the stream needs.

    Attributes:
        capacity: the configured capacity (rows).
        first_batch: the first batch at which the cache held more rows than ``capacity``.
        first_need: the rows held at ``first_batch``.
        peak: the most rows held over the stream.
        peak_batch: the first batch at which ``peak`` rows were held.
        horizon: the policy's horizon.
    """

    capacity: int
    first_batch: int
    first_need: int
    peak: int
    peak_batch: int
    horizon: int


class TTLPlanner(_TablePlanner):
    """Per-table TTL planner."""

    policy_name = "ttl"
    fixed_capacity = False
    track_next = False
    supports_direct = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pending = _EMPTY
        #: measuring (:meth:`measure`): the configured capacity, which the cache grows past instead of refusing
        self.limit: Optional[int] = None
        #: measuring: (batch, rows held) the first time past ``limit``, and the most rows held, at its batch
        self.first_short: Optional[Tuple[int, int]] = None
        self.peak: Tuple[int, int] = (0, 0)

    def measure(self) -> None:
        """Grow the cache when a step needs more rows than its capacity instead of refusing, recording the
        shortfall (:meth:`shortfall`): the capacity pre-scan's reading of what the whole stream needs."""
        self.limit = self.capacity

    def shortfall(self) -> Optional[Shortfall]:
        """What the cache held beyond its configured capacity while measuring; ``None`` if it never did."""
        if self.limit is None or self.first_short is None:
            return None
        return Shortfall(self.limit, *self.first_short, self.peak[0], self.peak[1], self.horizon)

    def _add_slots(self, need: int) -> None:
        """Give the cache at least ``need`` slots (the new ones free), at least doubling it."""
        old = self.capacity
        cap = max(need, 2 * old)
        if self.rows is not None:
            cap = max(need, min(cap, self.rows))
        more = cap - old
        self.id_of_slot = np.concatenate([self.id_of_slot, np.full(more, -1, dtype=np.int64)])
        self.res_next = np.concatenate([self.res_next, np.full(more, FREE, dtype=np.int64)])
        self.rk = np.concatenate([self.rk, np.zeros(more, dtype=np.int64)])
        free = np.arange(cap - 1, old - 1, -1, dtype=np.int64)
        self.free = np.concatenate(
            [free, self.free[: self.n_free], np.zeros(old - self.n_free, dtype=np.int64)]
        )
        self.n_free += more
        self.capacity = cap

    def plan(self) -> TablePlan:
        """Evict the ids whose last use in the horizon was the previous step, then fetch this step's misses.

        Returns:
            The table plan.

        Raises:
            CapacityError: the step needs more rows than the configured capacity.
        """
        t = self.next_step
        ev_slots = self.pending
        ev_ids = self.evict(ev_slots) if ev_slots.size else _EMPTY
        rec, next_use = self.consume()
        uniq = rec.uniq
        slots = self.slot_of[uniq]
        miss = np.flatnonzero(slots < 0)
        if miss.size > self.n_free and self.limit is not None:
            self._add_slots(self.capacity - self.n_free + miss.size)
        if miss.size > self.n_free:
            need = self.capacity - self.n_free + miss.size
            raise CapacityError(
                f"table {self.name!r}: policy 'ttl' needs {need} cache rows at batch {t} (horizon "
                f"{self.horizon}) but capacity[{self.name!r}] is {self.capacity}; raise capacity[{self.name!r}] "
                "or lower the horizon",
                table=self.name,
                batch=t,
                needed=need,
                available=self.capacity,
            )
        fetch_ids = uniq[miss]
        fetch_slots = self.pop_free(miss.size)
        self.place(fetch_ids, fetch_slots)
        slots[miss] = fetch_slots
        if self.limit is not None:
            held = self.capacity - self.n_free
            if held > self.limit and self.first_short is None:
                self.first_short = (t, held)
            if held > self.peak[0]:
                self.peak = (held, t)
        self.pending = slots[next_use == INF]
        return self.finish_plan(t, rec, next_use, slots, ev_ids, ev_slots, fetch_ids, fetch_slots)

    def state_dict(self) -> Dict[str, Any]:
        """Base state plus the slots to write back at the next step."""
        state = super().state_dict()
        state["pending"] = torch.from_numpy(self.pending.copy())
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        super().load_state_dict(state)
        self.pending = state["pending"].numpy().astype(np.int64).copy()
