"""Shared plumbing of the benchmark scripts: machine description, tables, JSON output, timing callback."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence

import lightning.pytorch as pl
import torch


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a small variant that finishes in about a minute")
    p.add_argument("--json", metavar="PATH", help="write the headline figures to this JSON file")
    return p


def machine() -> Dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def table(rows: Sequence[Dict[str, Any]], columns: Optional[List[str]] = None) -> str:
    if not rows:
        return "(no rows)"
    cols = columns or list(rows[0].keys())

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(cols, widths)), "-|-".join("-" * w for w in widths)]
    lines += [" | ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def write_json(path: Optional[str], figures: Dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({**figures, "machine": machine()}, f, indent=2, sort_keys=True)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


class StepTimer(pl.Callback):
    """Wall time of training steps after ``warmup`` steps (forward, backward, optimizer, data fetch)."""

    def __init__(self, warmup: int = 3) -> None:
        self.warmup = warmup
        self.times: List[float] = []
        #: CPU time of the training thread in each timed step (its off-CPU time is the difference)
        self.cpu_times: List[float] = []
        self._last: Optional[float] = None
        self._last_cpu = 0.0
        self.torch_threads = 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        self.torch_threads = torch.get_num_threads()  # during training (LookaheadDataModule may lower it)
        if self._last is not None and trainer.global_step > self.warmup:
            self.times.append(now - self._last)
            self.cpu_times.append(cpu - self._last_cpu)
        self._last, self._last_cpu = now, cpu


class StepTimeLog(StepTimer):
    """:class:`StepTimer` that also logs each timed step's wall time to the Trainer's logger as
    ``time/step_ms`` (rank 0), for runs in another process (e.g. under torchrun) read back from the logs."""

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        timed = len(self.times)
        super().on_train_batch_end(trainer, *args)
        if len(self.times) > timed and trainer.logger is not None and trainer.is_global_zero:
            trainer.logger.log_metrics({"time/step_ms": self.times[-1] * 1e3}, step=trainer.global_step)
