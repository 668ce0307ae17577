"""Private: the planner threads' share of one batch of a slot space: running a function over pieces of the batch,
and (:class:`MemberGroups`) the pieces of a shared space's members."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, List, Optional, Protocol, Sequence, Tuple, TypeVar

import numpy as np

__all__: List[str] = []

_In = TypeVar("_In")
_Out = TypeVar("_Out")


class Fanout(Protocol):
    """Runs a function over items, possibly on several threads, and returns the results in item order."""

    def __call__(self, fn: Callable[[_In], _Out], items: Sequence[_In]) -> List[_Out]: ...


def serial_map(fn: Callable[[_In], _Out], items: Sequence[_In]) -> List[_Out]:
    """The :data:`Fanout` of one thread."""
    return [fn(x) for x in items]


class MemberGroups:
    """A shared space's members in ``threads`` contiguous groups, and the threads that read a batch's groups.

    A group's ids are one contiguous range of the space, so a group is read as one piece (one pass over all its
    members' ids: few large NumPy calls, which release the GIL, rather than many small ones). Groups are cut where
    the members' summed weight (the log of their rows: a large table's random reads cost more) crosses an equal
    share. The caller's thread reads the first group; the plans do not depend on the number of threads.
    """

    def __init__(self, rows: np.ndarray, threads: int) -> None:
        threads = max(1, min(int(threads), rows.size))
        weight = np.cumsum(np.log2(rows.astype(np.float64) + 2.0))
        cuts = np.searchsorted(weight, weight[-1] * np.arange(1, threads) / threads, side="left") + 1
        bounds = sorted({0, rows.size, *(int(c) for c in cuts if 0 < c < rows.size)})
        #: member index ranges ``[a, b)`` of the groups
        self.groups = list(zip(bounds[:-1], bounds[1:]))
        self.pool = (
            ThreadPoolExecutor(len(self.groups) - 1, thread_name_prefix="oracle-space")
            if len(self.groups) > 1
            else None
        )

    def pieces(self, ids: Sequence[np.ndarray]) -> List[Tuple[np.ndarray, Optional[np.ndarray]]]:
        """Each group's ids, concatenated, with the cuts between its members."""
        out: List[Tuple[np.ndarray, Optional[np.ndarray]]] = []
        for a, b in self.groups:
            sizes = [0] + [int(x.size) for x in ids[a:b]]
            out.append((np.concatenate(ids[a:b]), np.cumsum(sizes)))
        return out

    def __call__(self, fn: Callable[[_In], _Out], items: Sequence[_In]) -> List[_Out]:
        if self.pool is None or len(items) < 2:
            return [fn(x) for x in items]
        futures = [self.pool.submit(fn, x) for x in items[1:]]
        try:
            first = fn(items[0])
        finally:
            wait(futures)  # every thread is done with the planner's arrays before anything else touches them
        return [first] + [f.result() for f in futures]
