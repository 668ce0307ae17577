"""FAE's calibrator: sample the inputs, estimate hot-set sizes, choose the threshold, mark the hot rows.

1. *Sparse-input sampler and embedding logger* (:mod:`~torchrec_lookahead.fae.sampling`): a seeded
   ``sample_fraction`` of the training batches and their per-row access counts.
2. *Small tables*: tables whose weights are under ``small_table_bytes`` are wholly hot.
3. *Statistical optimizer*: a threshold ``t`` (a share of each table's sampled accesses; FAE's equation 1,
   ``H = t * S_I``, with ``S_I`` the table's sampled accesses, which for a single-hot table is the number of
   sampled inputs) makes a row hot when its count reaches ``H``. The Rand-Em Box bounds the hot rows of every
   large table at ``t``; the optimizer bisects ``log t`` for the smallest ``t`` whose bound, times the bytes
   of a row with its optimizer state, plus the small tables, fits ``hot_budget_bytes``.
4. *Exact marking*: one pass over the sampled counts marks the rows at or above each table's cutoff. In the
   rare case that the marked set exceeds the budget (the bound missed, at 1 - confidence odds) the threshold
   is raised, by bisection on the exact counts, until it fits. (The box draws more chunks where hot rows are
   rare, up to ``box_max_share`` of a table, so that the bound misses mostly where even those hold few.)
5. *Expected shares*: the share of accesses and of samples that the hot set will serve is estimated
   leave-one-out: a sampled access counts as hot when its row would be hot without that access (``k - 1 >=
   H``), a sample when all its ids are. Counting in-sample instead would call every sample hot at a low
   threshold (each row it reads was seen at least once: by that very sample).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch

from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.fae.config import CalibrationConfig
from torchrec_lookahead.fae.hotset import HotSet, HotTable, table_name
from torchrec_lookahead.fae.randembox import RandEmBox
from torchrec_lookahead.fae.sampling import SampledAccesses, sample_batches

__all__ = ["calibrate", "calibrate_counts", "exact_hot_rows", "rand_em_boxes", "recalibrate_counts"]

log = logging.getLogger(__name__)


def exact_hot_rows(counts: torch.Tensor, cutoff: int) -> int:
    """Rows with ``count >= cutoff``, by a full scan (the reference the Rand-Em Box is measured against)."""
    return int((counts >= cutoff).sum())


def rand_em_boxes(
    sampled: SampledAccesses, config: CalibrationConfig, features: List[str]
) -> Dict[str, RandEmBox]:
    """The Rand-Em Box of each of ``features`` over its sampled counts, with ``config``'s chunks, confidence and
    growth, drawn in that order from one generator seeded by ``config.seed`` (the calibrator's boxes)."""
    g = torch.Generator().manual_seed(config.seed + 1)
    return {
        f: RandEmBox(
            sampled.counts[f],
            config.num_chunks,
            config.chunk_rows,
            config.confidence,
            g,
            config.box_tolerance,
            config.box_max_share,
        )
        for f in features
    }


def _bisect(fits: Callable[[float], bool], lo: float, hi: float, steps: int) -> float:
    """The smallest ``t`` in ``[lo, hi]`` (to ``steps`` halvings of ``log t``) with ``fits(t)``; ``fits(hi)``
    must hold."""
    if fits(lo):
        return lo
    a, b = math.log(lo), math.log(hi)
    for _ in range(steps):
        mid = 0.5 * (a + b)
        if fits(math.exp(mid)):
            b = mid
        else:
            a = mid
    return math.exp(b)


def calibrate_counts(
    sampled: SampledAccesses, config: CalibrationConfig, started: Optional[float] = None
) -> HotSet:
    """The hot set for ``config``'s budget from sampled access counts.

    Raises:
        ConfigError: the budget cannot hold the small tables, which are hot by definition.
    """
    started = time.perf_counter() if started is None else started
    row_bytes = config.row_bytes
    features = list(sampled.num_embeddings)
    small = {f: sampled.num_embeddings[f] * config.weight_bytes < config.small_table_bytes for f in features}
    small_bytes = sum(sampled.num_embeddings[f] * row_bytes for f in features if small[f])
    if small_bytes > config.hot_budget_bytes:
        raise ConfigError(
            f"hot_budget_bytes={config.hot_budget_bytes} is below the {small_bytes} bytes the small tables (under "
            f"small_table_bytes={config.small_table_bytes}) need, and they are always hot; raise hot_budget_bytes "
            f"to at least {small_bytes} or lower small_table_bytes"
        )
    large = [f for f in features if not small[f]]
    accesses = {f: sampled.accesses(f) for f in features}
    boxes = rand_em_boxes(sampled, config, large)
    lo = 0.5 / max([accesses[f] for f in large] + [1])
    hi = 1.0 + 1e-9  # above any count: no large row is hot

    def cutoff(f: str, t: float) -> int:
        return max(1, math.ceil(t * accesses[f]))  # counts are integers: k >= t * A  <=>  k >= ceil(t * A)

    def fits_estimate(t: float) -> bool:
        rows = sum(boxes[f].estimate(cutoff(f, t)).upper for f in large)
        return small_bytes + rows * row_bytes <= config.hot_budget_bytes

    seen: Dict[str, torch.Tensor] = {}

    def rows_at(f: str, c: int) -> int:  # exact, from the sorted counts of the rows seen (cutoffs are >= 1)
        if f not in seen:
            counts = sampled.counts[f]
            seen[f] = torch.sort(counts[counts > 0]).values
        s = seen[f]
        return s.numel() - int(torch.searchsorted(s, torch.tensor([c], dtype=s.dtype)))

    def fits_exact(t: float) -> bool:
        rows = sum(rows_at(f, cutoff(f, t)) for f in large)
        return small_bytes + rows * row_bytes <= config.hot_budget_bytes

    t = _bisect(fits_estimate, lo, hi, config.search_steps)
    if not fits_exact(t):
        log.info("The marked hot set at t=%.3e exceeds the budget; raising the threshold on exact counts", t)
        t = _bisect(fits_exact, t, hi, config.search_steps)

    tables: Dict[str, HotTable] = {}
    masks: Dict[str, torch.Tensor] = {}
    for f in features:
        n = sampled.num_embeddings[f]
        counts = sampled.counts[f]
        if small[f]:
            ids = torch.arange(n, dtype=torch.int64)
            c, est = 0, n
        else:
            c = cutoff(f, t)
            ids = torch.nonzero(counts >= c).flatten()
            est = boxes[f].estimate(c).upper
        held_out = torch.ones(n, dtype=torch.bool) if small[f] else counts - 1 >= c
        hot_acc = int(counts[held_out].sum())
        tables[table_name(f)] = HotTable(
            name=table_name(f),
            feature=f,
            num_embeddings=n,
            hot_ids=ids,
            cutoff=c,
            estimated_hot_rows=int(est),
            small=small[f],
            row_bytes=row_bytes,
            sampled_accesses=accesses[f],
            hot_accesses=hot_acc,
        )
        masks[f] = held_out
    hot_samples = sum(int((cold == 0).sum()) for cold in sampled.cold_per_sample(masks))
    return HotSet(
        tables=tables,
        threshold=t,
        hot_budget_bytes=config.hot_budget_bytes,
        # without the ids per sample (counts only) the sample share is not estimated here
        hot_sample_share=hot_samples / sampled.num_samples if sampled.batches_read else float("nan"),
        sampled_samples=sampled.num_samples,
        seconds=time.perf_counter() - started,
        config=asdict(config),
    )


def calibrate(
    source: Any, num_embeddings_per_feature: Mapping[str, int], config: CalibrationConfig
) -> HotSet:
    """Calibrate a hot set from a training dataset.

    Args:
        source: the training batches: a dataset with ``batch(i)`` and ``__len__`` (read only at the sampled
            batches) or any iterable of TorchRec :class:`~torchrec.datasets.utils.Batch` es.
        num_embeddings_per_feature: rows of each feature's table.
        config: budget and sampling settings.

    Returns:
        The hot set.

    Raises:
        ConfigError: a bad budget or feature set.
        DataError: an empty dataset.
        InvalidIdError: an id out of its table's range.

    Example:
        >>> from torchrec_lookahead.data import CriteoSyntheticDataset, SyntheticCriteoConfig
        >>> ds = CriteoSyntheticDataset(SyntheticCriteoConfig(batch_size=256, num_batches=40, scale=0.001))
        >>> cfg = CalibrationConfig(hot_budget_bytes=1 << 20, sample_fraction=0.25, small_table_bytes=4096)
        >>> hs = calibrate(ds, ds.num_embeddings_per_feature(), cfg)
        >>> hs.hot_bytes <= cfg.hot_budget_bytes, hs.hot_access_share > 0.5
        (True, True)
    """
    started = time.perf_counter()
    batches, total = sample_batches(source, config.sample_fraction, config.seed)
    sampled = SampledAccesses.collect(batches, num_embeddings_per_feature, batches_total=total)
    return calibrate_counts(sampled, config, started=started)


def recalibrate_counts(
    counts: Mapping[str, torch.Tensor], num_samples: int, config: CalibrationConfig
) -> HotSet:
    """The hot set for ``config``'s budget from exact access counts (``feature -> int64 per row``) of
    ``num_samples`` samples, e.g. those of the epoch just trained (``recalibrate="epoch"``).

    The rules are the calibrator's (:func:`calibrate_counts`: small tables, Rand-Em Box bound, smallest threshold
    that fits, exact marking); only the counts are exact instead of sampled. The expected sample share is left
    ``nan`` (the ids per sample are not kept): the caller measures it on the next epoch's classification pass.

    Example:
        >>> cfg = CalibrationConfig(hot_budget_bytes=12, embedding_dim=1, optimizer="sgd", small_table_bytes=1)
        >>> hs = recalibrate_counts({"a": torch.tensor([5, 0, 9, 1, 7])}, 22, cfg)
        >>> hs.tables["t_a"].hot_ids.tolist(), hs.hot_bytes  # 4-byte rows (SGD, width 1): three fit
        ([0, 2, 4], 12)
    """
    return calibrate_counts(SampledAccesses.from_counts(counts, num_samples), config)
