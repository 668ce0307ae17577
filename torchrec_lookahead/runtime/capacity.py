"""Checking a training stream against the cache before training starts (contract 2: bounded, fail early).

The oracle raises :class:`~torchrec_lookahead.errors.CapacityError` when a window (a batch and the next
``prefetch_depth``) needs more rows than a table's cache holds, but it plans only ``horizon`` batches ahead of
training, so a window late in an epoch would surface mid-training. :func:`check_stream` scans the whole epoch
first: the same per-window working sets, ids checked against the table sizes, and nothing planned or moved.
"""

from __future__ import annotations

import enum
from typing import Any, Dict, Iterable, Iterator, Mapping, Tuple

import numpy as np

from torchrec_lookahead.errors import CapacityError, InvalidIdError
from torchrec_lookahead.oracle.batch_ids import UnknownFeatures, split_batch
from torchrec_lookahead.oracle.oracle import window_working_sets
from torchrec_lookahead.oracle.types import describe_window

__all__ = ["CapacityCheck", "check_stream"]


class CapacityCheck(enum.StrEnum):
    """When ``LookaheadDataModule`` checks that every window of an epoch fits the cache (its
    ``capacity_check``); a ``str``, so the YAML strings ``epoch`` and ``lookahead`` are its values.

    Example:
        >>> CapacityCheck("epoch") is CapacityCheck.EPOCH, CapacityCheck.LOOKAHEAD == "lookahead"
        (True, True)
    """

    EPOCH = "epoch"  #: before training, scan the epoch's sparse features once (:func:`check_stream`)
    LOOKAHEAD = "lookahead"  #: only as the oracle plans, ``horizon`` batches ahead of training


def check_stream(
    batches: Iterable[Any],
    capacity: Mapping[str, int],
    feature_to_table: Mapping[str, str],
    num_embeddings: Mapping[str, int],
    prefetch_depth: int,
) -> Dict[str, int]:
    """Scan a stream of sparse features (KJTs or mappings) and fail at the first window a cache cannot hold.

    Args:
        batches: the stream (read once).
        capacity: cache rows per cached table.
        feature_to_table: feature -> table for the cached tables' features (other features are ignored).
        num_embeddings: rows per cached table (ids must be in ``[0, rows)``).
        prefetch_depth: P: a window is a batch and the next P batches.

    Returns:
        The largest window working set per table (the smallest capacity that would do).

    Raises:
        CapacityError: a window needs more rows than a table's capacity (names the first such window, the
            rows it needs and the rows available, and the largest window of each short table).
        InvalidIdError: an id is negative or not below the table's size (names the table and the batch).

    Example:
        >>> import torch
        >>> stream = [{"f": torch.tensor([1, 2])}, {"f": torch.tensor([3])}, {"f": torch.tensor([3, 4])}]
        >>> check_stream(stream, {"t": 3}, {"f": "t"}, {"t": 10}, prefetch_depth=1)
        {'t': 3}
    """
    names = sorted(capacity)
    best = {n: 0 for n in names}
    first: Dict[str, Tuple[int, int, int]] = {}

    def table_ids() -> Iterator[Dict[str, np.ndarray]]:
        for batch in batches:
            parts = split_batch(batch, names, feature_to_table, False, UnknownFeatures.IGNORE)
            yield {n: parts[n][0] for n in names}

    for step, sets in window_working_sets(table_ids(), prefetch_depth):
        for n, (uniq, need) in sets.items():
            if uniq.size and (int(uniq[0]) < 0 or int(uniq[-1]) >= int(num_embeddings[n])):
                bad = int(uniq[0]) if int(uniq[0]) < 0 else int(uniq[-1])
                raise InvalidIdError(
                    f"table {n!r}: batch {step} holds id {bad} outside [0, {int(num_embeddings[n])}); remap or "
                    "hash ids into the table before training",
                    table=n,
                    batch=step,
                    id=bad,
                    num_rows=int(num_embeddings[n]),
                )
            best[n] = max(best[n], need)
            if need > int(capacity[n]) and n not in first:
                first[n] = (max(step - prefetch_depth, 0), step, need)
    if first:
        n = sorted(first)[0]
        lo, hi, need = first[n]
        short = {t: best[t] for t in sorted(first)}
        raise CapacityError(
            f"table {n!r}: {describe_window(lo, hi, prefetch_depth)} need{'s' if lo == hi else ''} {need} "
            f"cache rows but capacity[{n!r}] is {int(capacity[n])}; the epoch's largest windows need {short} "
            "rows: raise those capacities, lower prefetch_depth, or use smaller batches (found before training "
            "by LookaheadDataModule(capacity_check='epoch'))",
            table=n,
            batch=hi,
            needed=need,
            available=int(capacity[n]),
        )
    return best
