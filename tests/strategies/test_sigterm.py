"""SIGTERM to a multi-rank run that Lightning launched (no torchrun) stops every rank at the step the ranks agree
on, long before the epoch ends, and the last checkpoint is whole.

The signal is sent once the run has written a checkpoint (the marker that it trains); the waits for that file and
for the ranks to end are bounded only against a hang: the checks are about the step the run stopped at, not the
seconds it took."""

from __future__ import annotations

import os
import re
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

STEPS = 200  # training batches of the run's one epoch (each rank reads every global batch's slice)
HANG_S = 240  # bound of each wait, against a hang only


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
           "--trainer.devices=2", f"--data.init_args.datamodule.init_args.num_train_batches={STEPS}",
           "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={tmp_path}",
           "--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={ckpts}",
           "--trainer.callbacks.every_n_train_steps=4", "--trainer.callbacks.save_top_k=-1"]  # fmt: skip
    log = (tmp_path / "out.txt").open("w")
    # Lightning starts rank 1 as a child of rank 0; a session of their own lets the test see (and end) both.
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=clean_env(), start_new_session=True
    )
    try:
        deadline = time.monotonic() + HANG_S
        while not (ckpts / "epoch=0-step=8.ckpt" / "meta.pt").is_file():  # no event to wait on: poll the file
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "out.txt").read_text()[
                -3000:
            ]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # to rank 0 alone, as `timeout` or `kill` send it
        proc.wait(timeout=HANG_S)
        deadline = time.monotonic() + HANG_S
        while _group_alive(proc) and time.monotonic() < deadline:  # rank 1, a child of rank 0
            time.sleep(0.2)
        assert not _group_alive(proc), f"ranks still running {HANG_S} s after SIGTERM"
    finally:
        if _group_alive(proc):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    text = (tmp_path / "out.txt").read_text()
    stops = re.findall(r"SIGTERM: every rank stops after step (\d+)", text)
    assert proc.returncode != 0 and len(stops) == 1, text[-3000:]
    # the ranks stopped at the step they agreed on, after the checkpoint the signal waited for and long before
    # the end of the epoch (a run that went on to its end would have written the checkpoints of the later steps)
    stop = int(stops[0])
    assert 8 <= stop < STEPS, text[-3000:]
    assert "Traceback" not in text, text[-3000:]  # no rank failed on a peer that left a collective
    last = max(ckpts.glob("*.ckpt"), key=lambda p: int(p.name.split("step=")[1].split(".")[0]))
    assert int(last.name.split("step=")[1].split(".")[0]) <= stop, sorted(
        p.name for p in ckpts.glob("*.ckpt")
    )
    summary = export_checkpoint(last, tmp_path / "served.ckpt")  # reads every rank's shards
    assert summary["embedding_tables"] == 26
