"""What the planner and the stager know of a model's cached tables (:class:`CacheTarget`), and where they are
(:func:`cached_modules`).

Example:
    >>> from torchrec_lookahead.store import TensorStore
    >>> target = CacheTarget({"t": 8}, {"f": "t"}, {"t": 100}, {"t": TensorStore(100, 4, {}, name="t", seed=0)})
    >>> target.num_ranks, sorted(target.capacity)
    (1, ['t'])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from torchrec_lookahead.distributed.exact_sync import ExchangeSpec
from torchrec_lookahead.distributed.sharded_collection import ShardedLookaheadCollection
from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.store.types import EmbeddingStore, HostWindow

__all__ = ["CacheTarget", "cached_modules"]


def cached_modules(model: torch.nn.Module) -> List[ShardedLookaheadCollection[Any, Any]]:
    """The collections of ``model`` (a ``DistributedModelParallel`` model, or any module holding one) with
    cached tables, in module order."""
    return [m for m in model.modules() if isinstance(m, ShardedLookaheadCollection)]


@dataclass(frozen=True)
class CacheTarget:
    """What the oracle and stager need to know about the model's cached tables.

    Attributes:
        capacity: cache rows per cached table.
        feature_to_table: feature -> table, for every cached table's features.
        num_embeddings: rows per cached table.
        stores: host store per cached table.
        num_ranks: data-parallel ranks (LRPP when > 1: every rank plans the global batch).
        rank: this rank.
        group: process group on which the planner thread gathers the other ranks' ids.
        average_every: cDLRM mode's averaging period λ (``None``: exact LRPP).
        exchanges: with several ranks, the cache kernels whose exact gradient exchange the planner indexes
            ahead with each step's LRPP plan (their layouts, as values); none: each backward indexes its own.
        host_windows: per cached table whose store has a bounded host tier (a disk store), what one window of
            steps must fit in (:class:`~torchrec_lookahead.store.types.HostWindow`); ``None`` (default): those
            the stores report.
        slot_spaces: slot space -> the cached tables sharing its cache rows (the caches' ``slot_spaces``); a
            table in none has a cache of its own (``capacity`` rows).
        resident_features: feature -> (table, rows) of the resident tables of the cached collections, whose
            ids the pre-scan checks too (:func:`~torchrec_lookahead.runtime.capacity.check_stream`).
    """

    capacity: Mapping[str, int]
    feature_to_table: Mapping[str, str]
    num_embeddings: Mapping[str, int]
    stores: Mapping[str, EmbeddingStore]
    num_ranks: int = 1
    rank: int = 0
    group: Optional[dist.ProcessGroup] = None
    average_every: Optional[int] = None
    exchanges: Tuple[ExchangeSpec, ...] = ()
    host_windows: Optional[Mapping[str, HostWindow]] = None
    slot_spaces: Mapping[str, Tuple[str, ...]] = field(default_factory=dict)
    resident_features: Mapping[str, Tuple[str, int]] = field(default_factory=dict)

    def cache_rows(self) -> Dict[str, int]:
        """Per cached table, the rows of the cache its slots index: its slot space's (the sum of its members'
        capacities), or its own capacity."""
        rows = {t: int(c) for t, c in self.capacity.items()}
        for members in self.slot_spaces.values():
            total = sum(int(self.capacity[t]) for t in members)
            rows.update({t: total for t in members})
        return rows

    def __post_init__(self) -> None:
        if self.host_windows is None:
            windows = {t: s.host_window for t, s in self.stores.items() if t in self.capacity}
            object.__setattr__(self, "host_windows", {t: w for t, w in windows.items() if w is not None})

    @classmethod
    def from_modules(
        cls,
        modules: Sequence[ShardedLookaheadCollection[Any, Any]],
        num_ranks: int = 1,
        rank: int = 0,
        group: Optional[dist.ProcessGroup] = None,
    ) -> CacheTarget:
        """The cached tables of ``modules`` (see :func:`cached_modules`), planned on ``num_ranks`` ranks.

        Raises:
            ConfigError: two cached collections share a table or feature name.
        """
        capacity: Dict[str, int] = {}
        f2t: Dict[str, str] = {}
        rows: Dict[str, int] = {}
        stores: Dict[str, EmbeddingStore] = {}
        exchanges: List[ExchangeSpec] = []
        spaces: Dict[str, Tuple[str, ...]] = {}
        resident: Dict[str, Tuple[str, int]] = {}
        for m in modules:
            cache = m.cache
            clash = sorted(set(capacity) & set(cache.capacity))
            clash += sorted(
                f for f in cache.feature_to_table if f in f2t and f2t[f] != cache.feature_to_table[f]
            )
            if clash:
                raise ConfigError(
                    f"Two cached collections share table or feature names {clash}; give every cached table and "
                    "feature a unique name"
                )
            capacity.update(cache.capacity)
            stores.update(cache.stores)
            f2t.update({f: t for f, t in cache.feature_to_table.items() if t in cache.capacity})
            rows.update({c.name: c.num_embeddings for c in cache.table_configs() if c.name in cache.capacity})
            exchanges += m.exchange_specs()
            spaces.update(cache.slot_spaces)
            for c in cache.table_configs():
                if c.name in cache.capacity:
                    continue
                for f in c.feature_names:  # a feature two collections read: the smaller table refuses first
                    if f not in resident or c.num_embeddings < resident[f][1]:
                        resident[f] = (c.name, int(c.num_embeddings))
        return cls(
            capacity=capacity,
            feature_to_table=f2t,
            num_embeddings=rows,
            stores=stores,
            num_ranks=num_ranks,
            rank=rank,
            group=group,
            average_every=next((m.average_every for m in modules if m.average_every is not None), None),
            exchanges=tuple(exchanges),
            slot_spaces=spaces,
            resident_features=resident,
        )
