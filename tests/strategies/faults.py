"""A test-only fault injector for runs under ``torchrun --max-restarts``."""

from __future__ import annotations

import os
import signal
from typing import Any

import lightning.pytorch as pl


class KillAtStep(pl.Callback):
    """SIGKILL this process after optimizer step ``step`` on global rank ``rank`` during the first attempt of a
    torchrun job (``TORCHELASTIC_RESTART_COUNT`` 0), so a restarted attempt runs through."""

    def __init__(self, step: int, rank: int = 1) -> None:
        self.step = step
        self.rank = rank

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first and trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
