"""The lookahead oracle: reads batches ahead and plans, per cached table, what to evict, fetch and where.

Example:
    >>> import torch
    >>> from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig
    >>> oracle = LookaheadOracle(OracleConfig(capacity={"t0": 4}, horizon=3, prefetch_depth=1))
    >>> batches = [{"t0": torch.tensor([1, 2, 1]), "t1": torch.tensor([7])},
    ...            {"t0": torch.tensor([3, 2])}, {"t0": torch.tensor([4, 5])}, {"t0": torch.tensor([1])}]
    >>> for plan in oracle.plan_stream(batches):
    ...     tp = plan.tables["t0"]
    ...     print(plan.step, tp.evict_ids.tolist(), tp.fetch_ids.tolist(), tp.slots.tolist())
    0 [] [1, 2] [0, 1, 0]
    1 [] [3] [2, 1]
    2 [3] [4, 5] [2, 3]
    3 [] [] [0]
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Deque, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Type

import numpy as np

from torchrec_lookahead._arrays import sorted_unique
from torchrec_lookahead.errors import CheckpointError
from torchrec_lookahead.oracle._pooled import _SharedUnit, _Unit
from torchrec_lookahead.oracle._table import _TablePlanner
from torchrec_lookahead.oracle.batch_ids import split_batch
from torchrec_lookahead.oracle.belady import BeladyPlanner
from torchrec_lookahead.oracle.config import OracleConfig, Policy
from torchrec_lookahead.oracle.lru import LRUPlanner
from torchrec_lookahead.oracle.ttl import Shortfall, TTLPlanner
from torchrec_lookahead.oracle.types import BatchPlan, TablePlan
from torchrec_lookahead.oracle.window import WindowPlanner

__all__ = ["LookaheadOracle", "min_capacity", "window_working_sets"]

_PLANNERS: Dict[Policy, Type[_TablePlanner]] = {
    Policy.BELADY: BeladyPlanner,
    Policy.TTL: TTLPlanner,
    Policy.WINDOW: WindowPlanner,
    Policy.LRU: LRUPlanner,
}


class LookaheadOracle:
    """Plans a cache for each table of ``config.capacity`` over a stream of batches.

    A batch is a mapping ``feature -> LongTensor`` of ids (or ``feature -> (ids, lengths)``), or any object
    with ``keys()`` and ``to_dict()`` whose values have ``values()`` (and ``lengths()``), such as a
    ``KeyedJaggedTensor``. Features map to tables through ``config.feature_to_table`` (identity when
    ``None``); the ids of features sharing a table are concatenated in key order, and ``slots`` follows
    that concatenation. Tables absent from ``config.capacity`` are resident and ignored.

    Plans come out in stream order, ``horizon`` batches behind the reader. A plan is applied as: write back
    ``evict_ids`` from ``evict_slots``, load ``fetch_ids`` into ``fetch_slots``, run the step on ``slots``.
    When the stream ends, the rows still cached stay cached: flushing them is the cache's job.

    Resume: :meth:`state_dict` is the state after the last plan handed out (step ``k``); to resume, build an
    oracle with the same config, :meth:`load_state_dict` it, and feed the batches from ``k + 1`` on (that is
    ``state["next_step"]``): the plans are those of the uninterrupted run.

    Args:
        config: the :class:`OracleConfig`.
    """

    def __init__(self, config: OracleConfig) -> None:
        self.config = config
        planner = _PLANNERS[Policy(config.policy)]
        #: the planning units: a table alone, or the tables sharing a slot space
        units = config.units()
        # the planner threads go to the units, or, when one shared slot space is all there is, to its members
        inner = int(config.plan_threads or 1) if len(units) == 1 else 1
        self._units: Dict[str, _Unit] = {
            name: _SharedUnit(name, tables, config, planner, inner)
            if len(tables) > 1
            else _Unit(name, tables, config, planner)
            for name, tables in units.items()
        }
        self._tables = [t for u in self._units.values() for t in u.tables]
        self._read = 0
        self._next = 0
        # units go to the pool largest capacity first (the longest tasks start first); plans are keyed by table
        self._order = sorted(self._units, key=lambda n: -self._units[n].capacity)
        self._pool: Optional[ThreadPoolExecutor] = None

    @property
    def next_step(self) -> int:
        """Index of the next plan to be handed out."""
        return self._next

    def measure(self) -> None:
        """Under the ``ttl`` policy, let each cache grow past its capacity instead of refusing, and record by how
        much (:meth:`shortfalls`): the policy has no replacement decision, so the rows it holds do not depend on
        the capacity, and one pass tells the largest need of the whole stream (the capacity pre-scan's use; the
        plans are not a bounded cache's). Other policies refuse as they plan.

        Example:
            >>> import torch
            >>> oracle = LookaheadOracle(OracleConfig(capacity={"t": 2}, horizon=2, policy="ttl"))
            >>> oracle.measure()
            >>> _ = list(oracle.plan_stream([{"t": torch.tensor(b)} for b in ([1, 2], [3, 1], [4, 5], [1])]))
            >>> short = oracle.shortfalls()["t"]
            >>> short.first_batch, short.first_need, short.peak, short.peak_batch
            (2, 3, 3, 2)
        """
        for unit in self._units.values():
            if isinstance(unit.planner, TTLPlanner):
                unit.planner.measure()

    def shortfalls(self) -> Dict[str, Shortfall]:
        """Per planning unit (a table alone, or a shared slot space by its name) whose cache grew past its
        capacity while measuring (:meth:`measure`), what it held."""
        out = {}
        for name, unit in self._units.items():
            short = unit.planner.shortfall() if isinstance(unit.planner, TTLPlanner) else None
            if short is not None:
                out[name] = short
        return out

    def feed(self, batch: Any) -> List[BatchPlan]:
        """Read one batch; returns the plans that became ready (at most one).

        Args:
            batch: the batch (see the class docstring).

        Returns:
            Plans now complete, in step order.

        Raises:
            InvalidIdError: a negative or out-of-range id.
            CapacityError: a prefetch window does not fit in a table's capacity.
            ConfigError: a planned table missing from the batch, an unknown feature.
            DataError: malformed ids or lengths.
        """
        names = sorted(self._tables)
        parts = split_batch(
            batch,
            names,
            self.config.feature_to_table,
            self.config.num_ranks > 1,
            self.config.unknown_features,
        )
        step = self._read
        ready = max(0, step + 1 - self._next - self.config.horizon)
        out = self._advance(ready, parts, step)
        self._read += 1
        return out

    def finish(self) -> List[BatchPlan]:
        """The stream ended: plan every batch still in the lookahead window.

        Returns:
            The remaining plans, in step order.
        """
        out = []
        while self._next < self._read:
            out.extend(self._advance(1))
        return out

    def plan_stream(self, batches: Iterable[Any]) -> Iterator[BatchPlan]:
        """Plan a stream of batches, reading up to ``horizon`` batches ahead.

        Args:
            batches: the batches, in training order.

        Yields:
            One :class:`BatchPlan` per batch, in order.
        """
        for batch in batches:
            yield from self.feed(batch)
        yield from self.finish()

    def _advance(self, ready: int, parts: Optional[Dict[str, Any]] = None, step: int = 0) -> List[BatchPlan]:
        """Per table (in parallel with ``plan_threads > 1``): check and read batch ``step`` of ``parts`` (when
        given), then plan the ``ready`` oldest window batches.

        Tables are independent, so the plans do not depend on the threads. A failure raises the error the
        serial order (check every table, read every table, then plan step by step, table by table) meets first.
        """

        def work(name: str) -> Tuple[List[Dict[str, TablePlan]], Optional[Tuple[int, int, BaseException]]]:
            unit = self._units[name]
            plans: List[Dict[str, TablePlan]] = []
            try:
                if parts is not None:
                    try:
                        unit.check_ids(parts, step)
                    except Exception as exc:
                        return plans, (0, 0, exc)
                    try:
                        unit.push(step, parts)
                    except Exception as exc:
                        return plans, (1, 0, exc)
                for _ in range(ready):
                    plans.append(unit.plan())
            except Exception as exc:
                return plans, (2, len(plans), exc)
            return plans, None

        threads = int(self.config.plan_threads or 1)
        if threads > 1 and len(self._units) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    min(threads, len(self._units)), thread_name_prefix="oracle-plan"
                )
            done = dict(zip(self._order, self._pool.map(work, self._order)))
        else:
            done = {name: work(name) for name in self._units}
        index = {name: i for i, name in enumerate(self._units)}
        failed = [(err[0], err[1], index[name], err[2]) for name, (_, err) in done.items() if err is not None]
        if failed:
            raise min(failed, key=lambda f: f[:3])[3]
        out = []
        for k in range(ready):
            tables: Dict[str, TablePlan] = {}
            for name in self._units:
                tables.update(done[name][0][k])
            out.append(BatchPlan(step=self._next, tables={t: tables[t] for t in sorted(tables)}))
            self._next += 1
        return out

    def stats(self) -> Dict[str, Dict[str, int]]:
        """Counters per table: steps, lookups, unique, hits, fetches, evictions, peak_rows.

        Returns:
            table -> counter -> value (``peak_rows``: most rows ever resident, the ttl policy's capacity need).
        """
        out: Dict[str, Dict[str, int]] = {}
        for unit in self._units.values():
            out.update(unit.stats())
        return {t: out[t] for t in sorted(out)}

    def state_dict(self) -> Dict[str, Any]:
        """State after the last plan handed out; re-feed batches from ``state["next_step"]`` on.

        Returns:
            Plain values and CPU tensors.
        """
        return {
            "policy": Policy(self.config.policy).value,
            "next_step": self._next,
            "tables": {name: unit.state_dict() for name, unit in self._units.items()},
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the oracle then expects the batch ``state["next_step"]`` next.

        Args:
            state: a :meth:`state_dict` of an oracle with the same config.

        Raises:
            CheckpointError: the state belongs to another policy or other tables or capacities.
        """
        if state.get("policy") != Policy(self.config.policy).value or set(state.get("tables", {})) != set(
            self._units
        ):
            raise CheckpointError(
                f"oracle state for policy {state.get('policy')!r} and tables {sorted(state.get('tables', {}))} "
                f"does not match this oracle (policy {Policy(self.config.policy).value!r}, tables "
                f"{sorted(self._units)}); load it into an oracle built with the same OracleConfig"
            )
        for name, unit in self._units.items():
            saved = state["tables"][name]
            if (
                int(saved["capacity"]) != unit.capacity
                or tuple(saved.get("tables", unit.tables)) != unit.tables
            ):
                raise CheckpointError(
                    f"oracle state has capacity {saved['capacity']} for {name!r} (tables "
                    f"{list(saved.get('tables', [name]))}) but this oracle has {unit.capacity} (tables "
                    f"{list(unit.tables)}); use the same capacity and slot spaces"
                )
            unit.load_state_dict(saved)
        self._next = self._read = int(state["next_step"])


def min_capacity(batches: Iterable[Any], prefetch_depth: int, config: OracleConfig) -> Dict[str, int]:
    """Smallest capacity per planned table: the largest working set of a batch and the next ``prefetch_depth``.

    Args:
        batches: the stream (read once, fully).
        prefetch_depth: P.
        config: gives the planned tables and ``feature_to_table``.

    Returns:
        table -> rows.
    """
    names = sorted(config.capacity)
    best = {n: 0 for n in names}
    parts = (
        split_batch(batch, names, config.feature_to_table, False, config.unknown_features)
        for batch in batches
    )
    for _, sets in window_working_sets(({n: p[n][0] for n in names} for p in parts), prefetch_depth):
        for n, (_, need) in sets.items():
            best[n] = max(best[n], need)
    return best


def window_working_sets(
    table_ids: Iterable[Mapping[str, np.ndarray]], prefetch_depth: int
) -> Iterator[Tuple[int, Dict[str, Tuple[np.ndarray, int]]]]:
    """For each batch (table -> ids), its step and, per table, the batch's unique ids and the number of distinct
    ids of the window that ends there (the batch and the ``prefetch_depth`` before it): the rows a cache
    needs to hold that window.

    Example:
        >>> stream = [{"t": np.array([1, 2])}, {"t": np.array([2, 3])}]
        >>> [(step, sets["t"][1]) for step, sets in window_working_sets(stream, 1)]
        [(0, 2), (1, 3)]
    """
    hist: Dict[str, Deque[np.ndarray]] = {}
    for step, batch in enumerate(table_ids):
        sets: Dict[str, Tuple[np.ndarray, int]] = {}
        for n, ids in batch.items():
            window = hist.setdefault(n, deque(maxlen=prefetch_depth + 1))
            uniq = sorted_unique(ids)
            window.append(uniq)
            need = (
                int(uniq.size) if len(window) == 1 else int(sorted_unique(np.concatenate(list(window))).size)
            )
            sets[n] = (uniq, need)
        yield step, sets
