"""The pooled cache: the cached tables of one kernel and dimension share one cache, planned jointly, exactly equal
to resident training; the per-table layout stays available."""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch
from torchrec import EmbeddingBagConfig
from torchrec.modules.embedding_configs import PoolingType

from tests.modules.cache_helpers import (
    SEED,
    cached_tables,
    dmp_tables,
    loss_weights,
    make_batches,
    make_dmp,
    max_table_diff,
    train_steps,
)
from torchrec_lookahead.errors import ConfigError, SetupError
from torchrec_lookahead.modules import CachedEmbeddingBagCollection, CacheLayout, CacheOptimizerConfig
from torchrec_lookahead.oracle import LookaheadOracle
from torchrec_lookahead.oracle.types import BatchPlan, TablePlan


def _tables() -> List[EmbeddingBagConfig]:
    """Three dimension-8 tables (one MEAN: its own kernel), one of dimension 4, one left resident."""
    return [
        EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=300, feature_names=["fa", "fa2"]),
        EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=60, feature_names=["fb"]),
        EmbeddingBagConfig(name="r", embedding_dim=8, num_embeddings=40, feature_names=["fr"]),
        EmbeddingBagConfig(name="c", embedding_dim=4, num_embeddings=200, feature_names=["fc"]),
        EmbeddingBagConfig(name="d", embedding_dim=8, num_embeddings=150, feature_names=["fd"]),
        EmbeddingBagConfig(
            name="m", embedding_dim=8, num_embeddings=120, feature_names=["fm"], pooling=PoolingType.MEAN
        ),
    ]


pytestmark = pytest.mark.usefixtures("gloo_pg")

CAPACITY = {"a": 60, "b": 30, "c": 50, "d": 40, "m": 40}
OPTIMIZERS = [
    CacheOptimizerConfig("sgd", learning_rate=0.1),
    CacheOptimizerConfig("rowwise_adagrad", learning_rate=0.1),
    CacheOptimizerConfig("adagrad", learning_rate=0.1),
]


def test_slot_spaces_follow_kernel_and_dimension() -> None:
    ebc = CachedEmbeddingBagCollection(_tables(), CAPACITY)
    assert ebc.cache_layout is CacheLayout.POOLED
    assert ebc.slot_spaces == {"a+2": ("a", "b", "d"), "c": ("c",), "m": ("m",)}
    assert ebc.capacity == CAPACITY  # as configured
    assert [ebc.cache_rows(t) for t in ("a", "b", "d", "c")] == [130, 130, 130, 50]
    # one storage: a row written through one member's view is the space's
    ebc.cache_weights("a")[5].fill_(3.0)
    assert torch.equal(ebc.cache_weights("d")[5], torch.full((8,), 3.0))
    per_table = CachedEmbeddingBagCollection(_tables(), CAPACITY, cache_layout="per_table")
    assert set(per_table.slot_spaces) == set(CAPACITY) and per_table.cache_rows("a") == 60
    assert CachedEmbeddingBagCollection.layout_slot_spaces(_tables(), CAPACITY) == ebc.slot_spaces
    with pytest.raises(ConfigError, match="cache_layout"):
        CachedEmbeddingBagCollection(_tables(), CAPACITY, cache_layout="shared")


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.optim.value)
def test_pooled_and_per_table_caches_equal_resident(optimizer) -> None:
    tables, steps = _tables(), 40
    batches = make_batches(tables, steps)
    weights = loss_weights(steps, sum(t.embedding_dim * len(t.feature_names) for t in tables))
    dmp = make_dmp(tables, optimizer)
    want = list(train_steps(dmp, batches, weights))
    for layout in ("pooled", "per_table"):
        ebc = CachedEmbeddingBagCollection(tables, CAPACITY, optimizer, seed=SEED, cache_layout=layout)
        plans = list(LookaheadOracle(ebc.oracle_config(horizon=6, prefetch_depth=1)).plan_stream(batches))
        got = list(train_steps(ebc, batches, weights, plans, staged=True))
        assert all(torch.equal(g, w) for g, w in zip(got, want)), layout
        assert max_table_diff(cached_tables(ebc), dmp_tables(dmp)) == (0.0, 0.0), layout
        assert ebc.stats()["a"]["rows_fetched"] > 0


def test_a_plan_that_puts_two_tables_in_one_slot_is_refused() -> None:
    ebc = CachedEmbeddingBagCollection(_tables(), CAPACITY)
    e = torch.empty(0, dtype=torch.int64)
    one = torch.tensor([7])

    def plan(step: int, tables: Dict[str, TablePlan]) -> BatchPlan:
        return BatchPlan(step, {t: tables.get(t, TablePlan(e, e, e, e, e)) for t in CAPACITY})

    ebc.apply_plan(plan(0, {"a": TablePlan(e, e, torch.tensor([3]), one, one)}))
    with pytest.raises(SetupError, match="two tables"):
        ebc.apply_plan(plan(1, {"b": TablePlan(e, e, torch.tensor([4]), one, one)}))
    # the space's write-backs land before its loads: b takes the slot a leaves in the same plan
    ebc.apply_plan(
        plan(
            1,
            {
                "a": TablePlan(torch.tensor([3]), one, e, e, e),
                "b": TablePlan(e, e, torch.tensor([4]), one, one),
            },
        )
    )
    assert ebc.slot_ids("a")[7] == -1 and ebc.slot_ids("b")[7] == 4
