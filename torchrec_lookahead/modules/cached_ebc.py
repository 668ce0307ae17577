"""CachedEmbeddingBagCollection: an EmbeddingBagCollection whose large tables live in host stores.

Everything but the lookup's output is :class:`~torchrec_lookahead.modules.CachedCollection`'s: the slots,
stores, plans, staging, checks, statistics and checkpoints (``embedding_bags.<table>.weight`` and its state). The
kernels are FBGEMM's TBE, one per pooling mode (what TorchRec's FUSED kernel runs for an
``EmbeddingBagCollection``), and the output is the ``KeyedTensor`` of pooled bags the unsharded collection
returns.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.modules.cached_collection import CachedCollection

__all__ = ["CachedEmbeddingBagCollection"]


class CachedEmbeddingBagCollection(CachedCollection[EmbeddingBagConfig, KeyedTensor]):
    """EmbeddingBagCollection with a bounded device cache per large table, exactly equal to resident training.

    Args:
        tables: table configs, as for ``torchrec.EmbeddingBagCollection`` (float32, SUM or MEAN pooling).
        capacity: table name -> cache rows; tables absent are resident (full size on the device, no store).
        optimizer: the fused sparse optimizer (default row-wise Adagrad, lr 0.01).
        stores: table name -> store for cached tables; default a :class:`~torchrec_lookahead.store.TensorStore`
            per cached table.
        seed: seed of the initial values (:func:`~torchrec_lookahead.store.init_rows`), for stores created
            here and for resident tables.
        device: device of the cache (default CPU).
        is_weighted: whether features carry per-id weights (``kjt.weights()``, SUM pooling).
        cache_layout: ``"pooled"`` (default): the cached tables of one kernel and dimension share one cache of
            the sum of their capacities (:attr:`slot_spaces`), planned jointly; ``"per_table"``: each keeps its
            own ``capacity`` rows (:class:`~torchrec_lookahead.modules.CacheLayout`).

    Raises:
        ConfigError: an unknown table in ``capacity`` or ``stores``, a duplicate name, a non-positive capacity,
            an unsupported data type or pooling, a dimension FBGEMM cannot handle, or a store whose shape or
            optimizer-state layout differs from the table's.

    Example:
        >>> import torch
        >>> from torchrec import EmbeddingBagConfig
        >>> from torchrec_lookahead.modules import CacheOptimizerConfig
        >>> from torchrec_lookahead.oracle.types import BatchPlan, TablePlan
        >>> tables = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=100, feature_names=["f0"])]
        >>> ebc = CachedEmbeddingBagCollection(tables, capacity={"t0": 8},
        ...     optimizer=CacheOptimizerConfig("exact_sgd", learning_rate=0.1))
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(["f0"], torch.tensor([42, 7, 42]), torch.tensor([2, 1]))
        >>> e = torch.empty(0, dtype=torch.long)
        >>> plan = BatchPlan(0, {"t0": TablePlan(e, e, torch.tensor([7, 42]), torch.tensor([0, 1]),
        ...                                      torch.tensor([1, 0, 1]))})
        >>> ebc.apply_plan(plan)
        >>> out = ebc(ebc.remap(kjt, plan))
        >>> out.keys(), tuple(out.values().shape)
        (['f0'], (2, 4))
        >>> out.values().sum().backward()
        >>> ebc.flush()
        >>> ebc.stats()["t0"]["rows_fetched"], ebc.slot_ids("t0")[:3].tolist()
        (2, [7, 42, -1])
    """

    _COLLECTION = "embedding_bags"

    @classmethod
    def _kernel_group(cls, cfg: Any) -> Tuple[PoolingMode, int]:
        """The kernel a table joins (one per distinct key): one per pooling mode."""
        return (PoolingMode.MEAN if cfg.pooling == PoolingType.MEAN else PoolingMode.SUM, 0)

    def _check_table(self, cfg: Any) -> None:
        """Refuse a table config the collection's kernels cannot train."""
        if cfg.pooling not in (PoolingType.SUM, PoolingType.MEAN):
            raise ConfigError(f"table '{cfg.name}' has pooling {cfg.pooling}; use SUM or MEAN")

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        """The table configs, as ``EmbeddingBagCollection.embedding_bag_configs()``."""
        return self.table_configs()

    def is_weighted(self) -> bool:
        """Whether features carry per-id weights."""
        return self._is_weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of every feature; cached features' values must already be slots.

        Args:
            features: KJT with every feature of the collection (extra keys are ignored); values of cached
                tables' features are cache slots (:meth:`remap`), the others ids.

        Returns:
            KeyedTensor with keys :attr:`feature_names`, values (B, sum of dims).

        Raises:
            DataError: a feature is missing, or weights are missing for a weighted collection.
            InvalidIdError: an id of a resident table is out of range.
            CapacityError: a slot is not below its table's capacity.
            SetupError: a slot is empty (no ``apply_plan`` loaded a row into it).
        """
        outputs = [out for _, out in self._lookups(features)]
        values = torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]
        if not self._output_order_matches:
            order = [f for fs in self._group_features for f in fs]
            starts: Dict[str, int] = {}
            col = 0
            for f in order:
                starts[f] = col
                col += self._tables[self._feature_to_table[f]].config.embedding_dim
            values = torch.cat(
                [values[:, starts[f] : starts[f] + d] for f, d in zip(self._feature_names, self._dims)], 1
            )
        return KeyedTensor(keys=list(self._feature_names), length_per_key=list(self._dims), values=values)
