"""Two groups of one rank under torchrun: a checkpoint holds every group's own replica, dense optimizer state,
the EASGD center and the counters (DCP, every rank), and resuming from it mid-epoch (step 4 of 6 per epoch)
ends with the weights of the uninterrupted run; the averaging metrics reach TensorBoard."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ..cli.test_cli import clean_env
from ..conftest import REPO, free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

HT = {"group_size": 1, "averaging": "easgd", "elastic_alpha": 0.3, "sync_every": 4, "background": True}


def test_resume_from_a_checkpoint_equals_the_uninterrupted_run_and_metrics_are_logged(tmp_path: Path) -> None:
    runs = [
        {
            "name": "full",
            "strategy": HT,
            "steps": 12,
            "ckpt_dir": str(tmp_path / "a"),
            "ckpt_every": 4,
            "log_dir": str(tmp_path / "tb"),
        },  # fmt: skip
        {
            "name": "resumed",
            "strategy": HT,
            "steps": 12,
            "ckpt_dir": str(tmp_path / "b"),
            "ckpt_every": 4,
            "resume": str(tmp_path / "a" / "epoch=0-step=4.ckpt"),
        },  # fmt: skip
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "tests.strategies.hierarchical_runs", str(tmp_path), json.dumps(runs)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=clean_env())
    assert done.returncode == 0, done.stderr[-4000:]
    ckpt = tmp_path / "a" / "epoch=0-step=4.ckpt" / "hierarchical"
    assert len(list(ckpt.glob("*.distcp"))) == 2  # every rank wrote its own part
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    dense = [k for k in full[0] if "embedding_bags" not in k]
    assert any((full[0][k] != full[1][k]).any() for k in dense)  # the two groups hold different replicas
    for a, b in zip(full, resumed):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("rounds", "steps_since_round", "distance_to_center/group0", "distance_to_center/group1",
                "group_bytes_per_step", "cross_bytes_per_step", "comm_wait_s"):  # fmt: skip
        assert f"hierarchical/{tag}" in tags, sorted(tags)
    assert events.Scalars("hierarchical/rounds")[-1].value >= 2
