"""A sharder reused for another fit (a second fit in one process, a sweep): the per-fit settings a DataModule
fills into ``planner_options`` are built from the options given each time, so the second fit is neither refused
for the first one's values nor planned with them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import lightning.pytorch as pl

from torchrec_lookahead.data import CriteoSyntheticDataModule, LookaheadDataModule
from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
from torchrec_lookahead.oracle import LookaheadSettings
from torchrec_lookahead.strategies import TorchRecStrategy

from ..conftest import tiny_data_args
from ..helpers import _trainer, make_model


def test_the_options_given_stay_as_given_and_each_fit_takes_its_own() -> None:
    given: Dict[str, Any] = {"num_sample_batches": 4, "oracle_options": {"window": 3}}
    sharder = LookaheadEmbeddingBagCollectionSharder(device_budget_bytes=1 << 20, planner_options=given)
    sharder.use_lookahead_settings(LookaheadSettings(16, policy="window", window=3, ways=2), "first")
    assert sharder.planner_options["horizon"] == 16 and sharder.planner_options["oracle_options"]["ways"] == 2
    # the second DataModule's settings: it was refused ("horizon=16 ... differs from horizon=8 of second")
    sharder.use_lookahead_settings(LookaheadSettings(8, prefetch_depth=0, policy="lru"), "second")
    assert sharder.planner_options == {
        "num_sample_batches": 4,
        "oracle_options": {"window": 3},  # lru: no window or ways of the first fit carried over
        "horizon": 8,
        "prefetch_depth": 0,
        "policy": "lru",
    }
    assert given == {"num_sample_batches": 4, "oracle_options": {"window": 3}}
    assert sharder.given_planner_options == given


def _fit(tmp_path: Path, sharder: LookaheadEmbeddingBagCollectionSharder, horizon: int) -> None:
    pl.seed_everything(0, verbose=False)
    inner = CriteoSyntheticDataModule(**tiny_data_args())
    dm = LookaheadDataModule(inner, horizon=horizon, prefetch_depth=1)
    trainer = _trainer(tmp_path, 2, None, strategy=TorchRecStrategy(sharders=[sharder]), limit_val_batches=0)
    trainer.fit(make_model(inner), datamodule=dm)


def test_a_budget_sharder_reused_plans_for_the_second_fits_settings(tmp_path: Path) -> None:
    sharder = LookaheadEmbeddingBagCollectionSharder(device_budget_bytes=40_000)
    _fit(tmp_path / "a", sharder, horizon=8)
    first = dict(sharder.capacity)
    assert first and sharder.planner_options["horizon"] == 8
    _fit(tmp_path / "b", sharder, horizon=2)
    fresh = LookaheadEmbeddingBagCollectionSharder(device_budget_bytes=40_000)
    _fit(tmp_path / "c", fresh, horizon=2)
    assert sharder.planner_options == fresh.planner_options and sharder.planner_options["horizon"] == 2
    assert sharder.capacity == fresh.capacity != first  # planned for the second fit, not the first fit's plan
