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


def test_two_ranks_fae_mid_epoch_checkpoint_resumes_the_same_weights(tmp_path: Path) -> None:
    """A checkpoint at step 5 of the 12-step epoch (pinned rows flushed into the stores, the hot/cold position and
    the scheduler saved) resumed on two ranks ends at step 10 with the uninterrupted run's weights, bit for bit."""
    from ..strategies.test_torchrun import _ckpt_args, _full_state

    common = ["fit", "--config", TINY, "--trainer.devices=2", "--trainer.max_steps=10"]
    full = torchrun(
        2, *common, f"--trainer.default_root_dir={tmp_path}/a", *_ckpt_args(tmp_path / "a_ckpt", 5)
    )
    assert full.returncode == 0, full.stderr[-4000:]
    mid = tmp_path / "a_ckpt" / "epoch=0-step=5.ckpt"
    resumed = torchrun(2, *common, f"--trainer.default_root_dir={tmp_path}/b", f"--ckpt_path={mid}",
                       *_ckpt_args(tmp_path / "b_ckpt", 5))  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    a = _full_state(tmp_path / "a_ckpt" / "epoch=0-step=10.ckpt", tmp_path)
    b = _full_state(tmp_path / "b_ckpt" / "epoch=0-step=10.ckpt", tmp_path)
    cached = [k for k in a if ".cache.embedding_bags." in k and k.endswith(".weight")]
    assert cached and a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def test_two_ranks_recalibrating_fae_cached_equals_resident(
    request: pytest.FixtureRequest, verified: Tuple[Dict, Any]
) -> None:
    """recalibrate="epoch" on two ranks: each rank counts the same all-gathered global epoch, so both compute the
    same next hot set and re-pin it at the epoch start; 36 steps are three epochs of 12 global batches."""
    result, output = _verified(request, verified)
    assert result["max_abs_loss_diff"] == 0.0 and result["steps"] == 36, result
    assert "Recalibrated the hot set from 1,536 samples" in output
    assert " promoted" in output and "(0 promoted, 0 demoted)" in output
