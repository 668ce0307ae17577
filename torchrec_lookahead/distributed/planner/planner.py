"""The lookahead planner: which tables stay resident on the device and how many rows each cache keeps.

Given a device memory budget, :class:`LookaheadPlanner` reads a few sample batches and

1. computes every table's floor, the oracle's feasibility limit: the most unique ids of one batch together
   with the next ``prefetch_depth`` batches (a table with no more rows than its floor is resident);
2. refuses (:class:`~torchrec_lookahead.errors.CapacityError`) a budget below the sum of the floors;
3. builds a fetch curve per table by running the oracle itself on the sample at the floor, 2x, 4x, ... up to
   the sample's distinct ids, plus the whole table (resident: no fetches); the ttl policy's capacity does not
   change what it fetches, so its curve is its need (``peak_rows``) and the whole table; the window policy's
   floor is the smallest capacity at which its set-associative cache runs;
4. starts every table at its floor and repeatedly gives budget to the steepest next segment (fetched rows
   saved per byte) of any table's lower convex hull from its current capacity; reaching the last point makes
   the table resident, which is how small and hot tables end up whole on the device. Becoming resident is
   all or nothing (the sample shows no saving between the sample's distinct ids and the table's size): a
   resident step that does not fit is dropped and that table's hull recomputed without it. Any other segment
   that does not fit is taken in part and the fill stops;
5. reports the rows fetched per step at every chosen capacity, measured with the oracle on the sample after
   ``warmup_batches`` steps.

Example:
    >>> import torch
    >>> from torchrec.modules.embedding_configs import EmbeddingBagConfig
    >>> from torchrec_lookahead.modules import CacheOptimizerConfig
    >>> tables = [EmbeddingBagConfig(name="big", num_embeddings=10_000, embedding_dim=8, feature_names=["a"]),
    ...           EmbeddingBagConfig(name="small", num_embeddings=16, embedding_dim=8, feature_names=["b"])]
    >>> g = torch.Generator().manual_seed(0)
    >>> batches = [{"big": torch.randint(0, 10_000, (64,), generator=g), "small": torch.randint(0, 16, (64,),
    ...            generator=g)} for _ in range(20)]
    >>> planner = LookaheadPlanner(device_budget_bytes=16 << 10, horizon=20, prefetch_depth=1)
    >>> plan = planner.plan(tables, CacheOptimizerConfig("exact_sgd"), batches)
    >>> plan.resident, plan.device_bytes <= 16 << 10, plan.capacity["big"] >= plan.table("big").min_capacity
    (['small'], True, True)
"""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from torchrec_lookahead._arrays import sorted_unique
from torchrec_lookahead._checks import is_int
from torchrec_lookahead.distributed.planner.types import CachePlan, FetchCurve, Placement, TablePlacement
from torchrec_lookahead.distributed.planner.working_set import (
    _simulate,
    batch_table_ids,
    collect_samples,
    dense_ids,
    min_capacities,
)
from torchrec_lookahead.errors import CapacityError, ConfigError
from torchrec_lookahead.modules.config import CacheOptimizerConfig
from torchrec_lookahead.oracle import LookaheadSettings, OracleConfig, Policy
from torchrec_lookahead.oracle.config import DEFAULT_HORIZON, DEFAULT_PREFETCH_DEPTH

__all__ = ["LookaheadPlanner", "row_bytes"]

logger = logging.getLogger(__name__)

_FLOAT_BYTES = 4


def row_bytes(embedding_dim: int, optimizer: CacheOptimizerConfig) -> int:
    """Device bytes of one embedding row: fp32 weights plus the optimizer's fp32 per-row state.

    Args:
        embedding_dim: width of the row.
        optimizer: the sparse optimizer (its ``state_widths``).

    Returns:
        ``4 * (embedding_dim + sum(optimizer.state_widths(embedding_dim).values()))``.

    Example:
        >>> row_bytes(16, CacheOptimizerConfig("exact_row_wise_adagrad"))
        68
        >>> row_bytes(16, CacheOptimizerConfig("adam"))
        192
    """
    return _FLOAT_BYTES * (int(embedding_dim) + sum(optimizer.state_widths(int(embedding_dim)).values()))


@dataclass(frozen=True)
class _Table:
    name: str
    rows: int
    dim: int
    bpr: int


def _lower_hull(points: Sequence[Tuple[int, float]]) -> List[Tuple[int, float]]:
    """Lower convex hull of (capacity, fetches) points sorted by capacity, cut at its leftmost minimum."""
    hull: List[Tuple[int, float]] = []
    for p in points:
        while len(hull) >= 2:
            (x0, y0), (x1, y1) = hull[-2], hull[-1]
            if (x1 - x0) * (p[1] - y0) - (y1 - y0) * (p[0] - x0) <= 0:
                hull.pop()
            else:
                break
        hull.append(p)
    best = min(range(len(hull)), key=lambda i: (hull[i][1], i))
    return hull[: best + 1]


class LookaheadPlanner:
    """Plans resident tables and cache capacities for a device memory budget from sampled batches.

    See the module docstring for the algorithm. The constructor only checks and stores its arguments;
    :meth:`plan` reads the sample and does the work. Plans are deterministic.

    Args:
        device_budget_bytes: device bytes for embedding rows and their optimizer state, all tables together.
        horizon: the oracle's lookahead in batches (as in training).
        prefetch_depth: batches the stager loads ahead (as in training).
        policy: the oracle policy (``"belady"``, ``"ttl"``, ``"window"``, ``"lru"``).
        num_sample_batches: most batches read from ``sample_batches``.
        warmup_batches: leading sampled steps whose fetches are not counted (the cold cache filling up);
            default a quarter of the batches read.
        capacity_growth: ratio between successive simulated capacities (> 1).
        oracle_options: further :class:`~torchrec_lookahead.oracle.OracleConfig` arguments for the window
            policy (``window``, ``ways``, ``victim_rows``, ``seed``).
        floor_headroom: factor on the sampled floor (later batches can need more rows than the sample saw).

    Raises:
        ConfigError: a non-positive budget or sample size, ``capacity_growth <= 1``, or oracle arguments the
            oracle refuses (unknown policy, ``horizon < prefetch_depth``, ...).
    """

    def __init__(
        self,
        device_budget_bytes: int,
        horizon: int = DEFAULT_HORIZON,
        prefetch_depth: int = DEFAULT_PREFETCH_DEPTH,
        policy: Union[Policy, str] = Policy.BELADY,
        num_sample_batches: int = 50,
        warmup_batches: Optional[int] = None,
        capacity_growth: float = 2.0,
        oracle_options: Optional[Mapping[str, Any]] = None,
        floor_headroom: float = 1.0,
    ) -> None:
        if not is_int(device_budget_bytes) or int(device_budget_bytes) <= 0:
            raise ConfigError(
                f"device_budget_bytes must be a positive integer but got {device_budget_bytes!r}; pass the device "
                "bytes available for embedding rows and optimizer state, e.g. 64 << 20"
            )
        if not is_int(num_sample_batches) or int(num_sample_batches) < 1:
            raise ConfigError(
                f"num_sample_batches must be an integer >= 1 but got {num_sample_batches!r}; a few dozen batches "
                "give a useful plan"
            )
        if warmup_batches is not None and (not is_int(warmup_batches) or int(warmup_batches) < 0):
            raise ConfigError(
                f"warmup_batches must be None or an integer >= 0 but got {warmup_batches!r}; leave it None for a "
                "quarter of the sample"
            )
        if not isinstance(floor_headroom, numbers.Real) or not float(floor_headroom) >= 1.0:
            raise ConfigError(
                f"floor_headroom must be a number >= 1 but got {floor_headroom!r}; the sampled floor is multiplied "
                "by it, since batches after the sample can need more rows (1.25 leaves 25%)"
            )
        self.floor_headroom: float = float(floor_headroom)
        if not isinstance(capacity_growth, numbers.Real) or not float(capacity_growth) > 1.0:
            raise ConfigError(
                f"capacity_growth must be a number > 1 but got {capacity_growth!r}; 2.0 doubles the capacity "
                "between simulated points"
            )
        self.oracle_options: Dict[str, Any] = dict(oracle_options or {})
        for key in ("capacity", "horizon", "prefetch_depth", "policy", "num_embeddings", "feature_to_table"):
            if key in self.oracle_options:
                raise ConfigError(
                    f"oracle_options must not set {key!r}; it is a LookaheadPlanner argument or set by the planner"
                )
        #: the horizon, prefetch depth and policy the caches are sized for (the loader's LookaheadSettings)
        self.settings = LookaheadSettings(horizon, prefetch_depth, policy)
        # the oracle validates its further options
        OracleConfig(
            capacity={"_": 1}, num_embeddings={"_": 1}, **self.settings.oracle_fields(), **self.oracle_options
        )
        self.device_budget_bytes: int = int(device_budget_bytes)
        self.horizon: int = self.settings.horizon
        self.prefetch_depth: int = self.settings.prefetch_depth
        self.policy: Policy = Policy(self.settings.policy)
        self.num_sample_batches: int = int(num_sample_batches)
        self.warmup_batches: Optional[int] = None if warmup_batches is None else int(warmup_batches)
        self.capacity_growth: float = float(capacity_growth)
        # bytes of the user's budget spent before this plan and on what (FAE's pinned rows), for the errors
        self.reserved: Tuple[int, str] = (0, "")

    def plan(
        self,
        tables: Sequence[BaseEmbeddingConfig],
        optimizer: CacheOptimizerConfig,
        sample_batches: Iterable[Any],
        feature_to_table: Optional[Mapping[str, str]] = None,
    ) -> CachePlan:
        """Plan placements and capacities for ``tables`` from up to ``num_sample_batches`` sample batches.

        Args:
            tables: TorchRec table configs (``EmbeddingBagConfig``): name, ``num_embeddings``,
                ``embedding_dim``, ``feature_names``.
            optimizer: the sparse optimizer; its per-row state counts against the budget.
            sample_batches: batches in training order: mappings table -> LongTensor of ids when
                ``feature_to_table`` is ``None``; otherwise (and for KeyedJaggedTensors or TorchRec ``Batch``
                es) features are mapped to tables by ``feature_to_table``, which defaults to the tables'
                ``feature_names``.
            feature_to_table: feature name -> table name.

        Returns:
            The :class:`~torchrec_lookahead.distributed.planner.types.CachePlan`.

        Raises:
            ConfigError: no tables, duplicate names, non-positive sizes, unknown tables or features in the
                samples, no sample batch.
            DataError: non-integer ids.
            InvalidIdError: an id outside its table.
            CapacityError: the budget is below what the oracle needs at the smallest feasible capacities.
        """
        specs = self._tables(tables, optimizer)
        rows = {t.name: t.rows for t in specs}
        samples = collect_samples(
            self._per_table(sample_batches, tables, feature_to_table), rows, self.num_sample_batches
        )
        num_batches = len(samples[specs[0].name])
        warm = num_batches // 4 if self.warmup_batches is None else self.warmup_batches
        warm = min(warm, num_batches - 1)
        floors = min_capacities(samples, self.prefetch_depth)
        # The sample only bounds the working set of the batches it saw: later batches can need more rows.
        floor = {t.name: min(t.rows, max(1, math.ceil(floors[t.name] * self.floor_headroom))) for t in specs}
        self._check_budget(
            specs, floor, "the most unique ids of one batch and the next prefetch_depth batches"
        )

        curves: Dict[str, List[Tuple[int, float]]] = {}
        for t in specs:
            curves[t.name] = self._curve(t, samples[t.name], floor[t.name], warm)
            floor[t.name] = curves[t.name][0][0]
        if self.policy in (Policy.TTL, Policy.WINDOW):
            self._check_budget(
                specs, floor, f"the smallest capacity at which policy {self.policy.value!r} runs"
            )

        alloc = self._allocate(specs, curves, floor)
        placements = []
        for t in specs:
            cap = alloc[t.name]
            if cap >= t.rows:
                placements.append(
                    TablePlacement(
                        t.name, t.rows, t.dim, t.bpr, Placement.RESIDENT, t.rows, floor[t.name], 0.0
                    )
                )
                continue
            cap, fetches = self._estimate(t, samples[t.name], curves[t.name], cap, warm)
            placements.append(
                TablePlacement(t.name, t.rows, t.dim, t.bpr, Placement.CACHED, cap, floor[t.name], fetches)
            )
        plan = CachePlan(
            tables=tuple(placements),
            budget_bytes=self.device_budget_bytes,
            policy=self.policy.value,
            horizon=self.horizon,
            prefetch_depth=self.prefetch_depth,
            num_sample_batches=num_batches,
            warmup_batches=warm,
            curves=tuple(
                FetchCurve(
                    t.name, t.bpr, tuple(c for c, _ in curves[t.name]), tuple(f for _, f in curves[t.name])
                )
                for t in specs
            ),
        )
        logger.debug("lookahead plan:\n%s", plan)
        return plan

    # ---------------------------------------------------------------- inputs
    def _tables(self, tables: Sequence[BaseEmbeddingConfig], optimizer: CacheOptimizerConfig) -> List[_Table]:
        if not isinstance(optimizer, CacheOptimizerConfig):
            raise ConfigError(
                f"optimizer must be a CacheOptimizerConfig but got {type(optimizer).__name__}; pass e.g. "
                "CacheOptimizerConfig('exact_row_wise_adagrad')"
            )
        specs: List[_Table] = []
        for cfg in tables:
            if not (
                isinstance(cfg, BaseEmbeddingConfig)
                and isinstance(cfg.name, str)
                and is_int(cfg.num_embeddings)
                and is_int(cfg.embedding_dim)
            ):
                raise ConfigError(
                    f"tables must be TorchRec EmbeddingBagConfigs (name, num_embeddings, embedding_dim) but got "
                    f"{cfg!r}; build them with torchrec.EmbeddingBagConfig"
                )
            name, rows, dim = cfg.name, int(cfg.num_embeddings), int(cfg.embedding_dim)
            if rows < 1 or dim < 1:
                raise ConfigError(
                    f"table {name!r} must have num_embeddings >= 1 and embedding_dim >= 1 but got {rows} and {dim}; "
                    "fix the table config"
                )
            if any(s.name == name for s in specs):
                raise ConfigError(f"table name {name!r} appears twice; table names must be unique")
            specs.append(_Table(name, rows, dim, row_bytes(dim, optimizer)))
        if not specs:
            raise ConfigError("tables is empty; pass the model's EmbeddingBagConfigs")
        return specs

    @staticmethod
    def _per_table(
        batches: Iterable[Any],
        tables: Sequence[BaseEmbeddingConfig],
        feature_to_table: Optional[Mapping[str, str]],
    ) -> Iterator[Any]:
        mapping = dict(feature_to_table) if feature_to_table is not None else None
        derived: Dict[str, str] = {}
        for cfg in tables:
            for feature in list(cfg.feature_names or [cfg.name]):
                derived[str(feature)] = cfg.name
        for index, batch in enumerate(batches):
            if mapping is None and isinstance(batch, Mapping):
                yield batch
            else:
                yield batch_table_ids(batch, mapping if mapping is not None else derived, index)

    def _check_budget(self, specs: Sequence[_Table], floor: Mapping[str, int], what: str) -> None:
        need = sum(floor[t.name] * t.bpr for t in specs)
        if need <= self.device_budget_bytes:
            return
        worst = sorted(specs, key=lambda t: (-floor[t.name] * t.bpr, t.name))
        listed = ", ".join(
            f"{t.name}: {floor[t.name]:,} rows x {t.bpr} B = {floor[t.name] * t.bpr:,} B" for t in worst[:5]
        )
        more = f" and {len(worst) - 5} more" if len(worst) > 5 else ""
        taken, on = self.reserved
        left = (
            f" leaves {self.device_budget_bytes:,} bytes after the {taken:,} bytes of {on},"
            if taken
            else " is"
        )
        raise CapacityError(
            f"device_budget_bytes={self.device_budget_bytes + taken:,}{left} below the {need:,} bytes the lookahead "
            f"cache needs at least ({what}; largest: {listed}{more}); raise device_budget_bytes to at least "
            f"{need + taken:,}, lower prefetch_depth (now {self.prefetch_depth}), use smaller batches, or an optimizer "
            "with less per-row state (row-wise Adagrad keeps one float per row)"
        )

    # ---------------------------------------------------------------- curves
    def _run(
        self, table: _Table, batches: Sequence[np.ndarray], capacity: int, warm: int
    ) -> Optional[Tuple[float, int]]:
        return _simulate(
            batches,
            capacity,
            self.horizon,
            self.prefetch_depth,
            self.policy.value,
            warm,
            num_embeddings=table.rows if self.policy is Policy.WINDOW else None,
            oracle_options=self.oracle_options,
        )

    def _ids(self, batches: Sequence[np.ndarray]) -> Sequence[np.ndarray]:
        # the window policy's set index depends on id values; the others only on order and equality
        return batches if self.policy is Policy.WINDOW else dense_ids(batches)

    def _curve(
        self, table: _Table, batches: Sequence[np.ndarray], floor: int, warm: int
    ) -> List[Tuple[int, float]]:
        """Feasible (capacity, fetches per step) points, ascending, ending with (rows, 0.0) for resident."""
        resident = (table.rows, 0.0)
        if table.rows <= floor:
            return [resident]
        distinct = int(sorted_unique(np.concatenate(list(batches))).size) if batches else 0
        ids = self._ids(batches)
        if self.policy is Policy.TTL:
            res = self._run(table, ids, max(floor, distinct, 1), warm)
            need = max(floor, 0 if res is None else res[1])
            if res is None or need >= table.rows:
                return [resident]
            return [(need, res[0]), resident]
        top = max(floor, min(distinct, table.rows - 1))
        candidates = []
        c = floor
        while c < top:
            candidates.append(c)
            c = max(c + 1, int(math.ceil(c * self.capacity_growth)))
        candidates.append(top)
        points: List[Tuple[int, float]] = []
        for cap in candidates:
            res = self._run(table, ids, cap, warm)
            if res is not None:
                points.append((cap, res[0]))
            elif points:
                logger.debug(
                    "table %s: policy %s cannot run at capacity %d", table.name, self.policy.value, cap
                )
        points.append(resident)
        logger.debug("table %s: fetch curve %s", table.name, points)
        return points

    def _allocate(
        self, specs: Sequence[_Table], curves: Mapping[str, List[Tuple[int, float]]], floor: Mapping[str, int]
    ) -> Dict[str, int]:
        """Spend the budget on the steepest next lower-hull segment of any table until it runs out."""
        alloc = {t.name: floor[t.name] for t in specs}
        remaining = self.device_budget_bytes - sum(floor[t.name] * t.bpr for t in specs)
        no_resident: set = set()
        while True:
            best: Optional[Tuple[Tuple[float, str], _Table, int]] = None
            for t in specs:
                points = [p for p in curves[t.name] if p[0] >= alloc[t.name]]
                if t.name in no_resident:
                    points = [p for p in points if p[0] < t.rows]
                hull = _lower_hull(points)
                if len(hull) < 2:
                    continue
                (c0, f0), (c1, f1) = hull[0], hull[1]
                key = (-(f0 - f1) / ((c1 - c0) * t.bpr), t.name)
                if best is None or key < best[0]:
                    best = (key, t, c1)
            if best is None:
                return alloc
            _, t, c1 = best
            cost = (c1 - alloc[t.name]) * t.bpr
            if cost <= remaining:
                alloc[t.name] = c1
                remaining -= cost
            elif c1 >= t.rows:
                # the whole table does not fit: the sample shows no saving between its largest sampled
                # capacity and its size, so its cache is sized on the sampled points only
                no_resident.add(t.name)
            else:
                alloc[t.name] += remaining // t.bpr
                return alloc

    def _estimate(
        self,
        table: _Table,
        batches: Sequence[np.ndarray],
        curve: Sequence[Tuple[int, float]],
        capacity: int,
        warm: int,
    ) -> Tuple[int, float]:
        """(capacity, fetches per step) at ``capacity``, or at the sampled point below if it cannot run."""
        known = dict(curve)
        if capacity in known:
            return capacity, known[capacity]
        res = self._run(table, self._ids(batches), capacity, warm)
        if res is not None:
            return capacity, res[0]
        below = max(c for c, _ in curve if c <= capacity)
        return below, known[below]
