"""A resumable single-process loader of whole batches.

Lightning saves a loader's ``state_dict()`` in a checkpoint when the loader is ``_Stateful`` and restores it
on resume. Our datasets are indexable by batch (``start_batch``), so the loader only has to count the batches
it handed out and start the next iteration from there.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional

from torch.utils.data import DataLoader, IterableDataset

from torchrec_lookahead.data.text import LineBatchDataset
from torchrec_lookahead.errors import CheckpointError

__all__ = ["ResumableBatchLoader"]


class ResumableBatchLoader(DataLoader):
    """A :class:`~torch.utils.data.DataLoader` over a dataset of whole batches that resumes mid-epoch.

    The dataset must be an :class:`~torch.utils.data.IterableDataset` with a writable ``start_batch``
    attribute and, ideally, ``__len__``. The loader counts batches handed out in the current epoch;
    ``state_dict()`` records that count and ``load_state_dict()`` makes the next iteration start there.

    Args:
        dataset: the batch dataset.

    Example:
        >>> from torchrec_lookahead.data.synthetic import CriteoSyntheticDataset, SyntheticCriteoConfig
        >>> ds = CriteoSyntheticDataset(SyntheticCriteoConfig(batch_size=2, num_batches=3, scale=0.0001))
        >>> loader = ResumableBatchLoader(ds)
        >>> it = iter(loader); _ = next(it)
        >>> loader.state_dict()
        {'batches_yielded': 1}
    """

    def __init__(self, dataset: IterableDataset, sampler: None = None, batch_sampler: None = None) -> None:
        # ``sampler``/``batch_sampler``: Lightning re-creates a ``predict`` loader passing both as None (an
        # iterable dataset has none); anything else is refused.
        if sampler is not None or batch_sampler is not None:
            raise TypeError(
                "ResumableBatchLoader serves whole batches of an IterableDataset; it takes no sampler"
            )
        if not hasattr(dataset, "start_batch"):
            raise TypeError(f"{type(dataset).__name__} has no 'start_batch' attribute; it cannot be resumed")
        super().__init__(dataset, batch_size=None, num_workers=0)
        self._yielded = 0
        self._resume_from = 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        start, self._resume_from = self._resume_from, 0
        self.dataset.start_batch = start  # type: ignore[attr-defined]
        self._yielded = start
        for batch in super().__iter__():
            self._yielded += 1
            yield batch

    def _source(self) -> Optional[List[Any]]:
        """The files a dataset of text lines reads (``None`` for any other dataset)."""
        return self.dataset.source_identity() if isinstance(self.dataset, LineBatchDataset) else None

    def _batch_size(self) -> Optional[int]:
        """Rows per batch of a dataset of text lines (``None`` for any other dataset)."""
        return int(self.dataset.batch_size) if isinstance(self.dataset, LineBatchDataset) else None

    def state_dict(self) -> Dict[str, Any]:
        """Batches handed out in the current epoch, and (a dataset of files) the files they came from and the
        rows of each batch."""
        source = self._source()
        if source is None:
            return {"batches_yielded": self._yielded}
        return {"batches_yielded": self._yielded, "source": source, "batch_size": self._batch_size()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Make the next iteration start after the batches already handed out.

        Raises:
            CheckpointError: the state has no position, or it is inside an epoch over other files than the
                dataset's (names and sizes), or of batches of another size: the rest of the epoch would come
                from other rows.
        """
        if "batches_yielded" not in state_dict:
            raise CheckpointError(
                f"Loader state {state_dict} has no 'batches_yielded'; was it saved by this loader?"
            )
        start = int(state_dict["batches_yielded"])
        saved, now = state_dict.get("source"), self._source()
        if start and saved is not None and now is not None and [list(x) for x in saved] != now:
            raise CheckpointError(
                f"the checkpoint stopped after batch {start} of an epoch over the files {_named(saved)}, but the "
                f"data module reads {_named(now)}: the rest of the epoch would come from other rows; resume with "
                "the files it was trained on, or from an end-of-epoch checkpoint"
            )
        rows, now_rows = state_dict.get("batch_size"), self._batch_size()
        if start and rows is not None and now_rows is not None and int(rows) != now_rows:
            raise CheckpointError(
                f"the checkpoint stopped after batch {start} of an epoch of batches of {int(rows):,} rows per rank, "
                f"but the data module makes batches of {now_rows:,}: the rest of the epoch would start at row "
                f"{start * now_rows:,} instead of {start * int(rows):,} (rows trained twice, or skipped); resume "
                f"with batch_size {int(rows)}, or from an end-of-epoch checkpoint"
            )
        self._resume_from = start


def _named(source: List[Any]) -> str:
    """Files as ``[name (size bytes), ...]``."""
    return "[" + ", ".join(f"{name} ({int(size):,} bytes)" for name, size in source) + "]"
