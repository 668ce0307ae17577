"""The sharded EmbeddingBagCollection our sharder builds: resident tables through TorchRec, cached tables
through the cache.

``ShardedLookaheadEmbeddingBagCollection`` replaces an ``EmbeddingBagCollection`` inside
``DistributedModelParallel``. It is a :class:`~torchrec_lookahead.distributed.ShardedLookaheadCollection`
(plans, flushes, several ranks, evaluation from the stores, the fused-optimizer view) whose output is the
KeyedTensor the unsharded collection would return (same keys, same order): the resident features' pooled
embeddings from TorchRec's own ``ShardedEmbeddingBagCollection``, the cached ones' from a
:class:`~torchrec_lookahead.modules.CachedEmbeddingBagCollection`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torchrec.distributed.types import NullShardedModuleContext
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_lookahead.distributed.sharded_collection import ShardedLookaheadCollection
from torchrec_lookahead.errors import DataError, InvalidIdError
from torchrec_lookahead.modules._kernels import mean_of_sums

__all__ = ["ShardedLookaheadEmbeddingBagCollection"]


class ShardedLookaheadEmbeddingBagCollection(ShardedLookaheadCollection[EmbeddingBagConfig, KeyedTensor]):
    """An EmbeddingBagCollection whose large tables train through the lookahead cache.

    Its arguments are :class:`~torchrec_lookahead.distributed.ShardedLookaheadCollection`'s, ``tables`` the
    ``EmbeddingBagConfig`` s and ``cache`` a :class:`~torchrec_lookahead.modules.CachedEmbeddingBagCollection`.
    """

    #: per layout of the parts' outputs (their keys), the column runs that put them in output order
    _column_runs: Optional[Dict[Tuple[Tuple[str, ...], ...], List[Tuple[int, int, int]]]] = None
    #: the output's keys: the features in resident TorchRec's order where the plan gave it, else in feature order
    _out_names: Optional[List[str]] = None

    def __init__(self, *args: Any, output_order: Optional[Sequence[str]] = None, **kwargs: Any) -> None:
        """``output_order``: the keys in the order resident TorchRec training returns them (with several ranks,
        its shard order; see ``distributed/_resident_order.py``); ``None``: the collection's feature order."""
        super().__init__(*args, **kwargs)
        if output_order is not None and sorted(output_order) == sorted(self._feature_names):
            self._out_names = list(output_order)
        else:
            self._out_names = list(self._feature_names)
        dim = dict(zip(self._feature_names, self._dims))
        self._out_dims = [dim[f] for f in self._out_names]

    @property
    def unsharded_module_type(self) -> type:
        return EmbeddingBagCollection

    def compute(self, ctx: NullShardedModuleContext, dist_input: KeyedJaggedTensor) -> KeyedTensor:
        if not self._is_weighted:
            _refuse_weights(dist_input, self._feature_names)
        outs = self._part_outputs(dist_input)
        names = self._out_names or self._feature_names
        if len(outs) == 1 and outs[0].keys() == names:
            values = outs[0].values()
        else:  # to the output's order: one concatenation of column runs
            values = torch.cat([outs[i].values()[:, a:b] for i, a, b in self._runs(outs)], dim=1)
        return KeyedTensor(keys=list(names), length_per_key=list(self._out_dims), values=values)

    def _runs(self, outs: List[KeyedTensor]) -> List[Tuple[int, int, int]]:
        """(part, first column, end column) runs that, concatenated, put the parts' pooled embeddings in
        output order (consecutive features of one part form one run)."""
        layout = tuple(tuple(o.keys()) for o in outs)
        if self._column_runs is None:
            self._column_runs = {}
        runs = self._column_runs.get(layout)
        if runs is None:
            where: Dict[str, Tuple[int, int]] = {}
            for i, o in enumerate(outs):
                col = 0
                for k, d in zip(o.keys(), o.length_per_key()):
                    where[k] = (i, col)
                    col += d
            runs = []
            for f, d in zip(self._out_names or self._feature_names, self._out_dims):
                i, a = where[f]
                if runs and runs[-1][0] == i and runs[-1][2] == a:
                    runs[-1] = (i, runs[-1][1], a + d)
                else:
                    runs.append((i, a, a + d))
            self._column_runs[layout] = runs
        return runs

    def _eval_lookup(self, kjt: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of ids (not slots), read from the stores."""
        stores = self.cache.stores
        f2t = self.cache.feature_to_table
        configs = {c.name: c for c in self.cache.table_configs()}
        outs: List[torch.Tensor] = []
        dims: List[int] = []
        for name, jt in kjt.to_dict().items():
            table = f2t[name]
            cfg = configs[table]
            ids = jt.values().to(torch.int64)
            if table in stores:
                uniq, inverse = torch.unique(ids, return_inverse=True)
                rows, _ = stores[table].gather(uniq)
            else:  # a resident table trained in the cache's kernel (fuse_resident): all its rows are there
                n = cfg.num_embeddings
                if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
                    bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
                    raise InvalidIdError(
                        f"feature '{name}' of table '{table}' has id {bad} outside [0, {n}); hash or clip ids into "
                        "the table"
                    )
                inverse, rows = ids, self.cache.cache_weights(table)
            weights = jt.weights() if self._is_weighted else None
            pooled = F.embedding_bag(
                inverse.to(self.cache.device),
                rows.to(self.cache.device),
                offsets=jt.offsets()[:-1].to(torch.int64),
                mode="sum",
                per_sample_weights=weights,
                include_last_offset=False,
            )
            if cfg.pooling == PoolingType.MEAN:  # FBGEMM's mean, as training's forward computes it
                pooled = mean_of_sums(pooled, jt.lengths())
            outs.append(pooled)
            dims.append(cfg.embedding_dim)
        return KeyedTensor(keys=kjt.keys(), length_per_key=dims, values=torch.cat(outs, dim=1))


def _refuse_weights(kjt: KeyedJaggedTensor, features: List[str]) -> None:
    """Refuse per-id weights given to an unweighted collection: TorchRec's sharded kernel applies a batch's float
    weights whatever ``is_weighted`` says (its unsharded module ignores them), so resident training would weigh
    the ids and the cache would not."""
    weights = kjt.weights_or_none()
    if weights is not None and torch.is_floating_point(weights):
        named = ", ".join(features[:3]) + (f" and {len(features) - 3} more" if len(features) > 3 else "")
        raise DataError(
            f"the batch carries per-id weights but the EmbeddingBagCollection of features {named} is unweighted "
            "(is_weighted=False); drop the weights from its KeyedJaggedTensor or build it with is_weighted=True "
            "(TorchRec's sharded module applies such weights, its unsharded module ignores them)"
        )
