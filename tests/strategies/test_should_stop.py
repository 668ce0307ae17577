"""``trainer.should_stop`` set on one rank only (a callback reading a rank-local metric) stops every rank of a
TorchRecStrategy run after the same step, cached or resident, instead of a gloo collective mismatch (cached) or a
hang (resident)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest

from ..cli.test_cli import clean_env
from ..conftest import REPO

pytestmark = pytest.mark.distributed

HANG_S = 240  # against a hang only


def _run(tmp_path: Path, config: str, extra: List[str]) -> Tuple[int, str]:
    cmd = [sys.executable, "-m", "torchrec_lookahead", "fit", "--config", config, "--trainer.devices=2",
           f"--trainer.default_root_dir={tmp_path}", "--trainer.max_epochs=2",
           "--trainer.callbacks+=tests.strategies.signal_callbacks.StopAt", "--trainer.callbacks.rank0_only=true",
           *extra]  # fmt: skip
    try:
        proc = subprocess.run(
            cmd,
            cwd=REPO,
            capture_output=True,
            text=True,
            env=clean_env(),
            timeout=HANG_S,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the run hung: {str(e.stdout)[-3000:]}")
    return proc.returncode, proc.stdout + proc.stderr


def _last_steps(tmp_path: Path) -> dict:
    return {rank: int((tmp_path / f"stopped_{rank}").read_text()) for rank in (0, 1)}


@pytest.mark.parametrize("config", ["configs/dlrm_tiny_lookahead.yaml", "configs/dlrm_tiny.yaml"])
def test_should_stop_on_one_rank_stops_every_rank_after_the_same_step(tmp_path: Path, config: str) -> None:
    code, text = _run(tmp_path, config, ["--trainer.callbacks.at=5"])
    assert code == 0 and "Traceback" not in text, text[-3000:]
    assert _last_steps(tmp_path) == {0: 6, 1: 6}, text[-3000:]
    assert "should_stop: every rank stops after step 6" in text, text[-3000:]


def test_should_stop_set_in_validation_on_one_rank_stops_every_rank(tmp_path: Path) -> None:
    extra = [
        "--trainer.callbacks.at=4",
        "--trainer.callbacks.in_validation=true",
        "--trainer.val_check_interval=4",
    ]
    code, text = _run(tmp_path, "configs/dlrm_tiny_lookahead.yaml", extra)
    assert code == 0 and "Traceback" not in text, text[-3000:]
    assert _last_steps(tmp_path) == {0: 4, 1: 4}, text[-3000:]


def test_should_stop_set_at_an_epoch_end_on_one_rank_stops_every_rank(tmp_path: Path) -> None:
    extra = [
        "--trainer.callbacks.at=1",
        "--trainer.callbacks.at_epoch_end=true",
        "--trainer.limit_val_batches=0",
    ]
    code, text = _run(tmp_path, "configs/dlrm_tiny_lookahead.yaml", extra)
    assert code == 0 and "Traceback" not in text, text[-3000:]
    assert _last_steps(tmp_path) == {0: 12, 1: 12}, text[-3000:]  # the first epoch's 12 steps of max_epochs=2
