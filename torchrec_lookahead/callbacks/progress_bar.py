"""Lightning's progress bar, which also knows the epoch and its length after a mid-epoch resume
(:class:`ResumingProgressBar`).

Lightning does not call ``on_train_epoch_start`` when it resumes in the middle of an epoch (the epoch already
started before the checkpoint), and that hook is where ``TQDMProgressBar`` sets the bar's total and its
``Epoch N`` label: a resumed run (``--ckpt_path``, a ``torchrun --max-restarts`` restart) showed
``Training: 21/?``. The CLI puts this bar in place of Lightning's default one (:func:`use_resuming_progress_bar`).
"""

from __future__ import annotations

from typing import List

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf
from typing_extensions import override

__all__ = ["ResumingProgressBar", "use_resuming_progress_bar"]


class ResumingProgressBar(TQDMProgressBar):
    """``TQDMProgressBar`` that sets the training bar's total and ``Epoch N`` label when training starts in the
    middle of an epoch, as Lightning's bar does at the start of every other epoch.

    Example:
        >>> ResumingProgressBar(refresh_rate=5).refresh_rate
        5
    """

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if trainer.fit_loop.restarted_mid_epoch and self.train_progress_bar is not None:
            # the epoch's batches, counted from the batch it resumes after, as the steps' batch_idx go on:
            # ``processed``, not ``completed``, which a checkpoint of on_train_batch_end (every_n_train_steps)
            # holds one short (Lightning counts that batch completed only when the loop is reset, after this)
            # (a _ProcessedTracker, which Lightning's dataclass annotates as its base class)
            done = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # type: ignore[attr-defined]
            bar = self.train_progress_bar
            bar.reset(total=convert_inf(trainer.num_training_batches))
            bar.initial = bar.n = done
            bar.set_description(f"Epoch {trainer.current_epoch}")


def use_resuming_progress_bar(trainer: pl.Trainer) -> None:
    """Replace the Trainer's plain ``TQDMProgressBar`` (the default one, or one configured as such) by a
    :class:`ResumingProgressBar` with the same settings; other bars (rich, user subclasses) stay."""
    callbacks: List[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]
    for i, cb in enumerate(callbacks):
        if type(cb) is TQDMProgressBar:
            callbacks[i] = ResumingProgressBar(cb.refresh_rate, cb.process_position, cb._leave)
