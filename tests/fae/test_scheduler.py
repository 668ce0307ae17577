"""HotColdScheduler: the rate rule against a scripted loss sequence, the runs it asks the loader for, and
resume."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterator, List, Tuple

import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torchrec import KeyedJaggedTensor
from torchrec.datasets.utils import Batch

from torchrec_lookahead.data import CriteoSyntheticDataModule
from torchrec_lookahead.errors import ConfigError, SetupError
from torchrec_lookahead.fae import (
    BatchKind,
    HotColdDataModule,
    HotColdLoader,
    HotColdScheduler,
    HotColdStream,
    RateRule,
)

from ..conftest import tiny_data_args

H, C = BatchKind.HOT, BatchKind.COLD


def _loader() -> HotColdLoader:
    """16 source batches of 4 samples, alternately all hot (id 0) and all cold (id 3): 8 hot, 8 cold."""

    def source() -> Iterator[Batch]:
        for i in range(16):
            v = 0 if i % 2 == 0 else 3
            kjt = KeyedJaggedTensor(["a"], torch.full((4,), v), lengths=torch.ones(4, dtype=torch.int32))
            yield Batch(torch.full((4, 1), float(i)), kjt, torch.zeros(4))

    mask = {"a": torch.tensor([True, True, False, False])}
    return HotColdLoader(HotColdStream(source, mask, 4, window=32, num_samples=(32, 64)))


def _trainer(loader: HotColdLoader) -> Any:
    datamodule = HotColdDataModule(CriteoSyntheticDataModule(**tiny_data_args()), hot_budget_bytes=1 << 20)
    datamodule.loader = loader  # what its train_dataloader() would have set
    return SimpleNamespace(
        datamodule=datamodule,
        current_epoch=0,
        sanity_checking=False,
        state=SimpleNamespace(fn=TrainerFn.FITTING),
        callback_metrics={},
        strategy=SimpleNamespace(reduce=lambda t, reduce_op: t),
    )


_MODULE = SimpleNamespace(log_dict=lambda *a, **k: None)
# Validation after every second step, with these losses: first, rise, fall, fall (x2: doubles), rise, fall, fall.
_LOSSES = [1.0, 1.1, 1.0, 0.9, 0.95, 0.8, 0.7]


def _train(
    sched: HotColdScheduler, loader: HotColdLoader, start: int = 0, stop: int = 16
) -> Tuple[List[BatchKind], List[float]]:
    trainer = _trainer(loader)
    sched.on_train_epoch_start(trainer, _MODULE)  # type: ignore[arg-type]
    it = iter(loader)
    kinds, rates = [], []
    for step in range(start + 1, stop + 1):
        next(it)
        kinds.append(loader.last_kind)
        sched.on_train_batch_end(trainer, _MODULE, None, None, step - 1)  # type: ignore[arg-type]
        if step % 2 == 0 and step // 2 <= len(_LOSSES):
            trainer.callback_metrics = {"val/logloss": torch.tensor(_LOSSES[step // 2 - 1])}
            sched.on_validation_end(trainer, _MODULE)  # type: ignore[arg-type]
            rates.append(sched.rate)
    return kinds, rates  # type: ignore[return-value]


def test_rule_against_scripted_losses() -> None:
    rule = RateRule(rate=50.0, patience=4)
    seq = [1.0, 0.9, 0.8, 0.7, 0.6, 0.65, 0.66, 0.6, 0.5, 0.4, 0.3]
    got = [rule.observe(x, min_rate=10.0) for x in seq]
    assert got == [50.0, 50.0, 50.0, 50.0, 100.0, 50.0, 25.0, 25.0, 25.0, 25.0, 50.0]
    floor = RateRule(rate=20.0, patience=4)
    assert [floor.observe(x, min_rate=12.5) for x in (1.0, 2.0, 3.0, 4.0)] == [20.0, 12.5, 12.5, 12.5]


def test_runs_follow_the_rule() -> None:
    loader = _loader()
    sched = HotColdScheduler(initial_rate=50.0, patience=2)
    kinds, rates = _train(sched, loader)
    # Runs of 4 (rate 50 of 8 batches per kind), halved to 2 after the rise at step 4, doubled back after two
    # falls (step 8), from the next run, halved at step 10, doubled at step 14; a kind that is used up ends
    # its run early.
    assert kinds == [C, C, C, C, H, H, C, C, H, H, C, C, H, H, H, H]
    assert rates == [50.0, 25.0, 25.0, 50.0, 25.0, 25.0, 50.0]
    assert sched.swaps == 5 and sched.trained == {H: 8, C: 8}


@pytest.mark.parametrize("stop", [3, 7, 10])
def test_resume_equals_uninterrupted(stop: int) -> None:
    full, _ = _train(HotColdScheduler(patience=2), _loader())
    sched, loader = HotColdScheduler(patience=2), _loader()
    head, _ = _train(sched, loader, stop=stop)
    cb_state, loader_state = sched.state_dict(), loader.state_dict()
    sched2, loader2 = HotColdScheduler(patience=2), _loader()
    sched2.load_state_dict(cb_state)
    loader2.load_state_dict(loader_state)
    tail, _ = _train(sched2, loader2, start=stop)
    assert head + tail == full


def test_bad_arguments_and_setup() -> None:
    with pytest.raises(ConfigError, match="rate"):
        HotColdScheduler(initial_rate=0)
    with pytest.raises(ConfigError, match="rate"):
        HotColdScheduler(initial_rate=150)
    # a rate that is no number was a TypeError or ValueError of float(), and True ran at 1 %
    for bad in (None, "x", "50", True):
        with pytest.raises(ConfigError, match=r"rate in \(0, 100\] percent but got"):
            HotColdScheduler(initial_rate=bad)  # type: ignore[arg-type]
    for bad in (None, "", 3):  # the metric the rate follows: it warned once and kept the rate, every time
        with pytest.raises(ConfigError, match="monitor to name a validation metric"):
            HotColdScheduler(monitor=bad)  # type: ignore[arg-type]
    for bad in (0, 1.5, True):  # 1.5 was cut to 1
        with pytest.raises(ConfigError, match="patience"):
            HotColdScheduler(patience=bad)  # type: ignore[arg-type]
    trainer = SimpleNamespace(datamodule=SimpleNamespace(), current_epoch=0)
    with pytest.raises(SetupError, match="HotColdDataModule"):
        HotColdScheduler().on_train_epoch_start(trainer, _MODULE)  # type: ignore[arg-type]
