"""The progress bar of a run resumed mid-epoch shows the epoch and its length (Lightning's own shows ``n/?``)."""

from typing import Any, List

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar

from torchrec_lookahead.callbacks import ResumingProgressBar, use_resuming_progress_bar

from ..helpers import fit_cached


class _Seen(pl.Callback):
    """The training bar's total and label at each step (after the bar's own hooks: callbacks run in order)."""

    def __init__(self, bar: TQDMProgressBar) -> None:
        self.bar = bar
        self.seen: List[Any] = []

    def on_train_batch_end(self, *args: Any) -> None:
        tqdm = self.bar.train_progress_bar
        self.seen.append((tqdm.total, tqdm.desc))
        self.n = tqdm.n


def test_a_run_resumed_mid_epoch_shows_its_epoch_and_length(tmp_path: Any) -> None:
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    fit_cached(tmp_path / "first", 4, callbacks=[ckpt])
    resumed = str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt")
    for bar, expect in ((TQDMProgressBar(), (None, "Training")), (ResumingProgressBar(), (12, "Epoch 0: "))):
        seen = _Seen(bar)
        fit_cached(
            tmp_path / type(bar).__name__,
            8,
            callbacks=[bar, seen],
            ckpt_path=resumed,
            enable_progress_bar=True,
        )
        # Lightning's bar has no total after a mid-epoch resume; ours has the epoch's 12 batches
        assert set(seen.seen) == {expect}, seen.seen
    assert seen.n == 8  # batches 5 to 8 of the epoch, counted on from the 4 before the checkpoint


def test_only_the_plain_bar_is_replaced(tmp_path: Any) -> None:
    plain = pl.Trainer(default_root_dir=tmp_path, logger=False, enable_model_summary=False)
    use_resuming_progress_bar(plain)
    assert type(plain.progress_bar_callback) is ResumingProgressBar

    class Own(TQDMProgressBar):
        pass

    own = pl.Trainer(default_root_dir=tmp_path, logger=False, callbacks=[Own(refresh_rate=3)])
    use_resuming_progress_bar(own)
    assert type(own.progress_bar_callback) is Own


class _Start(pl.Callback):
    """The training bar's count when training starts (after the bar's own ``on_train_start``)."""

    def __init__(self, bar: TQDMProgressBar) -> None:
        self.bar = bar
        self.n: Any = None

    def on_train_start(self, *args: Any) -> None:
        self.n = self.bar.train_progress_bar.n


def test_a_run_resumed_from_a_checkpoint_of_every_n_train_steps_starts_its_bar_at_that_step(
    tmp_path: Any,
) -> None:
    # ModelCheckpoint(every_n_train_steps) saves in on_train_batch_end, before Lightning counts the batch as
    # completed: the bar started one short (3/12 after 4 batches) and jumped to 5 at the first step
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    fit_cached(tmp_path / "first", 4, callbacks=[ckpt])
    bar = ResumingProgressBar()
    start = _Start(bar)
    fit_cached(
        tmp_path / "resumed",
        6,
        callbacks=[bar, start],
        ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=4.ckpt"),
        enable_progress_bar=True,
    )
    assert start.n == 4
