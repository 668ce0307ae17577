"""The sharded module our sharder builds: resident tables through TorchRec, cached tables through the cache.

``ShardedLookaheadEmbeddingBagCollection`` replaces an ``EmbeddingBagCollection`` inside
``DistributedModelParallel``. Tables planned with TorchRec's ``CUSTOMIZED_KERNEL`` compute kernel live in a
:class:`~torchrec_lookahead.modules.CachedEmbeddingBagCollection` (host store + bounded device cache); every
other table is sharded by TorchRec's own ``ShardedEmbeddingBagCollection`` exactly as without the plugin. The
output is the KeyedTensor the unsharded collection would return (same keys, same order).

In training the cached features' values must already be cache slots and the step's plan applied
(:meth:`apply_plan`; the ``torchrec`` strategy does both for batches of a
:class:`~torchrec_lookahead.data.LookaheadDataModule`). In evaluation the values are ids: the cache is
flushed once and rows are read from the stores.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import (
    Awaitable,
    LazyAwaitable,
    NoWait,
    NullShardedModuleContext,
    ShardedModule,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_lookahead.errors import SetupError
from torchrec_lookahead.modules import CachedEmbeddingBagCollection
from torchrec_lookahead.modules.types import StagedRows
from torchrec_lookahead.oracle.types import BatchPlan

__all__ = ["ShardedLookaheadEmbeddingBagCollection", "CUSTOMIZED"]

CUSTOMIZED = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value


class _LazyNoWait(LazyAwaitable[KeyedTensor]):
    def __init__(self, value: KeyedTensor) -> None:
        super().__init__()
        self._value = value

    def _wait_impl(self) -> KeyedTensor:
        return self._value


class ShardedLookaheadEmbeddingBagCollection(
    ShardedModule[KeyedJaggedTensor, KeyedTensor, KeyedTensor, NullShardedModuleContext]
):
    """An EmbeddingBagCollection whose large tables train through the lookahead cache.

    Args:
        tables: every table of the unsharded collection, in its order.
        resident: TorchRec's sharded collection of the resident tables (``None`` when every table is cached).
        cache: the cached tables' collection.
        is_weighted: whether features carry per-id weights.
    """

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],
        resident: Optional[nn.Module],
        cache: CachedEmbeddingBagCollection,
        is_weighted: bool = False,
    ) -> None:
        super().__init__()
        self._tables = list(tables)
        self.resident = resident
        self.cache = cache
        self._is_weighted = is_weighted
        self._feature_names = [f for t in self._tables for f in t.feature_names]
        self._dims = [t.embedding_dim for t in self._tables for _ in t.feature_names]
        self._cached_features = set(cache.feature_names)
        self._resident_features = [f for f in self._feature_names if f not in self._cached_features]
        self._plan_pending = False
        self._eval_flushed = False

    @property
    def unsharded_module_type(self) -> type:
        return EmbeddingBagCollection

    # ---------------------------------------------------------------------------------------------- plans
    @property
    def cached_tables(self) -> List[str]:
        """Names of the tables trained through the cache."""
        return sorted(self.cache.capacity)

    def apply_plan(self, plan: BatchPlan, staged: Optional[StagedRows] = None) -> None:
        """Apply the cached tables' part of a step's plan (write-backs, then loads)."""
        mine = {t: p for t, p in plan.tables.items() if t in self.cache.capacity}
        sub = BatchPlan(plan.step, mine)
        sub_staged = None
        if staged is not None:
            sub_staged = StagedRows(staged.step, {t: r for t, r in staged.tables.items() if t in mine})
        self.cache.apply_plan(sub, sub_staged)
        self._plan_pending = True
        self._eval_flushed = False

    def flush(self) -> None:
        """Write every cached row and its optimizer state back to the stores."""
        self.cache.flush()

    # ---------------------------------------------------------------------------------- ShardedModule API
    def create_context(self) -> NullShardedModuleContext:
        return NullShardedModuleContext()

    def input_dist(
        self, ctx: NullShardedModuleContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        return NoWait(NoWait(features))

    def compute(self, ctx: NullShardedModuleContext, dist_input: KeyedJaggedTensor) -> KeyedTensor:
        parts: Dict[str, torch.Tensor] = {}
        if self._resident_features:
            assert self.resident is not None
            kjt = _select(dist_input, self._resident_features)
            out = self.resident(kjt)
            out = out.wait() if hasattr(out, "wait") else out
            parts.update(out.to_dict())
        cached_features = [f for f in self._feature_names if f in self._cached_features]
        if cached_features:
            kjt = _select(dist_input, cached_features)
            if self.training:
                if not self._plan_pending:
                    raise SetupError(
                        "A training forward reached the lookahead cache without a plan for the step: wrap the "
                        "DataModule in LookaheadDataModule and train with strategy='torchrec' (or call "
                        "apply_plan() and feed slot-remapped features yourself)"
                    )
                self._plan_pending = False
                parts.update(self.cache(kjt).to_dict())
            else:
                parts.update(self._eval_lookup(kjt).to_dict())
        values = torch.cat([parts[f] for f in self._feature_names], dim=1)
        return KeyedTensor(keys=list(self._feature_names), length_per_key=list(self._dims), values=values)

    def output_dist(self, ctx: NullShardedModuleContext, output: KeyedTensor) -> LazyAwaitable[KeyedTensor]:
        return _LazyNoWait(output)

    # ------------------------------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def _eval_lookup(self, kjt: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of ids (not slots), read from the stores after one flush per evaluation."""
        if not self._eval_flushed:
            self.cache.flush()
            self._eval_flushed = True
        stores = self.cache.stores
        f2t = self.cache.feature_to_table
        configs = {c.name: c for c in self.cache.embedding_bag_configs()}
        outs: List[torch.Tensor] = []
        dims: List[int] = []
        for name, jt in kjt.to_dict().items():
            table = f2t[name]
            cfg = configs[table]
            ids = jt.values().to(torch.int64)
            uniq, inverse = torch.unique(ids, return_inverse=True)
            rows, _ = stores[table].gather(uniq)
            weights = jt.weights() if self._is_weighted else None
            mode = "mean" if cfg.pooling == PoolingType.MEAN else "sum"
            pooled = F.embedding_bag(
                inverse,
                rows.to(self.cache.device),
                offsets=jt.offsets()[:-1].to(torch.int64),
                mode=mode,
                per_sample_weights=weights,
                include_last_offset=False,
            )
            outs.append(pooled)
            dims.append(cfg.embedding_dim)
        return KeyedTensor(keys=kjt.keys(), length_per_key=dims, values=torch.cat(outs, dim=1))

    def train(self, mode: bool = True) -> ShardedLookaheadEmbeddingBagCollection:
        super().train(mode)
        if mode:
            self._eval_flushed = False
        return self


def _select(kjt: KeyedJaggedTensor, keys: List[str]) -> KeyedJaggedTensor:
    if kjt.keys() == keys:
        return kjt
    index = {k: i for i, k in enumerate(kjt.keys())}
    missing = [k for k in keys if k not in index]
    if missing:
        raise SetupError(f"features {missing} are missing from the batch (it has {kjt.keys()})")
    return kjt.permute([index[k] for k in keys])
