"""CachedEmbeddingCollection: a TorchRec ``EmbeddingCollection`` (unpooled, sequence embeddings) whose large
tables live in host stores.

Everything but the lookup's output is :class:`~torchrec_lookahead.modules.CachedCollection`'s, as for its
sibling :class:`~torchrec_lookahead.modules.CachedEmbeddingBagCollection`: the same slots, stores, plans,
staging, checks, statistics and checkpoints (``embeddings.<table>.weight`` and its state). The kernel is
FBGEMM's TBE with ``PoolingMode.NONE`` (what TorchRec's FUSED kernel runs for an ``EmbeddingCollection``; one
TBE per embedding dimension, as TorchRec groups them), which returns one row per id and applies the fused
sparse optimizer in backward, so a row's gradients are summed and applied exactly as TorchRec's resident
collection does.

Output: as ``EmbeddingCollection.forward``, a dict feature name -> ``JaggedTensor`` whose values are the
(number of ids, D) embeddings of the feature's ids, with the batch's lengths::

    features  f0: [[42, 7], [42]]        ->   {"f0": JaggedTensor(values=(3, D) rows of ids 42, 7, 42,
                                                                   lengths=[2, 1])}
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.modules.cached_collection import CachedCollection
from torchrec_lookahead.modules.config import CacheLayout, CacheOptimizerConfig
from torchrec_lookahead.store import EmbeddingStore

__all__ = ["CachedEmbeddingCollection"]


class CachedEmbeddingCollection(CachedCollection[EmbeddingConfig, Dict[str, JaggedTensor]]):
    """EmbeddingCollection with a bounded device cache per large table, exactly equal to resident training.

    Args:
        tables: table configs, as for ``torchrec.EmbeddingCollection`` (float32).
        capacity: table name -> cache rows; tables absent are resident (full size on the device, no store).
        optimizer: the fused sparse optimizer (default row-wise Adagrad, lr 0.01).
        stores: table name -> store for cached tables; default a :class:`~torchrec_lookahead.store.TensorStore`
            per cached table.
        seed: seed of the initial values, for stores created here and for resident tables.
        device: device of the cache (default CPU).
        cache_layout: ``"pooled"`` (default, the cached tables of one dimension share one cache) or
            ``"per_table"``, as :class:`~torchrec_lookahead.modules.CachedEmbeddingBagCollection`'s.

    Raises:
        ConfigError: as :class:`~torchrec_lookahead.modules.CachedCollection`, and a table config that is an
            ``EmbeddingBagConfig`` (pooled: use :class:`~torchrec_lookahead.modules.CachedEmbeddingBagCollection`).

    Example:
        >>> from torchrec import EmbeddingConfig
        >>> from torchrec_lookahead.oracle.types import BatchPlan, TablePlan
        >>> tables = [EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=100, feature_names=["f0"])]
        >>> ec = CachedEmbeddingCollection(tables, capacity={"t0": 8},
        ...     optimizer=CacheOptimizerConfig("exact_sgd", learning_rate=0.1))
        >>> kjt = KeyedJaggedTensor.from_lengths_sync(["f0"], torch.tensor([42, 7, 42]), torch.tensor([2, 1]))
        >>> e = torch.empty(0, dtype=torch.long)
        >>> plan = BatchPlan(0, {"t0": TablePlan(e, e, torch.tensor([7, 42]), torch.tensor([0, 1]),
        ...                                      torch.tensor([1, 0, 1]))})
        >>> ec.apply_plan(plan)
        >>> out = ec(ec.remap(kjt, plan))
        >>> tuple(out["f0"].values().shape), out["f0"].lengths().tolist()
        ((3, 4), [2, 1])
        >>> out["f0"].values().sum().backward()
        >>> ec.flush()
        >>> ec.stats()["t0"]["rows_fetched"]
        2
    """

    _COLLECTION = "embeddings"

    def __init__(
        self,
        tables: Sequence[EmbeddingConfig],
        capacity: Mapping[str, int],
        optimizer: Optional[CacheOptimizerConfig] = None,
        stores: Optional[Mapping[str, EmbeddingStore]] = None,
        seed: int = 0,
        device: Optional[torch.device] = None,
        cache_layout: Union[CacheLayout, str] = CacheLayout.POOLED,
    ) -> None:
        super().__init__(
            tables,
            capacity,
            optimizer=optimizer,
            stores=stores,
            seed=seed,
            device=device,
            cache_layout=cache_layout,
        )

    @classmethod
    def _kernel_group(cls, cfg: Any) -> Tuple[PoolingMode, int]:
        # FBGEMM's unpooled TBE returns (ids, D): one kernel per dimension, as TorchRec groups its tables
        return (PoolingMode.NONE, int(cfg.embedding_dim))

    def _check_table(self, cfg: Any) -> None:
        if not isinstance(cfg, EmbeddingConfig):
            raise ConfigError(
                f"table '{cfg.name}' is a {type(cfg).__name__}; an embedding collection takes EmbeddingConfig "
                "(pooled tables: CachedEmbeddingBagCollection)"
            )

    def embedding_configs(self) -> List[EmbeddingConfig]:
        """The table configs, as ``EmbeddingCollection.embedding_configs()``."""
        return self.table_configs()

    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        """Per feature, the embeddings of its ids; cached features' values must already be slots.

        Args:
            features: KJT with every feature of the collection (extra keys are ignored); values of cached
                tables' features are cache slots (:meth:`remap`), the others ids.

        Returns:
            Feature name -> ``JaggedTensor`` with values (number of ids, D) and the feature's lengths, in
            :attr:`feature_names` order.

        Raises:
            DataError, InvalidIdError, CapacityError, SetupError: as
                :meth:`~torchrec_lookahead.modules.CachedEmbeddingBagCollection.forward`.
        """
        found: Dict[str, JaggedTensor] = {}
        for kjt, rows in self._lookups(features):
            start = 0
            for key, n, jt in zip(kjt.keys(), kjt.length_per_key(), kjt.to_dict().values()):
                found[key] = JaggedTensor(values=rows[start : start + n], lengths=jt.lengths())
                start += n
        return {f: found[f] for f in self._feature_names}
