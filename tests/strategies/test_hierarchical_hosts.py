"""Two "hosts" on this machine: two torchrun launchers of two ranks each (``--nnodes=2``, c10d rendezvous). The
default group is the ranks of one node, so each host holds one dense replica and only averaging crosses hosts;
one round of mean averaging with SGD every step equals four-rank synchronous data parallel."""

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


def _hosts(tmp: Path, runs: list) -> list:
    port = free_port()
    procs = []
    for _ in range(2):  # two launchers, one per "host"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=ht{port}",
               "-m", "tests.strategies.hierarchical_runs", str(tmp), json.dumps(runs)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=clean_env(), text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
    outs = [p.communicate(timeout=500) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    return outs


def test_one_group_per_host_averaged_every_step_equals_data_parallel(tmp_path: Path) -> None:
    runs = [
        {"name": "dp", "strategy": "torchrec", "steps": 8, "dense": "sgd", "emb": "sgd", "num_nodes": 2},
        {
            "name": "ht",
            "strategy": {"averaging": "mean"},
            "steps": 8,
            "dense": "sgd",
            "emb": "sgd",
            "num_nodes": 2,
        },
    ]
    outs = _hosts(tmp_path, runs)
    logs = "".join(o + e for o, e in outs)
    assert "Hierarchical placement (group_size=2)" in logs  # the default: the ranks of one node
    dp = torch.load(tmp_path / "dp.pt", weights_only=False)
    ht = torch.load(tmp_path / "ht.pt", weights_only=False)
    assert len(dp) == len(ht) == 4
    for a, b in zip(dp, ht):
        assert a.keys() == b.keys()
        assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
