"""A sequence recommender as a LightningModule: a target item scored against the user's history.

The history (``EmbeddingCollection``: one embedding per id, unpooled) and the target share one table; the
history is pooled by attention on the target (DIN's idea: softmax over the history of ``<h_i, t> / sqrt(D)``)
or by its mean. The other sparse features go through an ``EmbeddingBagCollection``; the dense features are
projected to the embedding width. An MLP over [dense, pooled features, target, pooled history] gives the logit::

    sparse KJT --+-- EmbeddingBagCollection(user, genres, ...)  -> (B, F * D) -----------------+
                 +-- EmbeddingCollection(movie, history)        -> movie (B, D) ----------------+-> MLP -> logit
                                                                  history (L_b, D) per sample --+
                                                                  attention on movie -> (B, D) -+
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mlp import MLP
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from torchrec_lookahead.errors import ConfigError, DataError
from torchrec_lookahead.models.base import TorchRecModule, require_positive
from torchrec_lookahead.optim import DenseOptimizerSpec, EmbeddingOptimizerSpec

__all__ = ["SequenceModule", "SequenceNet", "POOLINGS"]

POOLINGS = ("attention", "mean")
"""How :class:`SequenceModule` pools a history."""


def pool_history(history: JaggedTensor, target: torch.Tensor, pooling: str) -> torch.Tensor:
    """(B, D) pooled history: attention on ``target`` (B, D) or the mean; zeros for an empty history.

    Example:
        >>> h = JaggedTensor(values=torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]]), lengths=torch.tensor([2, 0, 1]))
        >>> pool_history(h, torch.zeros(3, 2), "mean").tolist()
        [[0.5, 0.5], [0.0, 0.0], [2.0, 2.0]]
    """
    lengths = history.lengths().to(torch.int64)
    values = history.values()
    b, d = target.shape
    seg = torch.repeat_interleave(torch.arange(b, device=values.device), lengths, output_size=values.shape[0])
    if pooling == "mean":
        weights = (1.0 / lengths.clamp(min=1).to(values.dtype)).index_select(0, seg)
    else:
        scores = (values * target.index_select(0, seg)).sum(1) / math.sqrt(d)
        top = torch.full((b,), float("-inf"), device=values.device, dtype=values.dtype)
        top = top.scatter_reduce(0, seg, scores, reduce="amax")
        e = torch.exp(scores - top.index_select(0, seg))
        weights = e / torch.zeros(b, device=values.device, dtype=values.dtype).index_add(
            0, seg, e
        ).index_select(0, seg)
    return torch.zeros(b, d, device=values.device, dtype=values.dtype).index_add(
        0, seg, values * weights.unsqueeze(1)
    )


class SequenceNet(nn.Module):
    """The TorchRec model of :class:`SequenceModule`, called as ``net(dense_features, sparse_features)``.

    Args:
        ebc: the pooled features' collection (``None`` when there are none).
        ec: the sequence collection: per table, a target feature first, then its history features.
        num_dense_features: dense inputs per sample.
        over_arch_layer_sizes: MLP widths; the last is the output (1).
        pooling: ``attention`` or ``mean``.
        device: where the dense layers live.
    """

    def __init__(
        self,
        ebc: Optional[EmbeddingBagCollection],
        ec: EmbeddingCollection,
        num_dense_features: int,
        over_arch_layer_sizes: List[int],
        pooling: str,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        self.ebc = ebc
        self.ec = ec
        self.pooling = pooling
        dim = ec.embedding_dim()
        self._bag_features = [f for c in ebc.embedding_bag_configs() for f in c.feature_names] if ebc else []
        self._pairs = [(c.feature_names[0], h) for c in ec.embedding_configs() for h in c.feature_names[1:]]
        self._seq_features = [f for c in ec.embedding_configs() for f in c.feature_names]
        bag_dims = (
            sum(c.embedding_dim * len(c.feature_names) for c in ebc.embedding_bag_configs()) if ebc else 0
        )
        targets = len({t for t, _ in self._pairs})
        width = dim + bag_dims + dim * (targets + len(self._pairs))
        self.dense_proj = nn.Linear(num_dense_features, dim, device=device)
        self.over = nn.Sequential(
            MLP(width, over_arch_layer_sizes[:-1], device=device)
            if len(over_arch_layer_sizes) > 1
            else nn.Identity(),
            nn.Linear(([width] + over_arch_layer_sizes)[-2], over_arch_layer_sizes[-1], device=device),
        )

    def forward(self, dense_features: torch.Tensor, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        """(B, 1) logits.

        Raises:
            DataError: a target feature does not hold exactly one id per sample.
        """
        keys = sparse_features.keys()
        order = self._bag_features + self._seq_features
        missing = [f for f in order if f not in keys]
        if missing:
            raise DataError(f"features {missing} are missing from the batch (it has {keys})")
        kjt = sparse_features.permute([keys.index(f) for f in order])
        bags, seq = kjt.split([len(self._bag_features), len(self._seq_features)])
        parts = [self.dense_proj(dense_features)]
        if self.ebc is not None:
            pooled = self.ebc(bags)
            if pooled.keys() == self._bag_features:
                parts.append(pooled.values())
            else:  # TorchRec's sharded collection orders its output by shard (several ranks): by feature here
                parts.extend(pooled[f] for f in self._bag_features)
        out = self.ec(seq)
        b = dense_features.shape[0]
        targets: Dict[str, torch.Tensor] = {}
        for t, h in self._pairs:
            if t not in targets:
                lengths = out[t].lengths()
                if lengths.numel() != b or bool((lengths != 1).any()):
                    raise DataError(
                        f"target feature '{t}' must hold one id per sample but has lengths {lengths.tolist()}"
                    )
                targets[t] = out[t].values()
                parts.append(targets[t])
            parts.append(pool_history(out[h], targets[t], self.pooling))
        return self.over(torch.cat(parts, dim=1))


class SequenceModule(TorchRecModule):
    """A target item scored against the user's history (see the module doc), on batches of
    :class:`~torchrec.datasets.utils.Batch` with binary labels (e.g.
    :class:`~torchrec_lookahead.data.MovieLensHistoryDataModule`).

    Args:
        num_embeddings_per_feature: rows of each sparse feature's table (the CLI links it from the data);
            history features share their target's table.
        num_dense_features: dense inputs per sample.
        embedding_dim: embedding width.
        history_features: history feature -> its target feature (one sequence table ``t_<target>`` each).
        pooling: ``attention`` (on the target) or ``mean``.
        over_arch_layer_sizes: MLP widths; the last must be 1.
        embedding_optimizer: the embedding tables' optimizer.
        dense_optimizer: the dense layers' optimizer.

    Raises:
        ConfigError: an unknown pooling or feature, a width below 1, an output width other than 1.

    Example:
        >>> m = SequenceModule({"user": 10, "movie": 50, "history": 50}, 1, embedding_dim=4,
        ...                    over_arch_layer_sizes=[8, 1])
        >>> m.configure_model()
        >>> kjt = KeyedJaggedTensor(["user", "movie", "history"], torch.tensor([1, 2, 3, 4, 5, 6, 7]),
        ...                         lengths=torch.tensor([1, 1, 1, 1, 3, 0]))
        >>> tuple(m(torch.zeros(2, 1), kjt).shape)
        (2,)
    """

    def __init__(
        self,
        num_embeddings_per_feature: Optional[Dict[str, int]] = None,
        num_dense_features: int = 1,
        embedding_dim: int = 16,
        history_features: Optional[Dict[str, str]] = None,
        pooling: str = "attention",
        over_arch_layer_sizes: Optional[List[int]] = None,
        embedding_optimizer: Optional[EmbeddingOptimizerSpec] = None,
        dense_optimizer: Optional[DenseOptimizerSpec] = None,
    ) -> None:
        super().__init__(
            num_embeddings_per_feature,
            num_dense_features,
            embedding_dim,
            embedding_optimizer,
            dense_optimizer,
        )
        if pooling not in POOLINGS:
            raise ConfigError(f"pooling must be one of {list(POOLINGS)} but got {pooling!r}")
        sizes = list(over_arch_layer_sizes or [64, 32, 1])
        require_positive(**{f"over_arch_layer_sizes[{i}]": s for i, s in enumerate(sizes)})
        if sizes[-1] != 1:
            raise ConfigError(f"over_arch_layer_sizes must end in 1 (the logit) but ends in {sizes[-1]}")
        hist = dict(history_features or {"history": "movie"})
        known = {f for c in self.tables for f in c.feature_names}
        unknown = sorted((set(hist) | set(hist.values())) - known)
        if unknown or set(hist) & set(hist.values()):
            raise ConfigError(
                f"history_features {hist} must map history features to target features of the data; unknown "
                f"{unknown}, the data's features are {sorted(known)}"
            )
        by_feature = {c.feature_names[0]: c for c in self.tables}
        self.sequence_tables = [
            EmbeddingConfig(
                name=f"t_{target}",
                embedding_dim=embedding_dim,
                num_embeddings=by_feature[target].num_embeddings,
                feature_names=[target, *[h for h, t in hist.items() if t == target]],
            )
            for target in dict.fromkeys(hist.values())
        ]
        sequence = {f for c in self.sequence_tables for f in c.feature_names}
        self.tables = [c for c in self.tables if c.feature_names[0] not in sequence]
        self.pooling = pooling
        self.over_arch_layer_sizes = sizes

    def build_model(self, device: torch.device, dense_device: Optional[torch.device] = None) -> SequenceNet:
        """The unsharded :class:`SequenceNet`, tables on ``device``, dense layers on ``dense_device``."""
        ebc = EmbeddingBagCollection(tables=self.tables, device=device) if self.tables else None
        ec = EmbeddingCollection(tables=self.sequence_tables, device=device)
        return SequenceNet(
            ebc, ec, self.num_dense_features, self.over_arch_layer_sizes, self.pooling, dense_device or device
        )
