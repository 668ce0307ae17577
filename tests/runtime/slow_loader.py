"""A DataModule the interrupt test loads into a CLI run (``--data.init_args.datamodule.class_path=``): the
synthetic Criteo data whose training loader blocks 120 s in ``next()`` at batch 6 of its second pass (the first
is the capacity check), after arranging a SIGINT (Ctrl-C) to its own process 2 s later."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Iterator

from torchrec_lookahead.data import CriteoSyntheticDataModule


class _Slow:
    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.passes = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.passes += 1
        for i, b in enumerate(self.loader):
            if i == 6 and self.passes == 2:
                threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
                print(f"blocked at {time.time()}", flush=True)
                time.sleep(120)
            yield b


class SlowCriteo(CriteoSyntheticDataModule):
    def train_dataloader(self) -> Any:
        return _Slow(super().train_dataloader())
