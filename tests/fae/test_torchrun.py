"""FAE on two gloo ranks under torchrun: the hot set is broadcast, the slices gathered, every rank regroups the
same global stream and the scheduler's decisions agree (the run would hang or fail otherwise)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..strategies.test_torchrun import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_two_ranks_train_the_hot_cold_stream(tmp_path: Path) -> None:
    out = torchrun(
        2,
        "fit",
        "--config",
        "configs/dlrm_tiny_fae.yaml",
        "--trainer.devices=2",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.logger+=CSVLogger",
        f"--trainer.logger.save_dir={tmp_path}",
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "Hot samples:" in out.stdout + out.stderr
    metrics = (out.stdout.split("Final metrics: ")[-1]).strip()
    assert "fae/hot_batches=" in metrics and "fae/swaps=" in metrics, json.dumps(metrics)
