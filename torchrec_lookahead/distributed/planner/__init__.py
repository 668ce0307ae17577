"""TorchRec planner integration: which tables stay resident on the device and what each cache holds.

* :class:`LookaheadPlanner`: from a device memory budget and a few sample batches, keeps small and hot tables
  resident and sizes every other table's lookahead cache by sampled working sets and marginal misses.
* :class:`CachePlan` / :class:`TablePlacement` / :class:`Placement` / :class:`FetchCurve`: the result,
  printable as a report, convertible to TorchRec ``ParameterConstraints`` and to an ``OracleConfig``.
* :func:`row_bytes`, :func:`min_capacities`, :func:`simulate_fetches`, :func:`table_id_batches`: the pieces.

Example:
    >>> import torch
    >>> from torchrec.modules.embedding_configs import EmbeddingBagConfig
    >>> from torchrec_lookahead.modules import CacheOptimizerConfig
    >>> tables = [EmbeddingBagConfig(name="t", num_embeddings=1000, embedding_dim=4, feature_names=["f"])]
    >>> batches = [{"t": torch.arange(i % 5 * 50, i % 5 * 50 + 50)} for i in range(20)]  # 250 ids, cyclic
    >>> plan = LookaheadPlanner(device_budget_bytes=4096, horizon=10).plan(
    ...     tables, CacheOptimizerConfig("exact_sgd"), batches)
    >>> plan.capacity, plan.table("t").min_capacity, plan.table("t").fetches_per_step
    ({'t': 250}, 100, 0.0)
"""

from torchrec_lookahead.distributed.planner.planner import LookaheadPlanner, row_bytes
from torchrec_lookahead.distributed.planner.types import CachePlan, FetchCurve, Placement, TablePlacement
from torchrec_lookahead.distributed.planner.working_set import (
    batch_table_ids,
    collect_samples,
    min_capacities,
    simulate_fetches,
    table_id_batches,
)

__all__ = [
    "LookaheadPlanner",
    "CachePlan",
    "TablePlacement",
    "Placement",
    "FetchCurve",
    "row_bytes",
    "min_capacities",
    "simulate_fetches",
    "collect_samples",
    "table_id_batches",
    "batch_table_ids",
]
