"""The lockstep signal connector in one process: Lightning's per-step broadcast of the SIGTERM flag becomes a local
check (no collective on the training step's path)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from torchrec_lookahead.strategies._signals import LockstepSignalConnector, use_lockstep_signals


def test_lightnings_per_step_sigterm_broadcast_becomes_a_local_check(monkeypatch):
    trainer = pl.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False
    )
    connector = use_lockstep_signals(trainer)
    assert isinstance(trainer._signal_connector, LockstepSignalConnector)
    assert use_lockstep_signals(trainer) is connector  # once per trainer

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective on the training step's path")

    monkeypatch.setattr(dist, "broadcast", no_collective)
    loop = trainer.fit_loop.epoch_loop
    loop._broadcast_sigterm_tensor()  # no signal: nothing happens
    connector.received_sigterm = True  # what the agreement sets on every rank
    with pytest.raises(SIGTERMException):
        loop._broadcast_sigterm_tensor()


def test_sigterm_of_one_process_says_where_it_stopped_and_exits_non_zero(tmp_path):
    """One rank stopped by SIGTERM exited 0 without a word (Lightning's SIGTERMException is a SystemExit without a
    code); two ranks said where they stopped and exited 1."""
    import subprocess
    import sys

    from ..cli.test_cli import clean_env
    from ..conftest import REPO

    run = subprocess.run(
        [sys.executable, "-m", "torchrec_lookahead", "fit", "--config", "configs/dlrm_tiny_lookahead.yaml",
         "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.limit_val_batches=0",
         "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}",
         "--trainer.callbacks+=tests.strategies.signal_callbacks.SignalAtStep", "--trainer.callbacks.at_step=3"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**clean_env(), "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 1, out[-3000:]
    assert "SIGTERM: the run stops after step 3 (the caches are flushed)" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
