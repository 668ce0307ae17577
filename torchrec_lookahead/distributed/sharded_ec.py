"""The sharded EmbeddingCollection our sharder builds: resident tables through TorchRec, cached tables through
the cache.

``ShardedLookaheadEmbeddingCollection`` replaces a TorchRec ``EmbeddingCollection`` (unpooled, sequence
features) inside ``DistributedModelParallel``. It is a
:class:`~torchrec_lookahead.distributed.ShardedLookaheadCollection` (plans, flushes, several ranks, evaluation
from the stores, the fused-optimizer view), as its sibling
:class:`~torchrec_lookahead.distributed.ShardedLookaheadEmbeddingBagCollection` is, with the collection's
output: a dict feature -> ``JaggedTensor`` of per-id embeddings, the resident features' from TorchRec's own
``ShardedEmbeddingCollection`` and the cached ones' from a
:class:`~torchrec_lookahead.modules.CachedEmbeddingCollection`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torchrec.distributed.types import NullShardedModuleContext
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from torchrec_lookahead.distributed.sharded_collection import ShardedLookaheadCollection
from torchrec_lookahead.modules.cached_ec import CachedEmbeddingCollection

__all__ = ["ShardedLookaheadEmbeddingCollection"]


class ShardedLookaheadEmbeddingCollection(
    ShardedLookaheadCollection[EmbeddingConfig, Dict[str, JaggedTensor]]
):
    """An EmbeddingCollection whose large tables train through the lookahead cache.

    With several ranks it is an LRPP cache like the EBC's: each rank's backward runs its unpooled kernel over
    the global batch's ids of the rows it holds, with the gradients of other ranks' ids of shared rows
    received in one all-gather (``distributed/exact_sync.py``), so every row is summed in TorchRec's order.

    Args:
        tables: every table of the unsharded collection, in its order.
        resident: TorchRec's sharded collection of the resident tables (``None`` when every table is cached).
        cache: the cached tables' collection.
        rank: this rank.
        world_size: W.
        kwargs: as :class:`~torchrec_lookahead.distributed.ShardedLookaheadCollection` (process groups, cDLRM,
            delayed sync).
    """

    def __init__(
        self,
        tables: List[EmbeddingConfig],
        resident: Optional[nn.Module],
        cache: CachedEmbeddingCollection,
        rank: int = 0,
        world_size: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(tables, resident, cache, False, rank=rank, world_size=world_size, **kwargs)

    @property
    def unsharded_module_type(self) -> type:
        return EmbeddingCollection

    def compute(
        self, ctx: NullShardedModuleContext, dist_input: KeyedJaggedTensor
    ) -> Dict[str, JaggedTensor]:
        found: Dict[str, JaggedTensor] = {}
        for out in self._part_outputs(dist_input):
            found.update(out)
        return {f: found[f] for f in self._feature_names}

    def _eval_lookup(self, kjt: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        """Per-id embeddings of ids (not slots), read from the stores."""
        stores = self.cache.stores
        f2t = self.cache.feature_to_table
        device = self.cache.device
        out: Dict[str, JaggedTensor] = {}
        for name, jt in kjt.to_dict().items():
            uniq, inverse = torch.unique(jt.values().to(torch.int64), return_inverse=True)
            rows, _ = stores[f2t[name]].gather(uniq)
            out[name] = JaggedTensor(values=rows.to(device)[inverse.to(device)], lengths=jt.lengths())
        return out
