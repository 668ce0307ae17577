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

HT = {"group_size": 1, "averaging": "easgd", "elastic_alpha": 0.3, "sync_every": 4, "background": True,
      "average_at_end": False}  # fmt: skip


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


def test_a_rank_killed_under_max_restarts_resumes_with_every_group_replica(tmp_path: Path) -> None:
    """Two groups of one rank, the lookahead cache, background EASGD: rank 1 is SIGKILLed after step 6 of 12;
    torchrun restarts both ranks, which resume from the step-4 checkpoint and end with the uninterrupted run's
    weights, group 1's own replica included."""
    from .test_torchrun import _ckpt_args, torchrun

    cfg = tmp_path / "ht.yaml"
    cfg.write_text(
        "trainer:\n  strategy:\n    class_path: torchrec_lookahead.strategies.HierarchicalStrategy\n"
        "    init_args:\n      group_size: 1\n      sync_every: 2\n      background: true\n      sharders:\n"
        "        - class_path: torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder\n"
        "          init_args: {capacity: {t_cat_2: 140, t_cat_11: 120, t_cat_15: 110}}\n"
    )
    common = ["fit", "--config", "configs/dlrm_tiny_lookahead.yaml", "--config", str(cfg), "--trainer.devices=2",
              "--trainer.limit_val_batches=0", "--trainer.max_steps=12", "--ckpt_path=last"]  # fmt: skip

    def run(name: str, *extra: str):  # type: ignore[no-untyped-def]
        ckpt = [*_ckpt_args(tmp_path / f"{name}_ckpt", 4), "--trainer.callbacks.save_last=true"]
        # --standalone: the agent's store binds a port the OS picks; a port from free_port() could be taken by
        # another process between the probe and torchrun's bind
        return torchrun(2, *common, f"--trainer.default_root_dir={tmp_path}/{name}", *ckpt, *extra,
                        launcher=["--standalone", "--max-restarts=1"], timeout=600)  # fmt: skip

    full = run("a")
    assert full.returncode == 0, full.stderr[-4000:]
    killed = run("b", "--trainer.callbacks+=tests.strategies.faults.KillAtStep", "--trainer.callbacks.step=6")
    assert killed.returncode == 0, killed.stderr[-4000:]
    assert "Restored all states from the checkpoint" in killed.stdout + killed.stderr
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    for part in (
        "",
        "hierarchical",
    ):  # the shared state (tables, group 0's dense part) and every rank's own part
        states = []
        for name in ("a", "b"):
            out = tmp_path / f"{name}{part}.pt"
            dcp_to_torch_save(tmp_path / f"{name}_ckpt" / "epoch=0-step=12.ckpt" / part, out)
            states.append(torch.load(out, weights_only=False))
        flat_a, flat_b = (_tensors(s) for s in states)
        assert flat_a.keys() == flat_b.keys() and flat_a
        for k in flat_a:
            assert torch.equal(flat_a[k], flat_b[k]), k


def _tensors(state: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_tensors(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor) and v.is_floating_point():
            out[f"{prefix}{k}"] = v
    return out
