"""The sparse-input sampler and embedding logger: a seeded sample of training batches and its access counts.

The sample is drawn by batch. A dataset with random access (a ``batch(index)`` method and ``__len__``, as
:class:`~torchrec_lookahead.data.CriteoSyntheticDataset` has) is read only at the drawn batches; any other
sized iterable of batches is read in order and only the drawn ones are kept (an unsized one keeps each
batch with probability ``fraction``, and always its first). Counts are direct-address arrays
(one int64 per row), built with one vectorised ``bincount`` per table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch
from torchrec.datasets.utils import Batch

from torchrec_lookahead.errors import ConfigError, DataError, InvalidIdError

__all__ = ["SampledAccesses", "sample_batches", "check_ids"]


def _draw(total: int, fraction: float, seed: int) -> List[int]:
    k = max(1, round(fraction * total))
    g = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(total, generator=g)[:k].tolist())


def sample_batches(source: Any, fraction: float, seed: int) -> Tuple[List[Batch], int]:
    """A seeded sample of ``round(fraction * len)`` batches (at least one) and the number of batches in all.

    Args:
        source: a dataset with ``batch(i)`` and ``__len__`` (random access), or any sized iterable of batches.
        fraction: share of the batches to draw, in (0, 1].
        seed: seed of the draw.

    Raises:
        DataError: the source holds no batches.
    """
    total: Optional[int]
    try:
        total = len(source)
    except TypeError:
        total = None
    if total == 0:
        raise DataError(
            "Calibration needs training data but the dataset is empty; give the DataModule training batches"
        )
    if total is not None and callable(getattr(source, "batch", None)):
        return [source.batch(i) for i in _draw(total, fraction, seed)], total
    if total is None:
        g = torch.Generator().manual_seed(seed)
        kept: List[Batch] = []
        seen = 0
        for b in source:
            seen += 1
            if float(torch.rand(1, generator=g)) < fraction or (not kept and seen == 1):
                kept.append(b)
        if not kept:
            raise DataError("Calibration needs training data but the dataset yielded no batches")
        return kept, seen
    picks = set(_draw(total, fraction, seed))
    kept = [b for i, b in enumerate(source) if i in picks]
    if not kept:
        raise DataError("Calibration needs training data but the dataset yielded no batches")
    return kept, total


def check_ids(feature: str, values: torch.Tensor, num_rows: int) -> None:
    """Raise :class:`InvalidIdError` when an id of ``feature`` is negative or not below ``num_rows``."""
    if values.numel() == 0:
        return
    lo, hi = int(values.min()), int(values.max())
    if lo < 0 or hi >= num_rows:
        bad = lo if lo < 0 else hi
        raise InvalidIdError(
            f"Feature '{feature}' has id {bad} but its table has {num_rows} rows (valid ids 0..{num_rows - 1}); "
            "fix the data or the table size",
            id=bad,
            num_rows=num_rows,
        )


@dataclass
class SampledAccesses:
    """Per-table access counts of the sampled batches, and the sampled ids (for the hot sample share).

    Attributes:
        num_embeddings: rows per feature's table, in feature order.
        counts: per feature, accesses per row (int64, direct address).
        values: per feature, the sampled ids of each batch.
        lengths: per feature, ids per sample of each batch.
        num_samples: samples in the sampled batches.
        batches_read: batches sampled.
        batches_total: batches in the dataset.
    """

    num_embeddings: Dict[str, int]
    counts: Dict[str, torch.Tensor] = field(default_factory=dict)
    values: Dict[str, List[torch.Tensor]] = field(default_factory=dict)
    lengths: Dict[str, List[torch.Tensor]] = field(default_factory=dict)
    num_samples: int = 0
    batches_read: int = 0
    batches_total: int = 0

    @classmethod
    def collect(
        cls, batches: Iterable[Batch], num_embeddings: Mapping[str, int], batches_total: int = 0
    ) -> SampledAccesses:
        """Count the accesses of ``batches`` into tables of ``num_embeddings`` rows (feature -> rows).

        Raises:
            ConfigError: a batch's features differ from the tables'.
            InvalidIdError: an id is out of its table's range.
            DataError: no samples.

        Example:
            >>> from torchrec import KeyedJaggedTensor
            >>> kjt = KeyedJaggedTensor(keys=["a"], values=torch.tensor([1, 1, 3]), lengths=torch.tensor([1, 2]))
            >>> b = Batch(dense_features=torch.zeros(2, 1), sparse_features=kjt, labels=torch.zeros(2))
            >>> SampledAccesses.collect([b], {"a": 4}).counts["a"].tolist()
            [0, 2, 0, 1]
        """
        out = cls(num_embeddings=dict(num_embeddings), batches_total=batches_total)
        names = list(out.num_embeddings)
        for f in names:
            out.values[f] = []
            out.lengths[f] = []
        for batch in batches:
            per = batch.sparse_features.to_dict()
            if set(per) != set(names):
                raise ConfigError(
                    f"The batches have features {sorted(per)} but the tables are for {sorted(names)}; "
                    "calibrate with the model's DataModule"
                )
            for f in names:
                v = per[f].values().to(torch.int64)
                check_ids(f, v, out.num_embeddings[f])
                out.values[f].append(v)
                out.lengths[f].append(per[f].lengths().to(torch.int64))
            out.num_samples += int(batch.labels.numel())
            out.batches_read += 1
        if out.num_samples == 0:
            raise DataError(
                "Calibration needs training data but the sampled batches hold no samples; give the DataModule "
                "training batches"
            )
        for f in names:
            out.counts[f] = torch.bincount(torch.cat(out.values[f]), minlength=out.num_embeddings[f])
        return out

    @classmethod
    def from_counts(cls, counts: Mapping[str, torch.Tensor], num_samples: int) -> SampledAccesses:
        """Accesses known only by their per-row counts (``feature -> int64 per row``) over ``num_samples``
        samples, e.g. the exact counts of a whole epoch; the ids per sample are not kept, so the sample share is
        not estimated from them.

        Example:
            >>> SampledAccesses.from_counts({"a": torch.tensor([0, 2, 0, 1])}, 3).accesses("a")
            3
        """
        names = list(counts)
        return cls(
            num_embeddings={f: int(counts[f].numel()) for f in names},
            counts={f: counts[f].to(torch.int64) for f in names},
            values={f: [] for f in names},
            lengths={f: [] for f in names},
            num_samples=int(num_samples),
        )

    def accesses(self, feature: str) -> int:
        """Sampled accesses into ``feature``'s table."""
        return int(self.counts[feature].sum())

    def cold_per_sample(self, hot: Mapping[str, torch.Tensor]) -> Iterator[torch.Tensor]:
        """For each sampled batch, the number of non-hot ids of each sample (0 means the sample is hot)."""
        from torchrec_lookahead.fae.samples import cold_ids_per_sample

        names = list(self.num_embeddings)
        for b in range(self.batches_read):
            total = torch.zeros(self.lengths[names[0]][b].numel(), dtype=torch.int64)
            for f in names:
                total = total + cold_ids_per_sample(self.values[f][b], self.lengths[f][b], hot[f])
            yield total
