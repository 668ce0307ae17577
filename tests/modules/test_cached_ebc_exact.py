"""Contract 1 (exact): the cached collection equals resident TorchRec training (DMP, FUSED kernel, 1 rank)."""

from __future__ import annotations

from typing import Dict, List, Optional

import pytest
import torch
from torchrec import KeyedJaggedTensor

from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.modules import CachedEmbeddingBagCollection, CacheOptimizerConfig

from .cache_helpers import (
    SEED,
    cached_tables,
    dmp_tables,
    loss_weights,
    make_batches,
    make_dmp,
    make_tables,
    max_table_diff,
    min_capacity,
    naive_plans,
    train_steps,
)

pytestmark = pytest.mark.usefixtures("gloo_pg")

TOL = 1e-5


def _run(
    optimizer: CacheOptimizerConfig,
    steps: int,
    cap_scale: float,
    policy: str = "belady",
    cached: tuple = ("t0", "t1"),
    mean_table: bool = False,
    multi_hot: bool = True,
    kernel: Optional[str] = None,
    staged: bool = False,
) -> Dict[str, float]:
    tables = make_tables(mean_table)
    batches = make_batches(tables, steps, multi_hot=multi_hot)
    probe = CachedEmbeddingBagCollection(tables, {t: 1 for t in cached})
    ids = [probe.table_ids(b) for b in batches]
    minimum = min_capacity(ids, list(cached))
    sizes = {t.name: t.num_embeddings for t in tables}
    capacity = {t: min(sizes[t], max(minimum[t], int(minimum[t] * cap_scale))) for t in cached}
    plans = naive_plans(ids, capacity, policy)
    cfg = optimizer if kernel is None else CacheOptimizerConfig(**{**optimizer.__dict__, "kernel": kernel})
    ebc = CachedEmbeddingBagCollection(tables, capacity, cfg, seed=SEED)
    dmp = make_dmp(tables, optimizer)
    weights = loss_weights(steps, sum(t.embedding_dim * len(t.feature_names) for t in tables))
    out_diff = 0.0
    for a, b in zip(train_steps(dmp, batches, weights), train_steps(ebc, batches, weights, plans, staged)):
        out_diff = max(out_diff, (a - b).abs().max().item())
    dw, ds = max_table_diff(dmp_tables(dmp), cached_tables(ebc))
    stats = ebc.stats()
    assert all(s["rows_written_back"] > 0 for s in stats.values()) or cap_scale > 1, stats
    return {"out": out_diff, "w": dw, "state": ds}


OPTIMIZERS = [
    CacheOptimizerConfig("exact_sgd", learning_rate=0.1),
    CacheOptimizerConfig("exact_row_wise_adagrad", learning_rate=0.1),
]


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.optim.value)
@pytest.mark.parametrize("cap_scale", [1.0, 1.5, 4.0])
def test_equals_dmp(optimizer: CacheOptimizerConfig, cap_scale: float) -> None:
    diffs = _run(optimizer, steps=25, cap_scale=cap_scale)
    assert diffs["out"] <= TOL and diffs["w"] <= TOL and diffs["state"] <= TOL, diffs


@pytest.mark.parametrize("policy", ["lru", "random"])
def test_equals_dmp_other_policies_every_table_cached_mean_pooling(policy: str) -> None:
    diffs = _run(
        OPTIMIZERS[1], steps=25, cap_scale=1.0, policy=policy, cached=("t0", "t1", "t2"), mean_table=True
    )
    assert diffs["out"] <= TOL and diffs["w"] <= TOL and diffs["state"] <= TOL, diffs


def test_equals_dmp_single_hot_100_steps() -> None:
    diffs = _run(OPTIMIZERS[1], steps=100, cap_scale=1.0, multi_hot=False)
    assert diffs["out"] <= TOL and diffs["w"] <= TOL and diffs["state"] <= TOL, diffs


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.optim.value)
def test_torch_kernel_matches_fbgemm_formulas(optimizer: CacheOptimizerConfig) -> None:
    """The PyTorch kernel (used for Adam on CPU) reproduces FBGEMM's SGD and row-wise Adagrad."""
    diffs = _run(optimizer, steps=20, cap_scale=1.0, kernel="torch", mean_table=True)
    # Accumulators grow to O(10): compare them relatively.
    assert diffs["out"] <= TOL and diffs["w"] <= TOL and diffs["state"] <= 1e-5 * 100, diffs


@pytest.mark.parametrize("mode", ["L2", "DECOUPLE"])
def test_fbgemm_cpu_ignores_rowwise_adagrad_weight_decay(mode: str) -> None:
    """Why weight decay with SGD/Adagrad is refused on CPU: FBGEMM's CPU kernel drops it silently.

    If this starts failing, FBGEMM applies weight decay on CPU: lift the refusal in CacheOptimizerConfig.
    """
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
        WeightDecayMode,  # (FBGEMM 1.6 too)
    )

    results = []
    for wd in (0.0, 0.5):
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(2, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)],
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=0.1,
            weight_decay=wd,
            weight_decay_mode=WeightDecayMode[mode],
        )
        tbe.split_embedding_weights()[0].copy_(torch.arange(8.0).view(2, 4))
        (
            tbe(torch.tensor([0]), torch.tensor([0, 1])) * torch.tensor([[0.5, -1.0, 0.25, 2.0]])
        ).sum().backward()
        results.append(tbe.split_embedding_weights()[0].clone())
    assert torch.equal(results[0], results[1])
    with pytest.raises(ConfigError, match="weight_decay"):
        CachedEmbeddingBagCollection(
            make_tables(),
            {"t0": 50},
            CacheOptimizerConfig("exact_row_wise_adagrad", weight_decay=0.5, weight_decay_mode=mode),
        )


def test_staged_rows_equal_direct_gathers() -> None:
    diffs = _run(OPTIMIZERS[1], steps=20, cap_scale=1.0, staged=True)
    assert diffs["out"] <= TOL and diffs["w"] <= TOL and diffs["state"] <= TOL, diffs


@pytest.mark.parametrize("policy", ["belady", "lru", "ttl"])
def test_with_lookahead_oracle_prefetch_depth_2(policy: str) -> None:
    """Plans of the project's oracle, rows staged 2 steps ahead (after the plan 2 steps earlier is applied)."""
    import torchrec_lookahead.oracle as oracle_mod

    depth, steps = 2, 30
    tables = make_tables()
    batches = make_batches(tables, steps)
    f2t = {f: t.name for t in tables for f in t.feature_names}
    probe = oracle_mod.OracleConfig(
        capacity={"t0": 1, "t1": 1}, horizon=4, prefetch_depth=depth, feature_to_table=f2t
    )
    capacity = oracle_mod.min_capacity(batches, depth, probe)
    oracle = oracle_mod.LookaheadOracle(
        oracle_mod.OracleConfig(
            capacity=capacity, horizon=4, prefetch_depth=depth, policy=policy, feature_to_table=f2t
        )
    )
    plans = list(oracle.plan_stream(batches))
    optimizer = OPTIMIZERS[1]
    ebc = CachedEmbeddingBagCollection(tables, capacity, optimizer, seed=SEED)
    dmp = make_dmp(tables, optimizer)
    weights = loss_weights(steps, 24)
    staged: List = [ebc.stage(plans[s]) for s in range(depth)]
    out_diff = 0.0
    for step, kjt in enumerate(batches):
        ebc.apply_plan(plans[step], staged[step])
        if step + depth < steps:
            staged.append(ebc.stage(plans[step + depth]))
        # no stale read: every slot the batch reads holds the id the batch asks for
        for name, ids in ebc.table_ids(kjt).items():
            assert torch.equal(ebc.slot_ids(name)[plans[step].tables[name].slots], ids)
        a = ebc(ebc.remap(kjt, plans[step])).values()
        b = dmp(kjt).values()
        (a * weights[step]).sum().backward()
        (b * weights[step]).sum().backward()
        out_diff = max(out_diff, (a - b).abs().max().item())
        for name, cap in capacity.items():
            assert int((ebc.slot_ids(name) >= 0).sum()) <= cap
    dw, ds = max_table_diff(dmp_tables(dmp), cached_tables(ebc))
    assert out_diff <= TOL and dw <= TOL and ds <= TOL, (out_diff, dw, ds)


@pytest.mark.parametrize("kernel", ["fbgemm", "torch"])
def test_weighted_features_equal_dmp(kernel: str) -> None:
    """Per-id weights (``is_weighted=True``, SUM pooling) through both kernels."""
    steps = 15
    tables = make_tables()
    gen = torch.Generator().manual_seed(3)
    batches = [
        KeyedJaggedTensor(
            keys=b.keys(),
            values=b.values(),
            lengths=b.lengths(),
            weights=torch.rand(b.values().numel(), generator=gen),
        )
        for b in make_batches(tables, steps)
    ]
    optimizer = CacheOptimizerConfig("exact_row_wise_adagrad", learning_rate=0.1, kernel=kernel)
    probe = CachedEmbeddingBagCollection(tables, {"t0": 1, "t1": 1})
    ids = [probe.table_ids(b) for b in batches]
    capacity = min_capacity(ids, ["t0", "t1"])
    ebc = CachedEmbeddingBagCollection(tables, capacity, optimizer, seed=SEED, is_weighted=True)
    dmp = make_dmp(
        tables, CacheOptimizerConfig("exact_row_wise_adagrad", learning_rate=0.1), is_weighted=True
    )
    weights = loss_weights(steps, 24)
    plans = naive_plans(ids, capacity)
    for a, b in zip(train_steps(dmp, batches, weights), train_steps(ebc, batches, weights, plans)):
        assert (a - b).abs().max().item() <= TOL
    dw, ds = max_table_diff(dmp_tables(dmp), cached_tables(ebc))
    assert dw <= TOL and ds <= 1e-4, (dw, ds)
