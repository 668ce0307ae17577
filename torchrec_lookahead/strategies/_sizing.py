"""Cache capacities from the data, for lookahead sharders given a device budget: the training batches the budget
planner samples (identical on every rank; the cold batches when the DataModule pins rows), FAE's hot rows taken
off the budget, and the set-up report (:func:`size_caches`)."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional

from torch import nn

from torchrec_lookahead.data import batch_adapter_of, trainer_datamodules
from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
from torchrec_lookahead.distributed.lockstep import gather_global_kjt
from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.runtime.adapter import as_torchrec_batch
from torchrec_lookahead.runtime.report import report_text, scan_progress
from torchrec_lookahead.runtime.types import PinnedRowsSource

__all__ = ["size_caches"]


def size_caches(
    sharders: List[LookaheadEmbeddingBagCollectionSharder], module: nn.Module, trainer: Any, world_size: int
) -> Dict[str, int]:
    """Plan the capacities of the ``sharders`` that have a device budget but no capacities, from the trainer's
    DataModule (a collective with several ranks: the sampled ids are gathered), and report the plan.

    Returns:
        Capacity per cached table, of every sharder.

    Raises:
        ConfigError: a budget to plan but no DataModule to sample batches from, or a sharder's
            ``planner_options`` that differ from the ``LookaheadDataModule``'s horizon, prefetch depth or policy.
    """
    _use_loader_settings(sharders, trainer)
    for s in sharders:
        if s.device_budget_bytes is not None and not s.capacity:
            pinning = _pinned_rows_source(trainer)
            # the hot set is loaded or calibrated here, before the caches are sized (it is kept for training)
            hot = None if pinning is None else pinning.pinned_hot_ids()
            with scan_progress(trainer, "Lookahead cache plan: sampling batches", None) as tick:
                plan_report = s.plan_capacity(
                    module, _sample_batches(trainer, world_size, tick, pinning), pinned=hot
                )
            report = f"Lookahead cache plan:\n{plan_report}"
            if hot:
                report += "\nPinned hot rows in those caches (capacity = pinned + planned): " + ", ".join(
                    f"{t} {int(hot[t].numel()):,} + {c - int(hot[t].numel()):,}"
                    for t, c in sorted(s.capacity.items())
                    if t in hot
                )
            report_text(trainer, "lookahead/cache_plan", report)
    cached: Dict[str, int] = {k: v for s in sharders for k, v in s.capacity.items()}
    if cached:
        report_text(
            trainer,
            "lookahead/cache",
            "Lookahead cache: " + ", ".join(f"{t} {c:,} rows" for t, c in sorted(cached.items())),
        )
    return cached


def _use_loader_settings(sharders: List[LookaheadEmbeddingBagCollectionSharder], trainer: Any) -> None:
    """Plan every sharder's caches for the lookahead the DataModule trains with: a ``LookaheadDataModule``'s
    settings (:meth:`~torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder.use_lookahead_settings`).
    """
    from torchrec_lookahead.data.lookahead import LookaheadDataModule

    dm, _ = trainer_datamodules(trainer)
    if isinstance(dm, LookaheadDataModule):
        for s in sharders:
            s.use_lookahead_settings(dm.settings, type(dm).__name__)


def _pinned_rows_source(trainer: Any) -> Optional[PinnedRowsSource]:
    """The wrapped DataModule when it pins rows in the caches (FAE's hot rows: a ``HotColdDataModule`` inside a
    ``LookaheadDataModule``), else ``None``."""
    from torchrec_lookahead.data.lookahead import LookaheadDataModule

    dm, inner = trainer_datamodules(trainer)
    if isinstance(dm, LookaheadDataModule) and isinstance(inner, PinnedRowsSource):
        return inner
    return None


def _sample_batches(
    trainer: Any,
    world_size: int,
    on_batch: Callable[[], None] = lambda: None,
    pinning: Optional[PinnedRowsSource] = None,
) -> Iterator[Any]:
    """Training batches of the (unwrapped) DataModule, for sizing caches; identical on every rank. ``on_batch``
    is called after each batch is read (a progress bar's tick). With ``pinning`` (the DataModule pins rows in
    the caches), its cold batches (:meth:`~torchrec_lookahead.runtime.types.PinnedRowsSource.cold_batches`): the
    dynamic caches see only them."""
    dm, inner = trainer_datamodules(trainer)
    adapter = batch_adapter_of(dm)
    if inner is None:
        raise ConfigError(
            "The lookahead sharder has a device budget but no DataModule to sample batches from; pass a "
            "DataModule to the Trainer or give the sharder explicit capacities"
        )
    loader = inner.train_dataloader() if pinning is None else pinning.cold_batches()
    for batch in loader:
        kjt = as_torchrec_batch(batch, adapter).sparse_features
        on_batch()
        if world_size > 1:  # caches are planned for the global batch: gather every rank's ids
            yield gather_global_kjt(kjt, world_size, None)
        else:
            yield kjt
