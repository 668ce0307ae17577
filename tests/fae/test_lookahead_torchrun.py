"""Pinned hot rows on two gloo ranks under torchrun: every rank holds every hot row and updates it from every bag
of the global batch that reads it, in TorchRec's order, so FAE cached training equals DMP's resident training of
the same hot/cold stream bit for bit. The 30-step runs cross epoch ends (re-pinning) and stop mid-epoch (the cold
pass's gathers end in lockstep)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Tuple

import pytest
import torch

from ..conftest import REPO
from ..strategies.test_torchrun import torchrun
from ..verify_runs import launch, section, selected

pytestmark = [pytest.mark.distributed]

TINY = str(REPO / "configs" / "dlrm_tiny_fae_lookahead.yaml")


def _run(name: str, config: str, steps: int, *overrides: str) -> Dict[str, Any]:
    return {
        "name": name,
        "config": [config],
        "steps": steps,
        "overrides": ["--trainer.devices=2", *overrides],
    }


#: The ``verify`` comparisons of this file, one launch for all (``tests/verify_runs.py``).
RUNS = [
    *(
        _run(f"test_two_ranks_fae_cached_equals_resident[{opt}]", TINY, 30,
             f"--model.init_args.embedding_optimizer.name={opt}")
        for opt in ("sgd", "rowwise_adagrad", "adagrad")
    ),
    # three epochs of 12 global batches
    _run("test_two_ranks_recalibrating_fae_cached_equals_resident", TINY, 36,
         "--data.init_args.datamodule.init_args.recalibrate=epoch", "--trainer.max_epochs=3"),
    _run("test_two_ranks_default_fae_job_whole_epoch_bit_exact", str(REPO / "configs" / "dlrm_fae.yaml"), 300,
         "--data.init_args.datamodule.init_args.datamodule.init_args.batch_size=1024",
         "--model.init_args.dropout=0.1"),
]  # fmt: skip


@pytest.fixture(scope="module")
def verified(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tuple[Dict, Any]:
    return launch(tmp_path_factory.mktemp("fae_verify"), selected(request, RUNS), timeout=2400)


def _verified(request: pytest.FixtureRequest, verified: Tuple[Dict, Any]) -> Tuple[Dict[str, Any], str]:
    """The test's comparison, checked bit for bit, and what its run printed."""
    name = request.node.name
    result, done = verified[0][name], verified[1]
    output = section(done.stdout, name) + section(done.stderr, name)
    assert "Pinned hot rows in the lookahead cache" in output
    assert result["passed"] and result["max_abs_weight_diff"] == 0.0, result
    return result, output


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad"])
def test_two_ranks_fae_cached_equals_resident(
    request: pytest.FixtureRequest, verified: Tuple[Dict, Any], optimizer: str
) -> None:
    result, _ = _verified(request, verified)
    assert result["max_abs_loss_diff"] == 0.0 and result["steps"] == 30, result


@pytest.mark.slow
def test_two_ranks_default_fae_job_whole_epoch_bit_exact(
    request: pytest.FixtureRequest, verified: Tuple[Dict, Any]
) -> None:
    """configs/dlrm_fae.yaml on two ranks of 1,024 rows each (the default job's global batch of 2,048): the whole
    epoch, 300 steps, weights and losses equal."""
    result, _ = _verified(request, verified)
    assert result["steps"] == 300, result


def test_two_ranks_fae_checkpoint_chain_killed_and_resumed_from_either_piece_ends_with_the_same_weights(
    tmp_path: Path,
) -> None:
    """Over disk stores, checkpoints at steps 4 and 8 of the 12-step epoch (pinned rows flushed into the stores,
    the hot/cold position and the scheduler saved) keep each rank's tables as chains: step 4's full pieces, step
    8's deltas over them. A run whose rank 1 is SIGKILLed after step 10 (its deltas written in the background)
    resumes from the latest, step 8; another resumes from the older, step 4: both end at step 12 with the
    uninterrupted run's weights, bit for bit."""
    from torchrec_lookahead.strategies._checkpoint import read_chain

    from ..conftest import free_port
    from ..distributed.test_disk_tier import disk_sharder
    from ..distributed.test_disk_tier_torchrun import _whole_tables
    from ..strategies.test_torchrun import _ckpt_args

    capacity = "{t_cat_2: 200, t_cat_11: 160, t_cat_15: 150}"  # the config's

    def run(name: str, *extra: str) -> Any:
        ckpt = [*_ckpt_args(tmp_path / f"{name}_ckpt", 4), "--trainer.callbacks.save_last=true"]
        return torchrun(2, "fit", "--config", TINY, "--trainer.devices=2", "--trainer.max_steps=12",
                        f"--trainer.default_root_dir={tmp_path}/{name}", *ckpt,
                        "--trainer.strategy.init_args.full_checkpoint_every=4",
                        disk_sharder(tmp_path / f"{name}_stores", 8000, capacity), *extra,
                        launcher=[f"--master_port={free_port()}", "--max-restarts=1"])  # fmt: skip

    full = run("a")
    assert full.returncode == 0, full.stderr[-4000:]
    # every hot batch came with its gradient exchanges indexed ahead, as the cold ones: no backward indexed one
    metrics = (full.stdout + full.stderr).split("Final metrics: ")[-1]
    assert "cache/sync/grad_floats_sent=" in metrics, metrics
    assert "exchanges_indexed_in_backward" not in metrics, metrics
    older = tmp_path / "a_ckpt" / "epoch=0-step=4.ckpt"
    latest = tmp_path / "a_ckpt" / "epoch=0-step=8.ckpt"
    for r in (0, 1):  # step 8's deltas over step 4's full piece
        assert len(read_chain(older, r, "embedding_bags.t_cat_2")) == 1
        assert len(read_chain(latest, r, "embedding_bags.t_cat_2")) >= 2
    killed = run("b", "--ckpt_path=last", "--trainer.strategy.init_args.async_checkpoints=true",
                 "--trainer.callbacks+=tests.strategies.faults.KillAtStep", "--trainer.callbacks.step=10")  # fmt: skip
    assert killed.returncode == 0, killed.stderr[-4000:]
    assert "Restored all states from the checkpoint" in killed.stdout + killed.stderr
    resumed = run("c", f"--ckpt_path={older}")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    a, b, c = (_whole_tables(tmp_path / f"{r}_ckpt" / "epoch=0-step=12.ckpt") for r in "abc")
    assert any(".cache.embedding_bags." in k and k.endswith(".weight") for k in a)
    assert a.keys() == b.keys() == c.keys()
    assert [k for k in a if not (torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]))] == []


def test_two_ranks_recalibrating_fae_cached_equals_resident(
    request: pytest.FixtureRequest, verified: Tuple[Dict, Any]
) -> None:
    """recalibrate="epoch" on two ranks: each rank counts the same all-gathered global epoch, so both compute the
    same next hot set and re-pin it at the epoch start; 36 steps are three epochs of 12 global batches."""
    result, output = _verified(request, verified)
    assert result["max_abs_loss_diff"] == 0.0 and result["steps"] == 36, result
    assert "Recalibrated the hot set from 1,536 samples" in output
    assert " promoted" in output and "(0 promoted, 0 demoted)" in output
