"""Pinned hot rows on two gloo ranks under torchrun: every rank holds every hot row and updates it from every bag
of the global batch that reads it, in TorchRec's order, so FAE cached training equals DMP's resident training of
the same hot/cold stream bit for bit. The 30-step runs cross epoch ends (re-pinning) and stop mid-epoch (the cold
pass's gathers end in lockstep)."""

from __future__ import annotations

import json

import pytest

from ..conftest import REPO
from ..strategies.test_torchrun import torchrun

pytestmark = [pytest.mark.distributed]

TINY = str(REPO / "configs" / "dlrm_tiny_fae_lookahead.yaml")


def _verify(config: str, steps: int, *overrides: str, timeout: int = 600) -> dict:
    out = torchrun(
        2, "verify", "--config", config, "--trainer.devices=2", "--steps", str(steps), "--tolerance", "0",
        *overrides, timeout=timeout,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "Pinned hot rows in the lookahead cache" in out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad"])
def test_two_ranks_fae_cached_equals_resident(optimizer: str) -> None:
    result = _verify(TINY, 30, f"--model.init_args.embedding_optimizer.name={optimizer}")
    assert result["passed"] and result["max_abs_weight_diff"] == 0.0, result
    assert result["max_abs_loss_diff"] == 0.0 and result["steps"] == 30, result


@pytest.mark.slow
def test_two_ranks_default_fae_job_whole_epoch_bit_exact() -> None:
    """configs/dlrm_fae.yaml on two ranks of 1,024 rows each (the default job's global batch of 2,048): the whole
    epoch, 300 steps, weights and losses equal."""
    batch = "--data.init_args.datamodule.init_args.datamodule.init_args.batch_size=1024"
    result = _verify(str(REPO / "configs" / "dlrm_fae.yaml"), 300, batch, timeout=1800)
    assert result["passed"] and result["max_abs_weight_diff"] == 0.0 and result["steps"] == 300, result
