"""SIGTERM to a multi-rank run that Lightning launched (no torchrun) stops every rank within seconds, and the last
checkpoint is whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchrec_lookahead.export import export_checkpoint

from ..cli.test_cli import clean_env
from ..conftest import REPO

pytestmark = pytest.mark.distributed


def _group_alive(proc: subprocess.Popen) -> bool:
    proc.poll()  # reap the launching rank, whose zombie would still count in its process group
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_stops_every_rank_of_a_lightning_launched_run_with_a_usable_checkpoint(
    tmp_path: Path,
) -> None:
    ckpts = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torchrec_lookahead", "fit", "--config", "configs/dlrm_tiny_lookahead.yaml",
           "--trainer.devices=2", "--data.init_args.datamodule.init_args.num_train_batches=200",
           "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={tmp_path}",
           "--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={ckpts}",
           "--trainer.callbacks.every_n_train_steps=4", "--trainer.callbacks.save_top_k=-1"]  # fmt: skip
    log = (tmp_path / "out.txt").open("w")
    # Lightning starts rank 1 as a child of rank 0; a session of their own lets the test see (and end) both.
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=clean_env(), start_new_session=True
    )
    try:
        deadline = time.monotonic() + 240
        while not (ckpts / "epoch=0-step=8.ckpt" / "meta.pt").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "out.txt").read_text()[
                -3000:
            ]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # to rank 0 alone, as `timeout` or `kill` send it
        stopped = time.monotonic() + 20
        while _group_alive(proc) and time.monotonic() < stopped:
            time.sleep(0.2)
        assert not _group_alive(proc), "ranks still running 20 s after SIGTERM"
    finally:
        if _group_alive(proc):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    text = (tmp_path / "out.txt").read_text()
    assert proc.returncode != 0 and "SIGTERM: every rank stops after step" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]  # no rank failed on a peer that left a collective
    last = max(ckpts.glob("*.ckpt"), key=lambda p: int(p.name.split("step=")[1].split(".")[0]))
    summary = export_checkpoint(last, tmp_path / "served.ckpt")  # reads every rank's shards
    assert summary["embedding_tables"] == 26
