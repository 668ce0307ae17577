"""LookaheadPlanner: budget, placements, capacities, monotonicity, errors, the plan in the oracle."""

from __future__ import annotations

import itertools
from typing import Dict, Iterator, List

import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.data import CriteoSyntheticDataset, SyntheticCriteoConfig
from torchrec_lookahead.distributed.planner import (
    CachePlan,
    LookaheadPlanner,
    Placement,
    collect_samples,
    min_capacities,
    row_bytes,
    simulate_fetches,
    table_id_batches,
)
from torchrec_lookahead.distributed.planner.working_set import dense_ids
from torchrec_lookahead.errors import CapacityError, ConfigError, DataError, InvalidIdError
from torchrec_lookahead.modules import CacheOptimizerConfig
from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig, min_capacity

# a few large Zipf tables and many small ones, as in Criteo
SIZES = [200_000, 5_000, 300, 100_000, 7, 3, 40, 30, 2, 60, 25, 20_000, 15, 5, 35, 150, 4, 22, 18, 3]
SIZES += [120, 6, 5, 45, 9, 50_000]
DIM = 16
OPT = CacheOptimizerConfig("exact_row_wise_adagrad")
F2T = {f"cat_{i}": f"t_cat_{i}" for i in range(26)}


@pytest.fixture(scope="module")
def dataset() -> CriteoSyntheticDataset:
    return CriteoSyntheticDataset(SyntheticCriteoConfig(batch_size=256, num_batches=30, num_embeddings=SIZES))


@pytest.fixture(scope="module")
def tables(dataset: CriteoSyntheticDataset) -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=f"t_{f}", num_embeddings=n, embedding_dim=DIM, feature_names=[f])
        for f, n in dataset.num_embeddings_per_feature().items()
    ]


@pytest.fixture(scope="module")
def kjts(dataset: CriteoSyntheticDataset) -> List[KeyedJaggedTensor]:
    return [b.sparse_features for b in dataset]


def _plan(
    tables: List[EmbeddingBagConfig], kjts: List[KeyedJaggedTensor], budget: int, **kw: object
) -> CachePlan:
    return LookaheadPlanner(device_budget_bytes=budget, horizon=30, **kw).plan(tables, OPT, kjts)  # type: ignore[arg-type]


BUDGETS = [200 << 10, 300 << 10, 1 << 20, 3 << 20, 8 << 20, 32 << 20]


@pytest.mark.parametrize("budget", BUDGETS)
def test_budget_and_capacities(
    tables: List[EmbeddingBagConfig], kjts: List[KeyedJaggedTensor], budget: int
) -> None:
    plan = _plan(tables, kjts, budget)
    assert plan.device_bytes <= budget == plan.budget_bytes
    bpr = row_bytes(DIM, OPT)
    assert bpr == 4 * (DIM + 1)
    assert plan.device_bytes == bpr * (
        sum(plan.capacity.values()) + sum(t.num_embeddings for t in tables if t.name in plan.resident)
    )
    assert set(plan.capacity) | set(plan.resident) == {t.name for t in tables}
    assert not set(plan.capacity) & set(plan.resident)
    floors = min_capacities(
        collect_samples(table_id_batches(kjts, F2T), {t.name: t.num_embeddings for t in tables}), 1
    )
    for t in plan.tables:
        assert t.min_capacity == max(1, floors[t.name])
        if t.placement is Placement.CACHED:
            assert t.min_capacity <= t.capacity < t.num_embeddings
            assert t.fetches_per_step > 0
        else:
            assert t.capacity == t.num_embeddings and t.fetches_per_step == 0.0


def test_small_tables_resident_large_cached(
    tables: List[EmbeddingBagConfig], kjts: List[KeyedJaggedTensor]
) -> None:
    plan = _plan(tables, kjts, 1 << 20)
    rows = {t.name: t.num_embeddings for t in tables}
    for name, n in rows.items():
        if n <= 300:
            assert name in plan.resident, plan
    assert {"t_cat_0", "t_cat_3", "t_cat_25"} <= set(plan.capacity), plan
    # a table whose every window needs all its rows is resident even at the smallest budget
    need = sum(t.min_capacity * t.bytes_per_row for t in plan.tables)
    tight = _plan(tables, kjts, need)
    assert {"t_cat_4", "t_cat_5", "t_cat_8"} <= set(tight.resident)
    assert tight.device_bytes == need


def test_more_budget_never_increases_fetches(
    tables: List[EmbeddingBagConfig], kjts: List[KeyedJaggedTensor]
) -> None:
    totals = [
        _plan(tables, kjts, b).fetches_per_step for b in np.geomspace(170 << 10, 40 << 20, 16).astype(int)
    ]
    assert all(b <= a + 1e-9 for a, b in zip(totals, totals[1:])), totals
    assert totals[-1] == 0.0 and totals[0] > totals[-1]


def test_capacity_error_names_budget_tables_and_fix(
    tables: List[EmbeddingBagConfig], kjts: List[KeyedJaggedTensor]
) -> None:
    need = sum(t.min_capacity * t.bytes_per_row for t in _plan(tables, kjts, 1 << 20).tables)
    with pytest.raises(CapacityError) as info:
        _plan(tables, kjts, need - 1)
    msg = str(info.value)
    assert f"{need - 1:,}" in msg and f"{need:,}" in msg and "t_cat_0" in msg
    assert "raise device_budget_bytes to at least" in msg


def test_deterministic(tables: List[EmbeddingBagConfig], kjts: List[KeyedJaggedTensor]) -> None:
    a, b = _plan(tables, kjts, 1 << 20), _plan(tables, kjts, 1 << 20)
    assert a == b and str(a) == str(b) and a.curves == b.curves


@pytest.mark.parametrize("policy", ["belady", "lru", "ttl", "window"])
def test_plan_runs_in_the_oracle(
    tables: List[EmbeddingBagConfig], kjts: List[KeyedJaggedTensor], policy: str
) -> None:
    plan = _plan(tables, kjts, 1 << 20, policy=policy)
    assert plan.device_bytes <= 1 << 20 and plan.policy == policy
    oracle = LookaheadOracle(plan.oracle_config(feature_to_table=F2T))
    assert sum(1 for _ in oracle.plan_stream(kjts)) == len(kjts)  # no CapacityError
    manual = LookaheadOracle(
        OracleConfig(
            capacity=plan.capacity, horizon=30, prefetch_depth=1, policy=policy, feature_to_table=F2T
        )
    )
    assert sum(1 for _ in manual.plan_stream(kjts)) == len(kjts)


def test_reported_fetches_match_the_oracle(
    tables: List[EmbeddingBagConfig], kjts: List[KeyedJaggedTensor]
) -> None:
    plan = _plan(tables, kjts, 1 << 20, warmup_batches=0)
    oracle = LookaheadOracle(plan.oracle_config(feature_to_table=F2T))
    fetched: Dict[str, int] = {t: 0 for t in plan.capacity}
    for step in oracle.plan_stream(kjts):
        for t, tp in step.tables.items():
            fetched[t] += int(tp.fetch_ids.numel())
    for t, n in fetched.items():
        assert plan.table(t).fetches_per_step == pytest.approx(n / len(kjts))


def test_mapping_samples_equal_kjt_samples(
    tables: List[EmbeddingBagConfig], kjts: List[KeyedJaggedTensor]
) -> None:
    per_table = list(table_id_batches(kjts, F2T))
    assert _plan(tables, per_table, 1 << 20) == _plan(tables, kjts, 1 << 20)


def test_reads_at_most_num_sample_batches(
    tables: List[EmbeddingBagConfig], kjts: List[KeyedJaggedTensor]
) -> None:
    read = []

    def endless() -> Iterator[KeyedJaggedTensor]:
        for i in itertools.count():
            read.append(i)
            yield kjts[i % len(kjts)]

    plan = LookaheadPlanner(1 << 20, horizon=30, num_sample_batches=12).plan(tables, OPT, endless())
    assert len(read) == 12 and plan.num_sample_batches == 12 and plan.warmup_batches == 3


def test_report_and_constraints(tables: List[EmbeddingBagConfig], kjts: List[KeyedJaggedTensor]) -> None:
    plan = _plan(tables, kjts, 1 << 20)
    text = str(plan)
    for col in (
        "table",
        "rows",
        "dim",
        "placement",
        "capacity",
        "capacity %",
        "device bytes",
        "fetches/step",
    ):
        assert col in text
    assert "min capacity" in text and "budget 1.00 MiB" in text
    for t in tables:
        assert f" {t.name} " in text
    cons = plan.to_constraints()
    assert set(cons) == {t.name for t in tables}
    for name in plan.resident:
        assert cons[name].sharding_types == ["table_wise"] and cons[name].compute_kernels == ["fused"]
    for name in plan.capacity:
        assert cons[name].sharding_types == ["data_parallel"]
        assert cons[name].compute_kernels == ["customized_kernel"]


def test_optimizer_state_counts() -> None:
    t = [EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=8, feature_names=["f"])]
    batches = [{"t": torch.arange(10)}]
    for optim, bpr in (
        ("exact_sgd", 32),
        ("exact_row_wise_adagrad", 36),
        ("exact_adagrad", 64),
        ("adam", 96),
    ):
        plan = LookaheadPlanner(10_000, horizon=1).plan(t, CacheOptimizerConfig(optim), batches)
        assert plan.resident == ["t"] and plan.device_bytes == 10 * bpr
    with pytest.raises(CapacityError):
        LookaheadPlanner(10 * 96 - 1, horizon=1).plan(t, CacheOptimizerConfig("adam"), batches)


def test_greedy_prefers_the_hot_table() -> None:
    """Two equal-size tables: the budget goes to the one whose extra rows save more fetches."""
    g = torch.Generator().manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=n, num_embeddings=5000, embedding_dim=4, feature_names=[n])
        for n in ("hot", "cold")
    ]
    batches = [
        {
            "hot": torch.randint(0, 400, (100,), generator=g),
            "cold": torch.randint(0, 5000, (100,), generator=g),
        }
        for _ in range(40)
    ]
    plan = LookaheadPlanner(device_budget_bytes=16 * 500, horizon=40).plan(
        tables, CacheOptimizerConfig("exact_sgd"), batches
    )
    assert plan.capacity["cold"] == plan.table("cold").min_capacity  # every spare row went to "hot"
    assert plan.capacity["hot"] + plan.capacity["cold"] == 500 and plan.device_bytes == 8000


def test_min_capacities_match_reference_and_oracle() -> None:
    rng = np.random.default_rng(0)
    batches = [{"t": torch.from_numpy(rng.zipf(1.3, size=40) % 500)} for _ in range(25)]
    samples = collect_samples(batches, {"t": 500})
    for depth in (0, 1, 3):
        ref = max(
            len(set(np.concatenate([b["t"].numpy() for b in batches[t : t + depth + 1]]).tolist()))
            for t in range(len(batches))
        )
        cfg = OracleConfig(capacity={"t": 1}, horizon=depth, prefetch_depth=depth)
        assert min_capacities(samples, depth) == {"t": ref} == min_capacity(batches, depth, cfg)


@pytest.mark.parametrize("policy", ["belady", "lru", "ttl"])
def test_renumbering_keeps_the_fetches(policy: str) -> None:
    rng = np.random.default_rng(1)
    perm = rng.permutation(100_000)
    batches = [perm[rng.zipf(1.2, size=64) % 3000] for _ in range(20)]
    floor = min_capacities({"t": batches}, 1)["t"]
    distinct = np.unique(np.concatenate(batches)).size
    for cap in (floor, 2 * floor, 5 * floor) if policy != "ttl" else (distinct,):
        raw = simulate_fetches(batches, cap, 10, 1, policy, 0)
        assert raw is not None and raw == simulate_fetches(dense_ids(batches), cap, 10, 1, policy, 0)


def test_config_errors(tables: List[EmbeddingBagConfig], kjts: List[KeyedJaggedTensor]) -> None:
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ConfigError, match="device_budget_bytes"):
            LookaheadPlanner(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="horizon"):
        LookaheadPlanner(1 << 20, horizon=0, prefetch_depth=1)
    with pytest.raises(ConfigError, match="policy"):
        LookaheadPlanner(1 << 20, policy="fifo")
    with pytest.raises(ConfigError, match="num_sample_batches"):
        LookaheadPlanner(1 << 20, num_sample_batches=0)
    with pytest.raises(ConfigError, match="capacity_growth"):
        LookaheadPlanner(1 << 20, capacity_growth=1.0)
    planner = LookaheadPlanner(1 << 20, horizon=4)
    with pytest.raises(ConfigError, match="empty"):
        planner.plan([], OPT, kjts)
    with pytest.raises(ConfigError, match="twice"):
        planner.plan([tables[0], tables[0]], OPT, kjts)
    with pytest.raises(ConfigError, match="no batch"):
        planner.plan(tables, OPT, [])
    one = [EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4, feature_names=["f"])]
    with pytest.raises(ConfigError, match=r"unknown table\(s\) \['u'\]"):
        planner.plan(one, OPT, [{"t": torch.tensor([1]), "u": torch.tensor([2])}])
    with pytest.raises(ConfigError, match="feature 'g'"):
        planner.plan(
            one, OPT, [KeyedJaggedTensor(keys=["g"], values=torch.tensor([1]), lengths=torch.tensor([1]))]
        )
    with pytest.raises(InvalidIdError, match=r"id 10 in sample batch 1"):
        planner.plan(one, OPT, [{"t": torch.tensor([1])}, {"t": torch.tensor([10])}])
    with pytest.raises(DataError, match="integer"):
        planner.plan(one, OPT, [{"t": torch.tensor([1.0])}])
