"""Cache sizes for a device budget: the lookahead planner run over sampled batches, with FAE's pinned hot rows
taken off the budget first."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.distributed._optimizers import cache_optimizer_from_module
from torchrec_lookahead.distributed._tables import table_configs
from torchrec_lookahead.errors import CapacityError, ConfigError
from torchrec_lookahead.modules import CacheOptimizerConfig
from torchrec_lookahead.oracle import UnknownFeatures, table_ids

__all__ = ["plan_capacity", "cold_table_ids"]


def plan_capacity(
    module: nn.Module,
    sample_batches: Iterable[Any],
    device_budget_bytes: int,
    optimizer: Optional[CacheOptimizerConfig],
    planner_options: Mapping[str, Any],
    pinned: Optional[Mapping[str, torch.Tensor]] = None,
) -> Tuple[Dict[str, int], Any]:
    """The capacity of each cached table of ``module`` and the planner's report, for ``device_budget_bytes``
    (see :meth:`~torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder.plan_capacity`).

    Raises:
        ConfigError: pinned rows name a table the module does not have.
        CapacityError: the budget cannot hold the pinned rows and the smallest feasible caches.
    """
    from torchrec_lookahead.distributed.planner import LookaheadPlanner, row_bytes

    ebcs = [m for m in module.modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))]
    tables = [c for m in ebcs for c in table_configs(m)]
    names = [c.name for c in tables]
    for m in ebcs:
        optimizer = optimizer or cache_optimizer_from_module(m, names)
    optimizer = optimizer or CacheOptimizerConfig()
    # Leave 25% above the sampled working set by default: batches after the sample can need more rows.
    options = {"floor_headroom": 1.25, **planner_options}
    hot = {t: ids for t, ids in (pinned or {}).items() if ids.numel()}
    if not hot:
        plan = LookaheadPlanner(device_budget_bytes, **options).plan(tables, optimizer, sample_batches)
        return dict(plan.capacity), plan
    unknown = sorted(set(hot) - set(names))
    if unknown:
        raise ConfigError(f"pinned rows name tables {unknown} the model does not have; its tables: {names}")
    bpr = {c.name: row_bytes(int(c.embedding_dim), optimizer) for c in tables}
    pinned_rows = {t: int(ids.numel()) for t, ids in hot.items()}
    pinned_bytes = sum(n * bpr[t] for t, n in pinned_rows.items())
    if pinned_bytes >= device_budget_bytes:
        raise CapacityError(
            f"device_budget_bytes={device_budget_bytes:,} does not exceed the {pinned_bytes:,} bytes of the "
            f"{sum(pinned_rows.values()):,} pinned hot rows; raise the budget or lower hot_budget_bytes"
        )
    dynamic = [
        dataclasses.replace(c, num_embeddings=c.num_embeddings - pinned_rows.get(c.name, 0))
        for c in tables
        if c.num_embeddings > pinned_rows.get(c.name, 0)
    ]
    f2t = {f: c.name for c in dynamic for f in c.feature_names}
    samples = (cold_table_ids(getattr(b, "sparse_features", b), f2t, hot) for b in sample_batches)
    planner = LookaheadPlanner(device_budget_bytes - pinned_bytes, **options)
    planner.reserved = (pinned_bytes, f"the {sum(pinned_rows.values()):,} pinned hot rows")
    plan = planner.plan(dynamic, optimizer, samples)
    return {t: c + pinned_rows.get(t, 0) for t, c in plan.capacity.items()}, plan


def cold_table_ids(
    kjt: KeyedJaggedTensor, feature_to_table: Mapping[str, str], hot_ids: Mapping[str, torch.Tensor]
) -> Dict[str, torch.Tensor]:
    """Per table, the batch's cold ids renumbered among the table's cold rows (an id minus the hot ids below it):
    what the dynamic part of a cache with pinned rows sees, as ids of a table of ``rows - P`` rows. The budget
    planner sizes the dynamic caches from them.

    Args:
        kjt: the batch's sparse features.
        feature_to_table: feature -> table for the tables to report.
        hot_ids: table -> sorted hot ids (tables not listed have none).

    Example:
        >>> kjt = KeyedJaggedTensor(["f"], torch.tensor([0, 5, 2, 7]), lengths=torch.tensor([2, 2]))
        >>> {t: v.tolist() for t, v in cold_table_ids(kjt, {"f": "t"}, {"t": torch.tensor([2, 5])}).items()}
        {'t': [0, 5]}
    """
    out: Dict[str, torch.Tensor] = {}
    for table, ids in table_ids(
        kjt, feature_to_table, set(feature_to_table.values()), unknown=UnknownFeatures.IGNORE
    ).items():
        ids = ids.to("cpu", torch.int64)
        hot = hot_ids.get(table)
        if hot is None or not hot.numel():
            out[table] = ids
            continue
        hot = hot.to(torch.int64)
        cold = ids[~torch.isin(ids, hot)]
        out[table] = cold - torch.searchsorted(hot, cold)
    return out
