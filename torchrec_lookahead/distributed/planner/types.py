"""Types of the lookahead planner: where each table lives on the device, and the plan as a whole.

A :class:`CachePlan` lists one :class:`TablePlacement` per table: ``resident`` tables are kept whole on the
device (TorchRec's fused kernel), ``cached`` tables keep ``capacity`` rows in the lookahead cache and the rest
in the host store. Its ``capacity`` mapping is what :class:`~torchrec_lookahead.oracle.OracleConfig` and
:class:`~torchrec_lookahead.modules.CachedEmbeddingBagCollection` take; ``str(plan)`` is a report in the
manner of TorchRec's planner statistics.

Example:
    >>> plan = CachePlan(
    ...     tables=(TablePlacement("t0", 1000, 8, 36, Placement.CACHED, 100, 60, 12.5),
    ...             TablePlacement("t1", 10, 8, 36, Placement.RESIDENT, 10, 10, 0.0)),
    ...     budget_bytes=8192, policy="belady", horizon=200, prefetch_depth=1, num_sample_batches=50,
    ...     warmup_batches=12)
    >>> plan.capacity, plan.resident, plan.device_bytes
    ({'t0': 100}, ['t1'], 3960)
    >>> plan.to_constraints()["t1"].compute_kernels
    ['fused']
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingType

from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.oracle import OracleConfig

__all__ = ["Placement", "TablePlacement", "FetchCurve", "CachePlan"]


class Placement(str, enum.Enum):
    """Where a table lives on the device.

    Attributes:
        RESIDENT: the whole table (and its optimizer state) is on the device.
        CACHED: ``capacity`` rows are on the device, planned by the lookahead oracle; the table is in the
            host store.
    """

    RESIDENT = "resident"
    CACHED = "cached"


@dataclass(frozen=True)
class TablePlacement:
    """One table of a :class:`CachePlan`.

    Attributes:
        name: table name.
        num_embeddings: rows of the table.
        embedding_dim: width of a row.
        bytes_per_row: device bytes of one row: fp32 weights plus fp32 optimizer state.
        placement: resident or cached.
        capacity: rows on the device (``num_embeddings`` when resident).
        min_capacity: the oracle's floor: most unique ids of one sampled batch and the next
            ``prefetch_depth`` batches (for the ttl and window policies, the smallest capacity they ran at).
        fetches_per_step: rows the oracle fetched per step on the sample at ``capacity`` (0 when resident).
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    bytes_per_row: int
    placement: Placement
    capacity: int
    min_capacity: int
    fetches_per_step: float

    @property
    def device_bytes(self) -> int:
        """Device bytes of the table's rows on the device (weights and optimizer state)."""
        return self.capacity * self.bytes_per_row

    @property
    def capacity_percent(self) -> float:
        """Rows on the device as a percentage of the table's rows."""
        return 100.0 * self.capacity / self.num_embeddings


@dataclass(frozen=True)
class FetchCurve:
    """Sampled fetched rows per step against cache capacity for one table.

    Attributes:
        table: table name.
        bytes_per_row: device bytes of one row.
        capacities: simulated capacities in rows, ascending; the last is the table's rows (resident: no
            fetches).
        fetches_per_step: mean fetched rows per step at each capacity.
    """

    table: str
    bytes_per_row: int
    capacities: Tuple[int, ...]
    fetches_per_step: Tuple[float, ...]


def _human(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024.0 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.2f} {unit}"
        num_bytes /= 1024.0
    return f"{num_bytes:.2f} TiB"  # pragma: no cover


@dataclass(frozen=True)
class CachePlan:
    """Which tables stay resident on the device and how many rows each cached table keeps there.

    Attributes:
        tables: one :class:`TablePlacement` per table, in the order the tables were given.
        budget_bytes: the device memory budget the plan was made for.
        policy: the oracle policy the capacities were sized for.
        horizon: the oracle's lookahead.
        prefetch_depth: the oracle's prefetch depth.
        num_sample_batches: sampled batches the plan was computed from.
        warmup_batches: leading sampled batches whose fetches were not counted.
        curves: the sampled fetch curve of every table (for inspection; not compared).
    """

    tables: Tuple[TablePlacement, ...]
    budget_bytes: int
    policy: str
    horizon: int
    prefetch_depth: int
    num_sample_batches: int
    warmup_batches: int
    curves: Tuple[FetchCurve, ...] = field(default=(), compare=False, repr=False)

    @property
    def capacity(self) -> Dict[str, int]:
        """Cache rows per cached table (``OracleConfig.capacity`` / ``CachedEmbeddingBagCollection``)."""
        return {t.name: t.capacity for t in self.tables if t.placement is Placement.CACHED}

    @property
    def resident(self) -> List[str]:
        """Names of the tables kept whole on the device."""
        return [t.name for t in self.tables if t.placement is Placement.RESIDENT]

    @property
    def device_bytes(self) -> int:
        """Device bytes of every resident table and every cache, weights and optimizer state."""
        return sum(t.device_bytes for t in self.tables)

    @property
    def fetches_per_step(self) -> float:
        """Estimated rows fetched per step, all tables together."""
        return float(sum(t.fetches_per_step for t in self.tables))

    def table(self, name: str) -> TablePlacement:
        """The placement of one table.

        Args:
            name: a table of the plan.

        Returns:
            Its :class:`TablePlacement`.

        Raises:
            ConfigError: no such table.
        """
        for t in self.tables:
            if t.name == name:
                return t
        raise ConfigError(
            f"table {name!r} is not in the plan; its tables are {[t.name for t in self.tables]}"
        )

    def to_constraints(self) -> Dict[str, ParameterConstraints]:
        """TorchRec ``ParameterConstraints`` per table for ``EmbeddingShardingPlanner(constraints=...)``.

        Resident tables: table-wise sharding, fused kernel. Cached tables: data parallel with TorchRec's
        ``customized_kernel`` compute kernel, which the lookahead sharder builds.

        Returns:
            table name -> constraints.
        """
        out: Dict[str, ParameterConstraints] = {}
        for t in self.tables:
            if t.placement is Placement.RESIDENT:
                out[t.name] = ParameterConstraints(
                    sharding_types=[ShardingType.TABLE_WISE.value],
                    compute_kernels=[EmbeddingComputeKernel.FUSED.value],
                )
            else:
                out[t.name] = ParameterConstraints(
                    sharding_types=[ShardingType.DATA_PARALLEL.value],
                    compute_kernels=[EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value],
                )
        return out

    def oracle_config(
        self, feature_to_table: Optional[Mapping[str, str]] = None, **options: Any
    ) -> OracleConfig:
        """The :class:`~torchrec_lookahead.oracle.OracleConfig` that plans the cached tables of this plan.

        Args:
            feature_to_table: feature -> table of the training batches (``None``: batches keyed by table).
            **options: further ``OracleConfig`` arguments (``window``, ``ways``, ``num_ranks``, ...).

        Returns:
            A config with this plan's capacities, policy, horizon, prefetch depth and table sizes.
        """
        return OracleConfig(
            capacity=self.capacity,
            horizon=self.horizon,
            prefetch_depth=self.prefetch_depth,
            policy=self.policy,
            num_embeddings={t.name: t.num_embeddings for t in self.tables},
            feature_to_table=feature_to_table,
            **options,
        )

    def __str__(self) -> str:
        header = ["table", "rows", "dim", "placement", "capacity", "capacity %", "device bytes"]
        header += ["fetches/step", "min capacity"]
        rows = [
            [
                t.name,
                f"{t.num_embeddings:,}",
                str(t.embedding_dim),
                t.placement.value,
                f"{t.capacity:,}",
                f"{t.capacity_percent:.1f}%",
                _human(t.device_bytes),
                f"{t.fetches_per_step:,.1f}",
                f"{t.min_capacity:,}",
            ]
            for t in self.tables
        ]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

        def line(cells: List[str]) -> str:
            parts = [c.ljust(w) if i in (0, 3) else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))]
            return " | ".join(parts)

        table_lines = [line(header), "-+-".join("-" * w for w in widths)] + [line(r) for r in rows]
        used = self.device_bytes
        summary = [
            "--- Lookahead planner: device cache plan ---",
            f"budget {_human(self.budget_bytes)}, used {_human(used)} "
            f"({100.0 * used / self.budget_bytes:.1f}%); {len(self.resident)} resident, "
            f"{len(self.capacity)} cached; {self.fetches_per_step:,.1f} fetched rows per step",
            f"policy {self.policy}, horizon {self.horizon}, prefetch_depth {self.prefetch_depth}; "
            f"estimated on {self.num_sample_batches} sampled batches after {self.warmup_batches} warm-up",
        ]
        width = max(len(s) for s in summary + table_lines)
        box = ["#" * (width + 4)]
        box += [f"# {s.center(width)} #" for s in summary[:1]]
        box += [f"# {s.ljust(width)} #" for s in summary[1:]]
        box += [f"# {'-' * width} #"]
        box += [f"# {s.ljust(width)} #" for s in table_lines]
        box += ["#" * (width + 4)]
        return "\n".join(box)
