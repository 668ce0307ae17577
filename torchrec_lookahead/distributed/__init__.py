"""TorchRec integration: the lookahead sharders (EmbeddingBagCollection and EmbeddingCollection), their sharded
modules (siblings over :class:`ShardedLookaheadCollection`, what code taking either uses), sharding plans with
cached tables, and (:mod:`torchrec_lookahead.distributed.planner`) the planner that sizes caches for a device
budget."""

from torchrec_lookahead.distributed._optimizers import cache_optimizer_from_module
from torchrec_lookahead.distributed._stores import STORE_KINDS, STORE_SHARDINGS, StoreKind, StoreSharding
from torchrec_lookahead.distributed.ec_sharder import LookaheadEmbeddingCollectionSharder
from torchrec_lookahead.distributed.fused_optimizer import CacheFusedOptimizer
from torchrec_lookahead.distributed.plan import (
    check_all_sharded,
    embedding_table_configs,
    embedding_tables,
    lookahead_sharding_plan,
    with_default_sharders,
)
from torchrec_lookahead.distributed.sharded import ShardedLookaheadEmbeddingBagCollection
from torchrec_lookahead.distributed.sharded_collection import ShardedLookaheadCollection
from torchrec_lookahead.distributed.sharded_ec import ShardedLookaheadEmbeddingCollection
from torchrec_lookahead.distributed.sharder import LookaheadEmbeddingBagCollectionSharder, lookahead_planning

__all__ = [
    "LookaheadEmbeddingBagCollectionSharder",
    "ShardedLookaheadEmbeddingBagCollection",
    "LookaheadEmbeddingCollectionSharder",
    "ShardedLookaheadEmbeddingCollection",
    "ShardedLookaheadCollection",
    "CacheFusedOptimizer",
    "lookahead_sharding_plan",
    "embedding_tables",
    "embedding_table_configs",
    "cache_optimizer_from_module",
    "with_default_sharders",
    "check_all_sharded",
    "lookahead_planning",
    "StoreSharding",
    "STORE_SHARDINGS",
    "StoreKind",
    "STORE_KINDS",
]
