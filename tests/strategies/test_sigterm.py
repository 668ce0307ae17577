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
from typing import List, Optional, Tuple

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


def _run_until_every_rank_ends(
    tmp_path: Path, extra: List[str], signal_at: Optional[Path]
) -> Tuple[int, str]:
    """Run the tiny cached job on 2 Lightning-launched ranks with ``extra`` arguments, send SIGTERM to rank 0 once
    ``signal_at`` exists (``None``: the run signals itself), and wait for every rank to end. Returns rank 0's exit
    status and the run's output."""
    cmd = [sys.executable, "-m", "torchrec_lookahead", "fit", "--config", "configs/dlrm_tiny_lookahead.yaml",
           "--trainer.devices=2", f"--trainer.default_root_dir={tmp_path}", *extra]  # fmt: skip
    log = (tmp_path / "out.txt").open("w")
    # Lightning starts rank 1 as a child of rank 0; a session of their own lets the test see (and end) both.
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=clean_env(), start_new_session=True
    )
    try:
        deadline = time.monotonic() + HANG_S
        while signal_at is not None and not signal_at.is_file():  # no event to wait on: poll the file
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "out.txt").read_text()[
                -3000:
            ]
            time.sleep(0.2)
        if signal_at is not None:
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
    return int(proc.returncode), (tmp_path / "out.txt").read_text()


def _checkpoints(ckpts: Path) -> List[str]:
    return ["--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={ckpts}",
            "--trainer.callbacks.every_n_train_steps=4", "--trainer.callbacks.save_top_k=-1"]  # fmt: skip


def _last_checkpoint(ckpts: Path) -> Path:
    return max(ckpts.glob("*.ckpt"), key=lambda p: int(p.name.split("step=")[1].split(".")[0]))


def test_sigterm_stops_every_rank_of_a_lightning_launched_run_with_a_usable_checkpoint(
    tmp_path: Path,
) -> None:
    ckpts = tmp_path / "ckpt"
    extra = [f"--data.init_args.datamodule.init_args.num_train_batches={STEPS}", "--trainer.limit_val_batches=0",
             *_checkpoints(ckpts)]  # fmt: skip
    code, text = _run_until_every_rank_ends(tmp_path, extra, ckpts / "epoch=0-step=8.ckpt" / "meta.pt")
    stops = re.findall(r"SIGTERM: every rank stops after step (\d+)", text)
    assert code != 0 and len(stops) == 1, text[-3000:]
    # the ranks stopped at the step they agreed on, after the checkpoint the signal waited for and long before
    # the end of the epoch (a run that went on to its end would have written the checkpoints of the later steps)
    stop = int(stops[0])
    assert 8 <= stop < STEPS, text[-3000:]
    assert "Traceback" not in text, text[-3000:]  # no rank failed on a peer that left a collective
    last = _last_checkpoint(ckpts)
    assert int(last.name.split("step=")[1].split(".")[0]) <= stop, sorted(
        p.name for p in ckpts.glob("*.ckpt")
    )
    summary = export_checkpoint(last, tmp_path / "served.ckpt")  # reads every rank's shards
    assert summary["embedding_tables"] == 26


def test_sigterm_during_validation_stops_every_rank_after_the_same_validation_batch(tmp_path: Path) -> None:
    """Rank 0 signals itself before validation batch 3 of the validation after step 8 (of 16 batches): every rank
    ends that validation after the same batch, instead of validating to its end and stopping at the next
    training step."""
    ckpts = tmp_path / "ckpt"
    extra = ["--data.init_args.datamodule.init_args.num_train_batches=24",
             "--data.init_args.datamodule.init_args.num_val_batches=32", "--trainer.val_check_interval=8",
             "--trainer.callbacks+=tests.strategies.signal_callbacks.SignalDuringValidation",
             *_checkpoints(ckpts)]  # fmt: skip
    code, text = _run_until_every_rank_ends(tmp_path, extra, None)
    assert code != 0 and "SIGTERM: every rank stops in the validation after step 8" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    seen = [tuple(int(x) for x in m) for m in re.findall(r"validation (\d) (\d+) (\d+)$", text, re.M)]
    for rank in (0, 1):
        batches = [b for r, step, b in seen if r == rank and step == 8]
        # the ranks agree before each batch: the signal sent before batch 3 is seen by both at batch 3 or 4
        assert batches and max(batches) in (3, 4), (rank, batches, text[-3000:])
        assert not [s for r, s, _ in seen if r == rank and s > 8], text[-3000:]  # no training after it
    assert {b for r, s, b in seen if r == 0 and s == 8} == {b for r, s, b in seen if r == 1 and s == 8}
    summary = export_checkpoint(_last_checkpoint(ckpts), tmp_path / "served.ckpt")
    assert summary["embedding_tables"] == 26
