"""Training over disk stores under torchrun: 2 ranks equal to TorchRec's resident training, and a rank killed
with kill -9 after a checkpoint, resumed from the checkpoint's chains, equal to the uninterrupted run (1 and 2
ranks). Apart from ``test_disk_tier.py`` so that the one-process whole epochs there run beside these launches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List

import pytest
import torch

from .test_disk_tier import disk_sharder


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_over_disk_stores_equal_torchrec_resident_training(tmp_path: Path) -> None:
    from ..strategies.test_torchrun import torchrun

    # 5,304 bytes per rank: the smallest whose shares hold one global step's rows on each shard (t_cat_15's 34)
    out = torchrun(2, "verify", "--config", "configs/dlrm_tiny_lookahead.yaml", "--trainer.devices=2",
                   "--steps", "24", disk_sharder(tmp_path, 5304))  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["passed"] and result["max_abs_weight_diff"] == 0.0, result


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [1, 2])
def test_kill_9_after_a_checkpoint_then_resume_equals_the_uninterrupted_run(
    tmp_path: Path, ranks: int
) -> None:
    """A rank is SIGKILLed after step 10 of 12 (the last checkpoint at step 8, deltas over step 4's full pieces,
    written in the background); torchrun restarts the job, which resumes over fresh disk stores from the
    checkpoint's chains and ends with the uninterrupted run's weights, bit for bit."""
    from torchrec_lookahead.strategies._checkpoint import read_chain

    from ..conftest import free_port
    from ..strategies.test_torchrun import _ckpt_args, torchrun

    common = ["fit", "--config", "configs/dlrm_tiny_lookahead.yaml", f"--trainer.devices={ranks}",
              "--trainer.limit_val_batches=0", "--trainer.max_steps=12", "--ckpt_path=last"]  # fmt: skip

    def run(name: str, *extra: str) -> Any:
        ckpt = [*_ckpt_args(tmp_path / f"{name}_ckpt", 4), "--trainer.callbacks.save_last=true"]
        return torchrun(ranks, *common, f"--trainer.default_root_dir={tmp_path}/{name}", *ckpt,
                        disk_sharder(tmp_path / f"{name}_stores", 6552), *extra,
                        launcher=[f"--master_port={free_port()}", "--max-restarts=1"], timeout=300)  # fmt: skip

    full = run("a")
    assert full.returncode == 0, full.stderr[-4000:]
    # the killed run writes its checkpoints' deltas in the background (every rank, rank 0 finishing them)
    killed = run("b", "--trainer.callbacks+=tests.strategies.faults.KillAtStep", "--trainer.callbacks.step=10",
                 f"--trainer.callbacks.rank={ranks - 1}",
                 "--trainer.strategy.init_args.async_checkpoints=true")  # fmt: skip
    assert killed.returncode == 0, killed.stderr[-4000:]
    assert "Restored all states from the checkpoint" in killed.stdout + killed.stderr
    ends = [tmp_path / f"{r}_ckpt" / "epoch=0-step=12.ckpt" for r in "ab"]
    # the checkpoints keep the disk-stored tables as chains of pieces of every rank's files, not as tensors
    for end in ends:
        assert [k.split(".cache.")[1] for k in _stored_keys(end, "t_cat_2")] == [
            "embedding_bags.t_cat_2.store_files"
        ]
        assert len(list(end.glob("stores/rank*/embedding_bags.t_cat_2/chain.json"))) == ranks
    mid = tmp_path / "a_ckpt" / "epoch=0-step=8.ckpt"
    assert len(read_chain(mid, 0, "embedding_bags.t_cat_2")) >= 2  # step 8: deltas over step 4's full piece
    a, b = (_whole_tables(e) for e in ends)
    assert any(".cache.embedding_bags." in k and k.endswith(".weight") for k in a) and a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _stored_keys(ckpt: Path, table: str) -> List[str]:
    """The keys the distributed checkpoint ``ckpt`` holds for ``table``."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    return [k for k in keys if f"embedding_bags.{table}." in k]


def _whole_tables(ckpt: Path) -> Any:
    """Every tensor of ``ckpt``'s state dict, disk-stored tables read from the copies of their files."""
    from torchrec_lookahead.export import _load_whole

    return {k: v for k, v in _load_whole(ckpt)["state_dict"].items() if isinstance(v, torch.Tensor)}
