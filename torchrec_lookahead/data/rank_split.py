"""Each rank its own part of the training data, exactly as Lightning gives it to the resident job.

Lightning injects a :class:`~torch.utils.data.DistributedSampler` into the training ``DataLoader`` it gets from
the DataModule (under ``strategy="torchrec"`` also with one rank, and then it shuffles). A
:class:`~torchrec_lookahead.data.LookaheadDataModule` hands Lightning its own loader instead, so it applies the
same step itself, through Lightning's own code path (same sampler, shuffle, seed, ``drop_last`` and padding),
before the oracle reads the batches: cached training sees the batches of the resident run in the same order.

An iterable dataset gets no sampler (in Lightning neither): with several ranks it must split itself by rank
and say so with a ``splits_by_rank = True`` attribute, else every rank would train the same batches.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader, IterableDataset

from torchrec_lookahead.errors import ConfigError

__all__ = ["split_for_ranks"]


def _splits_by_rank(loader: Any) -> bool:
    dataset = getattr(loader, "dataset", None)
    return bool(getattr(loader, "splits_by_rank", False) or getattr(dataset, "splits_by_rank", False))


def split_for_ranks(trainer: pl.Trainer, loader: Any) -> Any:
    """``loader`` as Lightning would train it on this rank (the wrapped DataModule's training loader).

    A map-style ``DataLoader`` gets the ``DistributedSampler`` Lightning would inject (none where the user
    turned it off with ``use_distributed_sampler=False`` or gave one); an iterable dataset is used as it is.

    Args:
        trainer: the Trainer (its strategy gives the ranks).
        loader: the training loader of the wrapped DataModule.

    Returns:
        The loader to plan and train from.

    Raises:
        ConfigError: several ranks and an iterable source that does not declare ``splits_by_rank = True``.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader
        >>> t = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
        >>> split_for_ranks(t, DataLoader(list(range(4)), batch_size=None)).sampler.__class__.__name__
        'SequentialSampler'
    """
    map_style = isinstance(loader, DataLoader) and not isinstance(loader.dataset, IterableDataset)
    if map_style:
        # Lightning's own step for training loaders (it always asks for shuffling there)
        return trainer._data_connector._prepare_dataloader(loader, shuffle=True, mode=RunningStage.TRAINING)
    if trainer.world_size > 1 and not _splits_by_rank(loader):
        source = type(getattr(loader, "dataset", loader)).__name__
        raise ConfigError(
            f"the training data ({source}) is iterable, so no sampler can give each of the {trainer.world_size} "
            "ranks its own part, and it does not declare splits_by_rank = True: every rank would train on the "
            "same batches. Use a map-style dataset (Lightning's DistributedSampler then splits it as in the "
            "resident job), or make the iterable yield only this rank's part (trainer.global_rank of "
            "trainer.world_size) and set splits_by_rank = True on it"
        )
    return loader
