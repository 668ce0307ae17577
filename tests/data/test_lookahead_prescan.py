"""The capacity pre-scan's bounds: how many batches it reads before the first step, and what it refuses."""

import lightning.pytorch as pl
import pytest

from torchrec_lookahead import CapacityError, ConfigError
from torchrec_lookahead.data import LookaheadDataModule

from ..conftest import TINY_TABLES
from ..helpers import fit_cached
from .test_lookahead import _late_window_capacity


class _CountedLoader:
    """A training loader that counts the batches each of its iterations yields."""

    def __init__(self, loader):
        self.loader = loader
        self.reads = []

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        self.reads.append(0)
        for b in self.loader:
            self.reads[-1] += 1
            yield b


def _counting_train_loaders(monkeypatch):
    """Every training loader of the synthetic DataModule counts its reads; returns the loaders made."""
    from torchrec_lookahead.data import CriteoSyntheticDataModule

    made = []
    train_dataloader = CriteoSyntheticDataModule.train_dataloader

    def counted(self):
        made.append(_CountedLoader(train_dataloader(self)))
        return made[-1]

    monkeypatch.setattr(CriteoSyntheticDataModule, "train_dataloader", counted)
    return made


def test_a_bounded_pre_scan_reads_only_its_bound_before_the_first_step(tmp_path, monkeypatch):
    made = _counting_train_loaders(monkeypatch)
    texts = []
    monkeypatch.setattr(
        "torchrec_lookahead.data.lookahead.report_text", lambda _t, _tag, text: texts.append(text)
    )
    at_first_step = []

    class FirstStep(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            if not at_first_step:
                at_first_step.append(list(made[-1].reads))

    trainer, _ = fit_cached(
        tmp_path,
        5,
        data={"num_train_batches": 40},
        callbacks=[FirstStep()],
        lookahead_kw={"capacity_check_batches": 6, "capacity_check_seconds": None},
    )
    assert trainer.global_step == 5
    # the pre-scan's pass read 6 of the 40 batches; the second pass is training's (its planner reads ahead)
    assert at_first_step[0][0] == 6 and len(at_first_step[0]) == 2, at_first_step
    (report,) = [t for t in texts if t.startswith("Lookahead capacity check")]
    assert "6 of the epoch's 40 batches read ahead" in report and "capacity_check_batches=6" in report
    assert "the windows of the other 34 are checked as the oracle plans them, 8 batches ahead" in report


def test_a_pre_scan_bounded_beyond_the_epoch_reads_the_whole_epoch(tmp_path, monkeypatch):
    made = _counting_train_loaders(monkeypatch)
    texts = []
    monkeypatch.setattr(
        "torchrec_lookahead.data.lookahead.report_text", lambda _t, _tag, text: texts.append(text)
    )
    fit_cached(tmp_path, 2, lookahead_kw={"capacity_check_batches": 100})
    assert made[-1].reads[0] == 12
    (report,) = [t for t in texts if t.startswith("Lookahead capacity check")]
    assert report.startswith("Lookahead capacity check: 12 batches read ahead") and "oracle" not in report


def test_a_window_beyond_the_pre_scans_bound_is_refused_before_it_is_trained(tmp_path):
    table, batches, bound = "t_cat_11", 40, 10
    cap = _late_window_capacity(table, batches, early=14)
    steps = []

    class Count(pl.Callback):
        def on_train_batch_start(self, *args):
            steps.append(1)

    with pytest.raises(CapacityError, match=rf"{table}.*needs? \d+ cache rows but capacity") as raised:
        fit_cached(
            tmp_path,
            batches,
            capacity={table: cap},
            data={"num_train_batches": batches},
            callbacks=[Count()],
            lookahead_kw={"capacity_check_batches": bound},
        )
    err = raised.value
    # not the pre-scan's (its bound stops it before the window), but the oracle's, as it planned the window
    assert "found before training" not in str(err) and err.batch >= 14 > bound
    # and no step trained a batch of that window (batch - prefetch_depth .. batch)
    assert len(steps) <= err.batch - 1, (len(steps), err.batch)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"capacity_check_batches": 0}, "capacity_check_batches must be an integer >= 1 but got 0"),
        ({"capacity_check_batches": -5}, "capacity_check_batches must be an integer >= 1 but got -5"),
        ({"capacity_check_batches": 2.5}, "capacity_check_batches must be an integer >= 1 but got 2.5"),
        ({"capacity_check_batches": True}, "capacity_check_batches must be an integer >= 1 but got True"),
        ({"capacity_check_seconds": 0}, "capacity_check_seconds must be a number > 0 but got 0"),
        ({"capacity_check_seconds": -1.0}, "capacity_check_seconds must be a number > 0 but got -1.0"),
        ({"capacity_check_seconds": float("nan")}, "capacity_check_seconds must be a number > 0 but got nan"),
        ({"capacity_check_seconds": "30"}, "capacity_check_seconds must be a number > 0 but got '30'"),
        ({"capacity_check_seconds": True}, "capacity_check_seconds must be a number > 0 but got True"),
    ],
)
def test_bad_pre_scan_bounds_are_config_errors(kw, match):
    from torchrec_lookahead.data import CriteoSyntheticDataModule

    with pytest.raises(ConfigError, match=match):
        LookaheadDataModule(CriteoSyntheticDataModule(num_embeddings=TINY_TABLES), **kw)


def test_pre_scan_bounds_default_to_a_time_bound_and_accept_none():
    import numpy as np

    from torchrec_lookahead.data import CriteoSyntheticDataModule
    from torchrec_lookahead.runtime.capacity import DEFAULT_SCAN_SECONDS

    inner = CriteoSyntheticDataModule(num_embeddings=TINY_TABLES)
    dm = LookaheadDataModule(inner)
    assert (dm.capacity_check_batches, dm.capacity_check_seconds) == (None, DEFAULT_SCAN_SECONDS)
    dm = LookaheadDataModule(inner, capacity_check_batches=np.int64(50), capacity_check_seconds=None)
    assert (dm.capacity_check_batches, dm.capacity_check_seconds) == (50, None)
    assert type(dm.capacity_check_batches) is int
