"""The harness of ``tests/test_cuda_sync.py`` on the CPU: a synchronising call made through this package's code on
the training thread, in the window, is recorded as the cache's, and one outside the window is not (on a GPU, torch's
sync debug mode issues the warning; here the test issues it)."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

import pytest

from .conftest import REPO
from .test_cuda_sync import SyncRecorder


def test_the_recorder_names_a_synchronisation_made_through_the_cache(tmp_path: Path, monkeypatch) -> None:
    from torchrec_lookahead.launch import build_cli
    from torchrec_lookahead.runtime import CacheSession

    apply = CacheSession.apply
    steps = []

    def syncing_apply(self: CacheSession, batch: Any) -> None:
        steps.append(batch.plan.step)
        if batch.plan.step in (2, 5):
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        apply(self, batch)

    monkeypatch.setattr(CacheSession, "apply", syncing_apply)
    cli = build_cli(["--config", str(REPO / "configs" / "dlrm_tiny_lookahead.yaml"), "--trainer.max_steps=8",
                     "--trainer.logger=false", "--trainer.enable_checkpointing=false",
                     "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0",
                     f"--trainer.default_root_dir={tmp_path}"])  # fmt: skip
    # the window: steps 4..7 (plans 3..6), so the call at plan 5 and not the one at plan 2
    recorder = SyncRecorder(start=3, steps=4, cuda=False)
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert steps == list(range(8))
    assert len(recorder.syncs) == 1, recorder.syncs
    sync = recorder.syncs[0]
    assert sync["thread"] == threading.main_thread().name
    assert sync["ours"] is not None and sync["ours"].startswith("torchrec_lookahead/strategies/torchrec.py:")
    assert "batch_to_device" in sync["ours"] and "test_sync_recorder.py" in str(sync["at"])
    assert len(recorder.written_back) == 4
    with pytest.warns(UserWarning, match="outside"):  # the window closed: warnings are shown again
        warnings.warn("outside the window", UserWarning, stacklevel=1)
