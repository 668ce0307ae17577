"""Bit-exact multi-rank cached training at the default job's size, over a whole epoch.

Recommendation training is chaotic (a 1e-7 nudge to one dense weight grows to 0.1 within 50 steps of the default
job), so these runs compare bit for bit: ``verify`` under ``torchrun`` trains the cached model (LRPP cache,
delayed synchronisation, FBGEMM's kernel for the cached rows) and TorchRec's own ``DistributedModelParallel``
training of the resident model, with the same ranks, data split and optimizers, and the weights must be equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ..strategies.test_torchrun import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

#: The default job's capacities, doubled: capacities are rows for the *global* batch (both ranks' slices).
GLOBAL_CAPACITY = {"t_cat_2": 10200, "t_cat_3": 4400, "t_cat_11": 8400, "t_cat_15": 5600, "t_cat_20": 7200}


def _verify(*configs: str, seed: int, steps: int = 300, timeout: int = 1500, dropout: float = 0.0) -> dict:
    args = [a for c in configs for a in ("--config", c)]
    out = torchrun(2, "verify", *args, "--trainer.devices=2", "--steps", str(steps), "--tolerance", "0",
                   f"--seed_everything={seed}", f"--model.init_args.dropout={dropout}", timeout=timeout)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:] + out.stdout[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("seed, dropout", [(0, 0.0), (1313, 0.1)])
def test_default_job_two_ranks_whole_epoch_bit_exact(tmp_path: Path, seed: int, dropout: float) -> None:
    """configs/dlrm_lookahead.yaml with capacities for the global batch: 300 steps (the epoch), weights equal;
    with dropout too (its masks come from the global random stream, which every rank's cached fit keeps)."""
    override = tmp_path / "global_capacity.yaml"
    sharder = {
        "class_path": "torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder",
        "init_args": {"capacity": GLOBAL_CAPACITY},
    }
    strategy = {
        "class_path": "torchrec_lookahead.strategies.TorchRecStrategy",
        "init_args": {"sharders": [sharder]},
    }
    override.write_text(yaml.safe_dump({"trainer": {"strategy": strategy}}))
    result = _verify("configs/dlrm_lookahead.yaml", str(override), seed=seed, dropout=dropout)
    assert result["steps"] == 300, result
    assert result["max_abs_weight_diff"] == 0.0 and result["max_abs_loss_diff"] == 0.0, result


@pytest.mark.parametrize("seed", [0, 1313])
def test_budget_job_two_ranks_whole_epoch_bit_exact(seed: int) -> None:
    """configs/dlrm_lookahead_budget.yaml (caches sized by the planner for the global batch): weights equal."""
    result = _verify("configs/dlrm_lookahead_budget.yaml", seed=seed)
    assert result["steps"] == 300, result
    assert result["max_abs_weight_diff"] == 0.0 and result["max_abs_loss_diff"] == 0.0, result
