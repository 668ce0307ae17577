"""The device cache of embedding rows: CachedEmbeddingBagCollection and the types it exchanges.

* :class:`CachedEmbeddingBagCollection`: EmbeddingBagCollection whose large tables keep ``capacity`` rows on the
  device and the rest (with optimizer state) in host stores; applies
  :class:`~torchrec_lookahead.oracle.types.BatchPlan` s.
* :class:`CachedEmbeddingCollection`: the same for an EmbeddingCollection (unpooled, per-id embeddings).
* :class:`CachedCollection`: what the two share (everything but the output); what code that takes either uses.
* :class:`AppliedPlan`: the plan a cache applied last, which its next forward covers.
* :class:`PreparedPlan`: a plan as a cache applies it, one move per slot space (``prepare_plan``, ahead).
* :class:`CacheLayout`: one cache per kernel and dimension shared by its tables (default), or one per table.
* :class:`CacheOptimizerConfig`: the fused sparse optimizer (also the resident baseline's ``fused_params``).
* :class:`StagedRows` / :func:`stage_rows`: fetch rows gathered ahead of their step.
* :func:`remap_kjt`: a KJT's ids of cached tables as slots of the cache (the ids per table for the oracle:
  :func:`torchrec_lookahead.oracle.table_ids`).
* :func:`init_embedding_bag_tables_`: give a resident TorchRec model the stores' initial values.
"""

from torchrec_lookahead.modules._moves import PreparedPlan
from torchrec_lookahead.modules._plans import AppliedPlan
from torchrec_lookahead.modules.cached_collection import CachedCollection
from torchrec_lookahead.modules.cached_ebc import CachedEmbeddingBagCollection
from torchrec_lookahead.modules.cached_ec import CachedEmbeddingCollection
from torchrec_lookahead.modules.config import (
    FBGEMM_CPU_OPTIMIZERS,
    OPTIMIZER_NAMES,
    SUPPORTED_OPTIMIZERS,
    CacheLayout,
    CacheOptimizerConfig,
    KernelChoice,
)
from torchrec_lookahead.modules.remap import remap_kjt
from torchrec_lookahead.modules.resident_init import init_embedding_bag_tables_
from torchrec_lookahead.modules.staging import stage_rows
from torchrec_lookahead.modules.types import StagedRows, StagedTable

__all__ = [
    "CachedEmbeddingBagCollection",
    "CachedEmbeddingCollection",
    "CachedCollection",
    "AppliedPlan",
    "PreparedPlan",
    "CacheLayout",
    "CacheOptimizerConfig",
    "KernelChoice",
    "SUPPORTED_OPTIMIZERS",
    "OPTIMIZER_NAMES",
    "FBGEMM_CPU_OPTIMIZERS",
    "StagedRows",
    "StagedTable",
    "stage_rows",
    "remap_kjt",
    "init_embedding_bag_tables_",
]
