"""Bit-exact multi-rank cached training at the default job's size, over a whole epoch.

Recommendation training is chaotic (a 1e-7 nudge to one dense weight grows to 0.1 within 50 steps of the default
job), so these runs compare bit for bit: ``verify`` on two ranks trains the cached model (LRPP cache, delayed
synchronisation, FBGEMM's kernel for the cached rows) and TorchRec's own ``DistributedModelParallel`` training of
the resident model, with the same ranks, data split and optimizers, and the weights must be equal.

The two comparisons run in one launch (``tests/verify_runs.py``): the default job at one seed without dropout,
and the budget job (the same model, its caches sized by the planner) at another seed with dropout, so that both
jobs, both seeds and dropout's masks on two ranks are each checked over a whole epoch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import pytest
import yaml

from ..verify_runs import launch, selected

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

#: The default job's capacities, doubled: capacities are rows for the *global* batch (both ranks' slices).
GLOBAL_CAPACITY = {"t_cat_2": 10200, "t_cat_3": 4400, "t_cat_11": 8400, "t_cat_15": 5600, "t_cat_20": 7200}


def _run(name: str, *configs: str, seed: int, dropout: float) -> Dict[str, Any]:
    overrides = ["--trainer.devices=2", f"--seed_everything={seed}", f"--model.init_args.dropout={dropout}"]
    return {"name": name, "config": list(configs), "steps": 300, "overrides": overrides}


def _runs(tmp: Path) -> List[Dict[str, Any]]:
    override = tmp / "global_capacity.yaml"
    sharder = {
        "class_path": "torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder",
        "init_args": {"capacity": GLOBAL_CAPACITY},
    }
    strategy = {
        "class_path": "torchrec_lookahead.strategies.TorchRecStrategy",
        "init_args": {"sharders": [sharder]},
    }
    override.write_text(yaml.safe_dump({"trainer": {"strategy": strategy}}))
    default, budget = ["configs/dlrm_lookahead.yaml", str(override)], ["configs/dlrm_lookahead_budget.yaml"]
    return [
        _run("test_default_job_two_ranks_whole_epoch_bit_exact", *default, seed=0, dropout=0.0),
        _run("test_budget_job_two_ranks_whole_epoch_with_dropout_bit_exact", *budget, seed=1313, dropout=0.1),
    ]


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    tmp = tmp_path_factory.mktemp("multirank")
    return launch(tmp, selected(request, _runs(tmp)), timeout=3600)[0]


def test_default_job_two_ranks_whole_epoch_bit_exact(
    request: pytest.FixtureRequest, results: Dict[str, Any]
) -> None:
    """configs/dlrm_lookahead.yaml with capacities for the global batch: 300 steps (the epoch), weights equal."""
    result = results[request.node.name]
    assert result["steps"] == 300, result
    assert result["max_abs_weight_diff"] == 0.0 and result["max_abs_loss_diff"] == 0.0, result


def test_budget_job_two_ranks_whole_epoch_with_dropout_bit_exact(
    request: pytest.FixtureRequest, results: Dict[str, Any]
) -> None:
    """configs/dlrm_lookahead_budget.yaml (caches sized by the planner for the global batch) at another seed,
    with dropout on the bottom MLP (its masks come from the global random stream, which every rank's cached fit
    keeps): weights equal."""
    result = results[request.node.name]
    assert result["steps"] == 300, result
    assert result["max_abs_weight_diff"] == 0.0 and result["max_abs_loss_diff"] == 0.0, result
