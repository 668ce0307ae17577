"""A callback the SIGTERM tests load into a CLI run (``--trainer.callbacks+=``): it sends SIGTERM to rank 0's own
process in the middle of a validation, as ``timeout`` or ``kill`` would, and prints every validation batch it
sees, so that the test can tell where each rank stopped."""

from __future__ import annotations

import os
import signal
from typing import Any

import lightning.pytorch as pl


class SignalDuringValidation(pl.Callback):
    """On rank 0, send SIGTERM to this process before validation batch ``at_batch`` of the first validation after
    ``after_step`` training steps; print ``validation <rank> <step> <batch>`` for every validation batch."""

    def __init__(self, after_step: int = 8, at_batch: int = 3) -> None:
        self.after_step = after_step
        self.at_batch = at_batch
        self.sent = False

    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        print(f"validation {trainer.global_rank} {trainer.global_step} {batch_idx}", flush=True)
        if (
            trainer.global_rank == 0
            and not self.sent
            and trainer.global_step >= self.after_step
            and batch_idx == self.at_batch
        ):
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


class SignalAtStep(pl.Callback):
    """Send SIGTERM to this process at the end of training step ``at_step`` (as ``timeout`` or ``kill`` would)."""

    def __init__(self, at_step: int = 3) -> None:
        self.at_step = at_step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at_step:
            os.kill(os.getpid(), signal.SIGTERM)


class StopAt(pl.Callback):
    """Set ``trainer.should_stop`` at the end of training batch ``at`` (on rank 0 alone with ``rank0_only``, as a
    callback reading a rank-local metric would); at the end of training, write the step each rank stopped after to
    ``stopped_<rank>`` in the run's root directory."""

    def __init__(
        self, at: int = 5, rank0_only: bool = True, in_validation: bool = False, at_epoch_end: bool = False
    ) -> None:
        self.at = at
        self.rank0_only = rank0_only
        self.in_validation = in_validation
        self.at_epoch_end = at_epoch_end

    def _mine(self, trainer: pl.Trainer) -> bool:
        return not self.rank0_only or trainer.global_rank == 0

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int
    ) -> None:
        if not (self.in_validation or self.at_epoch_end) and idx == self.at and self._mine(trainer):
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        # a file, not a print: a rank Lightning launched may end after the test stopped reading the output
        with open(os.path.join(trainer.default_root_dir, f"stopped_{trainer.global_rank}"), "w") as f:
            f.write(str(trainer.global_step))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if self.at_epoch_end and trainer.global_step >= self.at and self._mine(trainer):
            trainer.should_stop = True

    def on_validation_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if self.in_validation and trainer.global_step >= self.at and self._mine(trainer):
            trainer.should_stop = True
