"""Synthetic Criteo-shaped click data, streamed and deterministic.

Each global batch ``i`` is a pure function of ``(seed, split, i)``: ids per table follow a bounded power law
(Zipf-like, exponent ``zipf_exponent``) over the table's rows, scattered over the table by a fixed bijection
so that hot ids are not simply the small ones; dense features are log-transformed counts; labels are drawn
from a fixed hidden logistic model of the ids and the dense features, so a model can learn them and AUC is
meaningful. Nothing is materialised beyond one batch.

With ``world_size`` ranks, every rank generates the same global batch of ``batch_size * world_size`` rows and
keeps its contiguous slice, so the union over ranks is the one-process stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch.utils.data import IterableDataset
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead._checks import check_int, check_number, is_int
from torchrec_lookahead.data.criteo_spec import (
    CRITEO_KAGGLE_CARDINALITIES,
    CRITEO_MULTI_HOT_SIZES,
    DEFAULT_CAT_NAMES,
    INT_FEATURE_COUNT,
    scaled_cardinalities,
)
from torchrec_lookahead.errors import ConfigError

__all__ = ["SyntheticCriteoConfig", "CriteoSyntheticDataset", "hidden_row_weight"]

_SPLIT_SALT = {"train": 0, "val": 1_000_003, "test": 2_000_029}
_MASK32 = (1 << 32) - 1
#: ids whose integer steps (clamp, scatter over the table, hash) are computed together
_CHUNK = 16384


def hidden_row_weight(ids: torch.Tensor, table: int, seed: int) -> torch.Tensor:
    """The hidden model's weight of each id of one table: a hash of (seed, table, id) mapped to [-1, 1).

    Args:
        ids: int64 ids.
        table: table index.
        seed: data seed.

    Returns:
        float32 tensor of ``ids``'s shape.

    Example:
        >>> w = hidden_row_weight(torch.arange(4), table=0, seed=0)
        >>> bool(((w >= -1) & (w < 1)).all())
        True
    """
    return _hidden_weight(ids, (table + 1) * 0x85EBCA77, seed)


def _hidden_weight(ids: torch.Tensor, table_salt: Union[int, torch.Tensor], seed: int) -> torch.Tensor:
    """:func:`hidden_row_weight` with the table's salt ``(table + 1) * 0x85EBCA77`` given, or one per id (the
    ids of several tables at once): integer arithmetic, then exact float steps, so each id's weight is the same
    whichever ids it is computed with."""
    x = (ids * 0x9E3779B1 + table_salt + seed * 0xC2B2AE3D) & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    x = x ^ (x >> 16)
    return (x.to(torch.float64) / float(1 << 32) * 2.0 - 1.0).to(torch.float32)


def _coprime_multiplier(n: int, seed: int) -> int:
    """A multiplier coprime with ``n``, so ``(a * r + b) % n`` is a bijection on ``range(n)``."""
    a = (0x5BD1E995 + 2 * seed + 1) % n if n > 1 else 1
    a = max(a, 1)
    while math.gcd(a, n) != 1:
        a += 1
    return a


@dataclass
class SyntheticCriteoConfig:
    """Shape of the synthetic Criteo-like stream.

    Args:
        batch_size: rows per batch on each rank.
        num_batches: batches per epoch of the split.
        scale: factor applied to the published Kaggle table sizes (large tables only, see
            :func:`~torchrec_lookahead.data.criteo_spec.scaled_cardinalities`).
        min_rows: smallest scaled table.
        num_embeddings: explicit rows per table (overrides ``scale``); length 26.
        zipf_exponent: power-law exponent of id popularity per table (Criteo is about 1.05).
        multi_hot: ``None`` for single-hot, an int pooling factor for every table, a list of 26 factors,
            or ``"mlperf"`` for MLPerf DLRM-DCNv2's sizes.
        seed: data seed (ids, labels and the hidden model).
        world_size: ranks sharing each global batch.
        rank: this rank's slice.

    Example:
        >>> cfg = SyntheticCriteoConfig(batch_size=4, num_batches=2, scale=0.0001, min_rows=2)
        >>> len(cfg.table_sizes())
        26
    """

    batch_size: int = 2048
    num_batches: int = 100
    scale: float = 0.01
    min_rows: int = 1000
    num_embeddings: Optional[List[int]] = None
    zipf_exponent: float = 1.05
    multi_hot: Optional[Union[int, List[int], str]] = None
    seed: int = 0
    world_size: int = 1
    rank: int = 0
    feature_names: List[str] = field(default_factory=lambda: list(DEFAULT_CAT_NAMES))

    def __post_init__(self) -> None:
        check_int("batch_size", self.batch_size, 1, "give the rows of a batch")
        check_int("num_batches", self.num_batches, 0, "give the batches of the split")
        check_number(
            "scale", self.scale, 0.0, "give the fraction of the Criteo Kaggle table sizes, e.g. 0.01"
        )
        check_int("min_rows", self.min_rows, 1, "give the fewest rows of a scaled table")
        if self.num_embeddings is None:
            scaled_cardinalities(self.scale, self.min_rows)  # the sizes' own check: scale in (0, 1]
        check_number("zipf_exponent", self.zipf_exponent, 0.0, "give the ids' power-law exponent, e.g. 1.05")
        check_int("seed", self.seed, 0, "give a non-negative seed")
        if not (0 <= self.rank < self.world_size):
            raise ConfigError(
                f"Expected 0 <= rank < world_size but got rank={self.rank}, world={self.world_size}"
            )
        if len(self.feature_names) != len(CRITEO_KAGGLE_CARDINALITIES):
            raise ConfigError(
                f"Expected {len(CRITEO_KAGGLE_CARDINALITIES)} feature names but got {len(self.feature_names)}"
            )
        if self.num_embeddings is not None:
            if len(self.num_embeddings) != len(self.feature_names):
                raise ConfigError(
                    f"Expected num_embeddings to list {len(self.feature_names)} table sizes but got "
                    f"{len(self.num_embeddings)}"
                )
            for name, n in zip(self.feature_names, self.num_embeddings):
                if not is_int(n) or n < 1:
                    raise ConfigError(
                        f"Table size for feature '{name}' must be a positive integer but got {n}; "
                        "every table needs at least one row"
                    )
        self.pooling_factors()  # validates multi_hot

    def table_sizes(self) -> List[int]:
        """Rows per table, in feature order."""
        if self.num_embeddings is not None:
            return list(self.num_embeddings)
        return scaled_cardinalities(self.scale, self.min_rows)

    def pooling_factors(self) -> List[int]:
        """Ids per sample per feature (all 1 when single-hot)."""
        n = len(self.feature_names)
        mh = self.multi_hot
        if mh is None:
            return [1] * n
        if isinstance(mh, str):
            if mh != "mlperf":
                raise ConfigError(f"Expected multi_hot to be None, an int, a list or 'mlperf' but got {mh!r}")
            return list(CRITEO_MULTI_HOT_SIZES)
        if isinstance(mh, int):
            if mh < 1:
                raise ConfigError(f"Expected multi_hot >= 1 but got {mh}")
            return [mh] * n
        if len(mh) != n or any(int(p) < 1 for p in mh):
            raise ConfigError(f"Expected multi_hot to list {n} positive pooling factors but got {mh}")
        return [int(p) for p in mh]


class CriteoSyntheticDataset(IterableDataset):
    """Iterable of TorchRec :class:`~torchrec.datasets.utils.Batch` es, one batch per item.

    Args:
        config: the stream's shape.
        split: ``"train"``, ``"val"`` or ``"test"`` (independent streams).
        start_batch: first batch index to yield (resume).

    Example:
        >>> ds = CriteoSyntheticDataset(SyntheticCriteoConfig(batch_size=4, num_batches=2, scale=0.0001))
        >>> b = next(iter(ds))
        >>> tuple(b.dense_features.shape), len(b.sparse_features.keys()), tuple(b.labels.shape)
        ((4, 13), 26, (4,))
    """

    #: each rank reads only its own part of every global batch (see ``rank`` / ``world_size``)
    splits_by_rank = True

    def __init__(self, config: SyntheticCriteoConfig, split: str = "train", start_batch: int = 0) -> None:
        super().__init__()
        if split not in _SPLIT_SALT:
            raise ConfigError(f"Expected split in {sorted(_SPLIT_SALT)} but got {split!r}")
        self.config = config
        self.split = split
        self.start_batch = start_batch
        self._sizes = config.table_sizes()
        self._pool = config.pooling_factors()
        self._mult = [_coprime_multiplier(n, config.seed + t) for t, n in enumerate(self._sizes)]
        g = torch.Generator().manual_seed(config.seed * 7919 + 17)
        self._dense_w = torch.randn(INT_FEATURE_COUNT, generator=g) * 0.25
        self._table_w = 1.0 + torch.rand(len(self._sizes), generator=g)
        self._logit_scale = [2.2 * self._table_w[t] for t in range(len(self._sizes))]
        self._constants: Optional[Tuple[int, torch.Tensor]] = None

    def __len__(self) -> int:
        return self.config.num_batches

    def global_batch_size(self) -> int:
        """Rows of one global batch (all ranks)."""
        return self.config.batch_size * self.config.world_size

    def _ranks(self, table: int, count: int, g: torch.Generator) -> torch.Tensor:
        """``count`` popularity ranks of one table's ids, from ``g``: the inverse CDF of a power law on
        ``[1, n + 1)``, rank = x - 1, not yet clamped to the table."""
        n = self._sizes[table]
        s = self.config.zipf_exponent
        u = torch.rand(count, generator=g, dtype=torch.float64)
        if abs(s - 1.0) < 1e-9:
            x = torch.exp(u * math.log(n + 1.0))
        else:
            a = 1.0 - s
            x = (1.0 + u * ((n + 1.0) ** a - 1.0)) ** (1.0 / a)
        return x.floor().to(torch.int64) - 1

    def batch(self, index: int) -> Batch:
        """The local slice of global batch ``index``."""
        cfg = self.config
        g = torch.Generator().manual_seed(
            cfg.seed * 1_000_000_007 + _SPLIT_SALT[self.split] + index * 7_368_787
        )
        rows = self.global_batch_size()
        counts = torch.rand(rows, INT_FEATURE_COUNT, generator=g).mul_(-1).log1p_().mul_(-8.0)
        dense = torch.log1p(counts.floor_())
        logit = torch.full((rows,), -1.4)
        logit += (dense - 1.0) @ self._dense_w
        # Each table's draws from g, in table order, and their floating-point steps table by table; the integer
        # steps (clamp, scatter over the table, the hidden model's hash) for the ids of every table together,
        # each id with its table's constants beside it. Every step is per id, so the result is the same.
        sizes = [rows * pool for pool in self._pool]
        ranks = torch.cat([self._ranks(t, size, g) for t, size in enumerate(sizes)])
        per_id = self._per_id_constants(rows)
        ids, weights = torch.empty_like(ranks), torch.empty(len(ranks), dtype=torch.float32)
        for start in range(0, len(ranks), _CHUNK):  # each step is per id: chunks only keep them in cache
            part, c = slice(start, start + _CHUNK), per_id[:, start : start + _CHUNK]
            ids[part] = (torch.minimum(ranks[part].clamp_(min=0), c[0] - 1) * c[1] + c[2]) % c[0]
            weights[part] = _hidden_weight(ids[part], c[3], cfg.seed)
        per_table = ids.split(sizes)
        for t, (pool, w) in enumerate(zip(self._pool, weights.split(sizes))):
            mean = w if pool == 1 else w.view(rows, pool).mean(dim=1)
            logit += self._logit_scale[t] * mean / math.sqrt(len(self._pool))
        labels = torch.bernoulli(torch.sigmoid(logit), generator=g)
        lo, hi = cfg.rank * cfg.batch_size, (cfg.rank + 1) * cfg.batch_size
        values = torch.cat(
            [t_ids.view(rows, pool)[lo:hi].reshape(-1) for t_ids, pool in zip(per_table, self._pool)]
        )
        lengths = torch.cat([torch.full((cfg.batch_size,), pool, dtype=torch.int32) for pool in self._pool])
        kjt = KeyedJaggedTensor(keys=list(cfg.feature_names), values=values, lengths=lengths)
        return Batch(
            dense_features=dense[lo:hi].contiguous(), sparse_features=kjt, labels=labels[lo:hi].contiguous()
        )

    def _per_id_constants(self, rows: int) -> torch.Tensor:
        """For the ids of a global batch of ``rows`` rows, table after table: each id's table size, its
        table's multiplier and offset (the bijection that scatters popularity ranks over the table) and its
        table's salt in the hidden model's hash; (4, ids), kept for the batch size last asked."""
        if self._constants is None or self._constants[0] != rows:
            cfg = self.config
            per_table = torch.tensor(
                [
                    [n, self._mult[t], (cfg.seed * 104729 + t * 1299709) % n, (t + 1) * 0x85EBCA77]
                    for t, n in enumerate(self._sizes)
                ],
                dtype=torch.int64,
            )
            repeats = torch.tensor([rows * pool for pool in self._pool])
            self._constants = (rows, per_table.repeat_interleave(repeats, dim=0).t().contiguous())
        return self._constants[1]

    def __iter__(self) -> Iterator[Batch]:
        for i in range(self.start_batch, self.config.num_batches):
            yield self.batch(i)

    def num_embeddings_per_feature(self) -> Dict[str, int]:
        """Rows of each feature's table."""
        return dict(zip(self.config.feature_names, self._sizes))
