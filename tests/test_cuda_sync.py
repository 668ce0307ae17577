"""A steady cached step only launches device work: no host-device synchronisation from this package's code on the
training thread, and no race between streams.

* ``test_no_synchronisation_by_the_cache_in_a_steady_step``: the default job (``configs/dlrm_lookahead.yaml``) trains
  ``WARMUP`` steps (its caches full, every step evicting), then ``STEADY`` steps under
  ``torch.cuda.set_sync_debug_mode("warn")``. Every synchronising call is recorded with its thread and where it was
  made; one made through this package's code on the training thread fails the test. The others (TorchRec's,
  Lightning's, the planner's and stager's threads) are recorded in the test's properties, so that the GPU run names
  them.
* ``test_no_stream_race_under_the_cuda_sanitizer``: the same job under the CUDA stream sanitizer
  (``TORCH_CUDA_SANITIZER=1``, in its own interpreter: it must be set before torch starts), which fails on an
  unsynchronised access of one tensor from two streams (the kind of race TorchRec #4191 reports).

Skipped where torch sees no GPU. ``TRL_TEST_DEVICE=cpu`` runs the first on the CPU, a check of the harness: the CPU
has no synchronisation to find, so it checks only that the window covers steady, evicting steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import pytest
import torch

from .conftest import REPO
from .test_cuda_training import ACCELERATOR, DEVICE
from .test_cuda_training import pytestmark as pytestmark  # the device's marks: cuda, skipped without one

DEFAULT = str(REPO / "configs" / "dlrm_lookahead.yaml")
#: steps before the window (the default job's caches are full after about 20) and in it
WARMUP, STEADY = (60, 30) if DEVICE.type == "cuda" else (40, 6)
PACKAGE = f"{os.sep}torchrec_lookahead{os.sep}"


def _where(frame: traceback.FrameSummary) -> str:
    path = frame.filename
    for root in (str(REPO) + os.sep, os.sep + "site-packages" + os.sep):
        if root in path:
            path = path.split(root, 1)[1]
    return f"{path}:{frame.lineno} {frame.name}"


class SyncRecorder(pl.Callback):
    """Records every synchronising CUDA call from the end of step ``start`` to the end of step ``start + steps``
    (torch's sync debug mode, ``"warn"``: a warning per call), with its thread, the innermost frame of this package
    on its stack (``ours``, ``None`` when the call did not pass through it) and the frame that made it (``at``);
    and the rows each step in the window wrote back (evictions)."""

    def __init__(self, start: int, steps: int, cuda: bool) -> None:
        self.start, self.stop = start, start + steps
        self.cuda = cuda
        self.syncs: List[Dict[str, Optional[str]]] = []
        self.written_back: List[int] = []
        self._catch: Optional[warnings.catch_warnings] = None  # type: ignore[type-arg]
        self._before = 0

    def _rows_written_back(self, trainer: pl.Trainer) -> int:
        stats = trainer.strategy.cache_session().stats()
        return sum(c.get("rows_written_back", 0) for c in stats.tables.values())

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if self._catch is not None:
            now = self._rows_written_back(trainer)
            self.written_back.append(now - self._before)
            self._before = now
        if step == self.start:
            self._before = self._rows_written_back(trainer)
            self.begin()
        elif step == self.stop:
            self.end()

    def begin(self) -> None:
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show
        if self.cuda:
            torch.cuda.set_sync_debug_mode("warn")

    def end(self) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
        if self._catch is not None:
            self._catch.__exit__(None, None, None)
            self._catch = None

    def _show(self, message: Any, *args: Any, **kwargs: Any) -> None:
        if "synchroniz" not in str(message):
            return
        stack = [f for f in traceback.extract_stack()[:-1] if "warnings" not in os.path.basename(f.filename)]
        ours = [f for f in stack if PACKAGE in f.filename and f"{os.sep}tests{os.sep}" not in f.filename]
        self.syncs.append(
            {
                "thread": threading.current_thread().name,
                "ours": _where(ours[-1]) if ours else None,
                "at": _where(stack[-1]) if stack else None,
            }
        )


def _summary(syncs: List[Dict[str, Optional[str]]]) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for s in syncs:
        key = f"{s['thread']} | {s['ours'] or s['at']}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def test_no_synchronisation_by_the_cache_in_a_steady_step(tmp_path: Path, record_property) -> None:
    from torchrec_lookahead.launch import build_cli

    cli = build_cli(["--config", DEFAULT, f"--trainer.accelerator={ACCELERATOR}",
                     f"--trainer.max_steps={WARMUP + STEADY}", "--trainer.logger=false",
                     "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
                     "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={tmp_path}"])  # fmt: skip
    recorder = SyncRecorder(WARMUP, STEADY, cuda=DEVICE.type == "cuda")
    cli.trainer.callbacks.append(recorder)
    try:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    finally:
        recorder.end()
    training = threading.main_thread().name
    ours = [s for s in recorder.syncs if s["thread"] == training and s["ours"] is not None]
    record_property("syncs_by_the_cache_on_the_training_thread", json.dumps(_summary(ours)))
    record_property("syncs_all", json.dumps(_summary(recorder.syncs)))
    record_property("rows_written_back_per_step", json.dumps(recorder.written_back))
    assert len(recorder.written_back) == STEADY and min(recorder.written_back) > 0, recorder.written_back
    assert not ours, _summary(ours)


def test_no_stream_race_under_the_cuda_sanitizer(tmp_path: Path, record_property) -> None:
    if DEVICE.type != "cuda":
        pytest.skip("the CUDA stream sanitizer needs CUDA")
    run = subprocess.run(
        [sys.executable, "-m", "torchrec_lookahead", "fit", "--config", DEFAULT, "--trainer.accelerator=gpu",
         "--trainer.max_steps=25", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
         "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0",
         f"--trainer.default_root_dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "TORCH_CUDA_SANITIZER": "1", "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    out = run.stdout + run.stderr
    record_property("returncode", run.returncode)
    record_property("output_tail", out[-3000:])
    assert run.returncode == 0 and "CSAN" not in out and "data race" not in out.lower(), out[-3000:]
