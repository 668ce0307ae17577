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

from typing import Any, Dict, List

import numpy as np
import torch

from torchrec_lookahead.errors import CapacityError
from torchrec_lookahead.oracle._table import _EMPTY, INF, _TablePlanner
from torchrec_lookahead.oracle.types import TablePlan

__all__: List[str] = ["TTLPlanner"]


class TTLPlanner(_TablePlanner):
    """Per-table TTL planner."""

    policy_name = "ttl"
    fixed_capacity = False
    track_next = False
    supports_direct = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pending = _EMPTY

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
