"""Multi-rank annotations (LRPP): which ranks read each unique id of a table at one step.

The global batch of B samples is split into ``num_ranks`` contiguous slices the way ``torch.tensor_split``
splits B items (the first ``B % W`` ranks get one sample more). The sample of each id comes from the
feature's lengths (a ``KeyedJaggedTensor``'s ``lengths()``, or the ``(ids, lengths)`` pair of a mapping
input); without lengths every id is its own sample. Features sharing a table use their own lengths over the
same B samples.

Example:
    >>> import numpy as np
    >>> info = readers(np.array([0, 1, 0, 2]), np.array([0, 1, 2, 3]), 4, 3, 2)
    >>> ann = annotate(np.array([7, 5, 9]), info, np.array([1, 9, 9]), 0)
    >>> ann.unique_ids.tolist(), ann.reader_mask.tolist(), ann.single_rank.tolist()
    ([5, 7, 9], [1, 3, 2], [True, False, True])
    >>> ann.shared_next.tolist(), ann.shared_delayed.tolist()
    ([False, True, False], [False, False, False])
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

from torchrec_lookahead._arrays import sorted_unique
from torchrec_lookahead.oracle.types import RankAnnotation

__all__ = ["RankInfo", "readers", "annotate", "rank_of_sample"]

#: (reader bit mask per unique id, number of reading ranks per unique id)
RankInfo = Tuple[np.ndarray, np.ndarray]


def rank_of_sample(samples: np.ndarray, batch_size: int, num_ranks: int) -> np.ndarray:
    """Rank owning each sample index under ``torch.tensor_split`` slicing of ``batch_size`` samples.

    Args:
        samples: (N,) sample index of each id.
        batch_size: B, samples in the global batch.
        num_ranks: W.

    Returns:
        (N,) int64 rank of each id.
    """
    base, extra = divmod(batch_size, num_ranks)
    sizes = np.full(num_ranks, base, dtype=np.int64)
    sizes[:extra] += 1
    ends = np.cumsum(sizes)
    return np.searchsorted(ends, samples, side="right").astype(np.int64)


def readers(
    inv: np.ndarray, samples: Optional[np.ndarray], batch_size: Optional[int], num_unique: int, num_ranks: int
) -> RankInfo:
    """Reader mask and reader count of each unique id.

    Args:
        inv: (N,) index of each id among the unique ids.
        samples: (N,) sample index of each id, or ``None`` (each id its own sample).
        batch_size: B, or ``None`` for N.
        num_unique: U.
        num_ranks: W.

    Returns:
        (mask, count), both (U,) int64.
    """
    if samples is None:
        samples = np.arange(inv.size, dtype=np.int64)
    size = int(batch_size) if batch_size is not None else inv.size
    rank = rank_of_sample(samples, max(size, 1), num_ranks)
    pairs = sorted_unique(inv.astype(np.int64) * num_ranks + rank)
    u, r = pairs // num_ranks, pairs % num_ranks
    mask = np.zeros(num_unique, dtype=np.int64)
    np.add.at(mask, u, np.left_shift(np.int64(1), r))
    count = np.bincount(u, minlength=num_unique).astype(np.int64)
    return mask, count


def annotate(
    uniq: np.ndarray, info: RankInfo, next_use: np.ndarray, step: int, next_known: bool = True
) -> RankAnnotation:
    """Build the :class:`RankAnnotation` of one table at ``step``.

    Args:
        uniq: (U,) unique ids (any order).
        info: :func:`readers` output aligned with ``uniq``.
        next_use: (U,) step of each id's next use.
        step: the planned step.
        next_known: whether batch ``step + 1`` had been read when ``next_use`` was taken (the oracle plans step
            ``t`` before reading batch ``t + 1`` when its horizon is 0). When not, every shared id is labelled
            ``shared_next``: synchronising on the critical path is always correct, delaying an id the next
            step reads is not.

    Returns:
        The annotation, ids sorted ascending.
    """
    mask, count = info
    order = np.argsort(uniq)  # distinct ids: no ties, so any sort gives this order
    shared = count[order] > 1
    nxt_is_next = next_use[order] == step + 1 if next_known else np.ones(order.size, dtype=bool)
    return RankAnnotation(
        unique_ids=torch.from_numpy(uniq[order].astype(np.int64)),
        reader_mask=torch.from_numpy(mask[order]),
        single_rank=torch.from_numpy(count[order] == 1),
        shared_next=torch.from_numpy(shared & nxt_is_next),
        shared_delayed=torch.from_numpy(shared & ~nxt_is_next),
    )
