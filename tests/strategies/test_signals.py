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
