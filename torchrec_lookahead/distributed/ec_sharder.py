"""``LookaheadEmbeddingCollectionSharder``: the lookahead sharder for TorchRec's ``EmbeddingCollection``
(unpooled, sequence features).

TorchRec picks a sharder per module type, so an ``EmbeddingCollection`` needs a sharder of its own. This one is
the sibling of a :class:`~torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder`: it shares
its configuration (capacities, stores, seed, optimizer), so one lookahead sharder configures the cache of both
collection types. :func:`~torchrec_lookahead.distributed.with_default_sharders` (and therefore the
``torchrec`` strategy) adds it beside every lookahead EBC sharder that has no sibling in the list.

Example:
    >>> from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
    >>> ebc_sharder = LookaheadEmbeddingBagCollectionSharder(capacity={"items": 4096})
    >>> sharder = LookaheadEmbeddingCollectionSharder(ebc_sharder)
    >>> from torchrec_lookahead.distributed import lookahead_planning
    >>> with lookahead_planning():
    ...     kernels = sharder.compute_kernels("data_parallel", "cpu")
    >>> sharder.capacity is ebc_sharder.capacity, "customized_kernel" in kernels
    (True, True)
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.types import ParameterSharding, ShardingEnv
from torchrec.modules.embedding_modules import EmbeddingCollection

from torchrec_lookahead.distributed._tables import copy_in_backward_optimizers
from torchrec_lookahead.distributed.sharded_ec import ShardedLookaheadEmbeddingCollection
from torchrec_lookahead.distributed.sharder import LookaheadEmbeddingBagCollectionSharder
from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.modules.cached_ec import CachedEmbeddingCollection

__all__ = ["LookaheadEmbeddingCollectionSharder"]


class LookaheadEmbeddingCollectionSharder(EmbeddingCollectionSharder):
    """TorchRec's EmbeddingCollection sharder, extended with the lookahead cache for ``CUSTOMIZED_KERNEL``
    tables (planned by :func:`~torchrec_lookahead.distributed.lookahead_sharding_plan`); other tables are
    sharded by TorchRec's ``EmbeddingCollectionSharder`` unchanged.

    Args:
        source: the lookahead EBC sharder whose configuration this one shares (capacities, stores, seed,
            optimizer, fused parameters); default: a new one built from ``kwargs``.
        kwargs: the arguments of :class:`~torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder`
            when ``source`` is not given.

    Raises:
        ConfigError: both ``source`` and ``kwargs``.
    """

    def __init__(
        self, source: Optional[LookaheadEmbeddingBagCollectionSharder] = None, **kwargs: Any
    ) -> None:
        if source is not None and kwargs:
            raise ConfigError(
                f"give the EC sharder either a source sharder or its arguments, not both ({kwargs})"
            )
        self.source = source if source is not None else LookaheadEmbeddingBagCollectionSharder(**kwargs)
        super().__init__(
            fused_params=self.source.fused_params, qcomm_codecs_registry=self.source.qcomm_codecs_registry
        )

    @property
    def capacity(self) -> Dict[str, int]:
        """Cache rows per cached table (the source sharder's, shared)."""
        return self.source.capacity

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        """As the source sharder's :meth:`~LookaheadEmbeddingBagCollectionSharder.compute_kernels`."""
        return self.source.cache_kernels(
            list(super().compute_kernels(sharding_type, compute_device_type)), sharding_type
        )

    def shard(  # type: ignore[override]
        self,
        module: EmbeddingCollection,
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        module_fqn: Optional[str] = None,
    ) -> Any:
        src = self.source
        configs = module.embedding_configs()
        cached = src.cached_table_names(configs, params)
        if not cached:
            return super().shard(module, params, env, device, module_fqn)
        if module.need_indices():
            raise ConfigError(
                f"the EmbeddingCollection with cached tables {cached} has need_indices=True: the cache cannot "
                "return ids with the embeddings (its lookups see slots); build it with need_indices=False"
            )
        optimizer = src.cache_optimizer(module, cached)
        resident_cfgs = [c for c in configs if c.name not in cached]
        resident = None
        if resident_cfgs:
            sub = EmbeddingCollection(tables=resident_cfgs, device=torch.device("meta"))
            copy_in_backward_optimizers(module, sub, [c.name for c in resident_cfgs])
            resident = super().shard(
                sub, {c.name: params[c.name] for c in resident_cfgs}, env, device, module_fqn
            )
        cached_cfgs = [c for c in configs if c.name in cached]
        cache = CachedEmbeddingCollection(
            cached_cfgs,
            capacity={t: src.capacity[t] for t in cached},
            optimizer=optimizer,
            stores=src.cache_stores(cached_cfgs, optimizer, env),
            seed=src.seed or 0,
            device=device,
            cache_layout=src.cache_layout,
        )
        return ShardedLookaheadEmbeddingCollection(configs, resident, cache, **src.sync_options(env))
