"""A run whose checkpoints cannot be held in memory (tables on disk larger than it) is refused before training."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List

import lightning.pytorch as pl
import pytest

from torchrec_lookahead.errors import CheckpointError
from torchrec_lookahead.store import TensorStore
from torchrec_lookahead.strategies import _checkpoint
from torchrec_lookahead.strategies._checkpoint import checkpoint_memory_shortfall

from ..helpers import fit_cached


def test_the_estimate_counts_every_table_the_largest_twice_and_every_rank_of_the_machine() -> None:
    stores = [TensorStore(n, 8, {"momentum1": 1}, name=f"t{n}") for n in (100, 300)]
    need = (100 + 300 + 300) * 9 * 4
    assert checkpoint_memory_shortfall(stores, available=need) is None
    assert checkpoint_memory_shortfall(stores, processes=2, available=2 * need) is None
    message = checkpoint_memory_shortfall(stores, processes=2, available=2 * need - 1)
    assert message is not None and message.startswith("checkpoints hold the cached tables in full")
    assert "t300" in message and "2 rank(s)" in message and "enable_checkpointing=false" in message
    assert checkpoint_memory_shortfall([], available=0) is None


class _Steps(pl.Callback):
    def __init__(self) -> None:
        self.started: List[int] = []

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        self.started.append(trainer.global_step)


def _fit(path: Path, steps: _Steps, **trainer_kw: Any) -> Any:
    sharder = {"store": "disk", "store_dir": str(path / "stores"), "host_budget_bytes": 64 * 1024}
    return fit_cached(path, 3, capacity={"t_cat_2": 140}, sharder_kw=sharder, callbacks=[steps], **trainer_kw)


def test_checkpoints_larger_than_memory_are_refused_before_the_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpoints on (Lightning's default) and too little memory: a short CheckpointError before any step,
    instead of running out of memory at the first checkpoint. Without checkpoints the same run trains."""
    monkeypatch.setattr(_checkpoint, "memory_available", lambda: 1000)
    steps = _Steps()
    with pytest.raises(CheckpointError, match="checkpoints hold the cached tables in full") as info:
        _fit(tmp_path / "refused", steps)
    assert steps.started == [] and "t_cat_2" in str(info.value)
    steps = _Steps()
    trainer, _ = _fit(tmp_path / "trains", steps, enable_checkpointing=False)
    assert trainer.global_step == 3 and steps.started == [0, 1, 2]
