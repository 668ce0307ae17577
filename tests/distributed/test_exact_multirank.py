"""Bit-exact multi-rank cached training at the default job's size, over a whole epoch.

Recommendation training is chaotic (a 1e-7 nudge to one dense weight grows to 0.1 within 50 steps of the default
job), so these runs compare bit for bit: ``verify`` on two ranks trains the cached model (LRPP cache, delayed
synchronisation, FBGEMM's kernel for the cached rows) and TorchRec's own ``DistributedModelParallel`` training of
the resident model, with the same ranks, data split and optimizers, and the weights must be equal.

Each rank reads 1,024 rows of every batch, so the two ranks train the default job's own global batches (2,048
rows, 300 of them: the epoch) and its capacities, which are rows of the global batch, apply unchanged. The two
comparisons run in one launch (``tests/verify_runs.py``) at the same seed, with dropout on the bottom MLP (its
masks come from the global random stream, which every rank's cached fit keeps), so that they share one resident
run: the default job (its configured capacities) and the budget job (the same model, its caches sized by the
planner).
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest

from ..verify_runs import launch, selected

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

#: Per rank: the two ranks' slices make the default job's global batch of 2,048 rows.
OVERRIDES = [
    "--trainer.devices=2",
    "--seed_everything=1313",
    "--model.init_args.dropout=0.1",
    "--data.init_args.datamodule.init_args.batch_size=1024",
]

RUNS: List[Dict[str, Any]] = [
    {"name": name, "config": [config], "steps": 300, "overrides": OVERRIDES}
    for name, config in (
        ("test_default_job_two_ranks_whole_epoch_bit_exact", "configs/dlrm_lookahead.yaml"),
        ("test_budget_job_two_ranks_whole_epoch_bit_exact", "configs/dlrm_lookahead_budget.yaml"),
    )
]


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    return launch(tmp_path_factory.mktemp("multirank"), selected(request, RUNS), timeout=3600)[0]


def test_default_job_two_ranks_whole_epoch_bit_exact(
    request: pytest.FixtureRequest, results: Dict[str, Any]
) -> None:
    """configs/dlrm_lookahead.yaml on two ranks: 300 steps (the epoch), weights and losses equal."""
    result = results[request.node.name]
    assert result["steps"] == 300, result
    assert result["max_abs_weight_diff"] == 0.0 and result["max_abs_loss_diff"] == 0.0, result


def test_budget_job_two_ranks_whole_epoch_bit_exact(
    request: pytest.FixtureRequest, results: Dict[str, Any]
) -> None:
    """configs/dlrm_lookahead_budget.yaml (caches sized by the planner for the global batch) on two ranks: weights
    and losses equal to the same resident run."""
    result = results[request.node.name]
    assert result["steps"] == 300, result
    assert result["max_abs_weight_diff"] == 0.0 and result["max_abs_loss_diff"] == 0.0, result
