"""The log version of a run refused at start-up: removed only when this run made it and it holds nothing else."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from torchrec_lookahead._log_dirs import refused_run_logs, unused_log_dir
from torchrec_lookahead.errors import ConfigError


def _set_up(logger: TensorBoardLogger) -> Path:
    """What a run writes before its first step: its hyperparameters and a set-up report."""
    logger.log_hyperparams({"lr": 0.1})
    logger.experiment.add_text("lookahead/cache_plan", "t: 8 rows", global_step=0)
    logger.save()
    logger.experiment.flush()
    path = Path(logger.log_dir)
    (path / "config.yaml").write_text("trainer: {}\n")
    return path


def test_a_version_with_only_the_set_up_is_unused_and_one_with_anything_else_is_kept(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    path = _set_up(logger)
    assert unused_log_dir(path)
    (path / "checkpoints").mkdir()
    assert not unused_log_dir(path)
    (path / "checkpoints").rmdir()
    logger.log_metrics({"train_loss": 0.5}, step=1)
    logger.experiment.flush()
    assert not unused_log_dir(path)


def _trainer(logger: TensorBoardLogger, global_step: int = 0) -> object:
    return SimpleNamespace(loggers=[logger], global_step=global_step, is_global_zero=True)


def _refuse(trainer: object, logger: TensorBoardLogger, error: BaseException) -> None:
    with pytest.raises(type(error)):
        with refused_run_logs(trainer, lambda e: isinstance(e, ConfigError)):  # type: ignore[arg-type]
            _set_up(logger)
            raise error


def test_only_a_refused_runs_own_unused_version_is_removed(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    _refuse(_trainer(logger), logger, ConfigError("bad"))
    assert not (tmp_path / "lightning_logs").exists()  # the version, and the root it made
    kept = TensorBoardLogger(tmp_path)
    _refuse(_trainer(kept), kept, RuntimeError("a crash, not a refusal"))
    again = TensorBoardLogger(tmp_path, version=0)  # the same version, there before this run
    _refuse(_trainer(again), again, ConfigError("bad"))
    trained = TensorBoardLogger(tmp_path)
    _refuse(_trainer(trained, global_step=3), trained, ConfigError("bad"))
    assert sorted(p.name for p in (tmp_path / "lightning_logs").iterdir()) == ["version_0", "version_1"]
