"""The cache on a CUDA device: staged rows in pinned memory, cache rows and optimizer state on the GPU.

Skipped where torch sees no GPU (CI). With the PyTorch kernel: cached == resident on the GPU, and the GPU run ==
the same run on the CPU. With FBGEMM's CUDA kernels (the ``fbgemm-gpu`` build): the cache on the GPU equals
TorchRec's resident FUSED tables on the GPU bit for bit, for SGD, row-wise Adagrad, Adagrad and Adam, and a
cached ``EmbeddingCollection`` equals the same collection with every table resident.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from torchrec_lookahead.modules import (
    CachedEmbeddingBagCollection,
    CachedEmbeddingCollection,
    CacheOptimizerConfig,
)
from torchrec_lookahead.modules.config import FBGEMM_CPU_OPTIMIZERS

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
)

# TRL_TEST_DEVICE=cpu runs the same comparisons on the CPU (a check of the test itself).
DEVICE = torch.device(os.environ.get("TRL_TEST_DEVICE", "cuda"))
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = 1e-5
CACHED = ("t0", "t1", "t2")


def _host_tables(
    ebc: CachedEmbeddingBagCollection,
) -> Dict[str, Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
    return {t: (w.cpu(), {k: v.cpu() for k, v in s.items()}) for t, (w, s) in cached_tables(ebc).items()}


def _run(ebc: CachedEmbeddingBagCollection, batches: List, weights: List, plans: Optional[List]) -> List:
    outs = []
    device = ebc.device
    for step, kjt in enumerate(batches):
        if plans is not None:
            plan = plans[step]
            staged = ebc.stage(plan, pin_memory=device.type == "cuda")  # as LookaheadDataModule stages
            ebc.apply_plan(plan, staged)
            kjt = ebc.remap(kjt, plan)
        out = ebc(kjt).values()
        assert out.device.type == device.type
        (out * weights[step].to(device)).sum().backward()
        outs.append(out.detach().cpu())
    return outs


@pytest.mark.parametrize(
    "cfg",
    [
        CacheOptimizerConfig("exact_sgd", learning_rate=0.1, kernel="torch"),
        CacheOptimizerConfig("exact_row_wise_adagrad", learning_rate=0.05, kernel="torch"),
        CacheOptimizerConfig("adam", learning_rate=0.05, kernel="torch"),
    ],
    ids=["sgd", "rowwise_adagrad", "adam"],
)
def test_cuda_cache_equals_resident_and_cpu(cfg: CacheOptimizerConfig) -> None:
    steps = 30
    tables = make_tables(mean_table=True)
    batches = make_batches(tables, steps)
    probe = CachedEmbeddingBagCollection(tables, {t: 1 for t in CACHED}, cfg)
    ids = [probe.table_ids(b) for b in batches]
    capacity = min_capacity(ids, list(CACHED))
    plans = naive_plans(ids, capacity, "belady")
    weights = loss_weights(steps, 24)
    runs = {}
    for name, device, cap in (
        ("gpu_cached", DEVICE, capacity),
        ("gpu_resident", DEVICE, {}),
        ("cpu_cached", None, capacity),
    ):
        ebc = CachedEmbeddingBagCollection(tables, cap, cfg, seed=SEED, device=device)
        outs = _run(ebc, batches, weights, plans if cap else None)
        runs[name] = (ebc, outs)
    for other in ("gpu_resident", "cpu_cached"):
        out_diff = max((a - b).abs().max().item() for a, b in zip(runs["gpu_cached"][1], runs[other][1]))
        dw, ds = max_table_diff(_host_tables(runs[other][0]), _host_tables(runs["gpu_cached"][0]))
        assert out_diff <= TOL and dw <= TOL and ds <= TOL, (other, out_diff, dw, ds)
    assert sum(s["rows_written_back"] for s in runs["gpu_cached"][0].stats().values()) > 0


FBGEMM_OPTIMIZERS = [
    CacheOptimizerConfig("exact_sgd", learning_rate=0.1, kernel="fbgemm"),
    CacheOptimizerConfig("exact_row_wise_adagrad", learning_rate=0.1, kernel="fbgemm"),
    CacheOptimizerConfig("exact_adagrad", learning_rate=0.1, kernel="fbgemm"),
    CacheOptimizerConfig("adam", learning_rate=0.05, kernel="fbgemm"),
]


def _skip_without_fbgemm_kernel(cfg: CacheOptimizerConfig) -> None:
    if DEVICE.type == "cpu" and cfg.optim not in FBGEMM_CPU_OPTIMIZERS:
        pytest.skip(f"FBGEMM has no CPU kernel for {cfg.optim.value}")


@pytest.mark.usefixtures("gloo_pg")
@pytest.mark.parametrize("cfg", FBGEMM_OPTIMIZERS, ids=["sgd", "rowwise_adagrad", "adagrad", "adam"])
def test_fbgemm_cache_equals_torchrec_resident_tables_on_the_device(
    cfg: CacheOptimizerConfig, record_property
) -> None:
    """The cache (FBGEMM's fused TBE over the cache rows) against TorchRec's DMP with every table resident
    (FBGEMM's fused TBE over the whole tables), both on ``DEVICE``: outputs, weights and optimizer state equal
    bit for bit."""
    _skip_without_fbgemm_kernel(cfg)
    steps = 25
    tables = make_tables()
    batches = make_batches(tables, steps)
    cached = ("t0", "t1")
    probe = CachedEmbeddingBagCollection(
        tables, {t: 1 for t in cached}, cfg, device=DEVICE
    )  # FBGEMM's Adam: GPU
    ids = [probe.table_ids(b) for b in batches]
    capacity = min_capacity(ids, list(cached))
    plans = naive_plans(ids, capacity, "belady")
    weights = loss_weights(steps, sum(t.embedding_dim * len(t.feature_names) for t in tables))
    ebc = CachedEmbeddingBagCollection(tables, capacity, cfg, seed=SEED, device=DEVICE)
    assert cfg.uses_fbgemm(DEVICE.type)
    dmp = make_dmp(tables, cfg, device=DEVICE)
    cached_outs = _run(ebc, batches, weights, plans)
    resident_outs = []
    for step, kjt in enumerate(batches):
        out = dmp(kjt.to(DEVICE)).values()
        (out * weights[step].to(DEVICE)).sum().backward()
        resident_outs.append(out.detach().cpu())
    out_diff = max((a - b).abs().max().item() for a, b in zip(cached_outs, resident_outs))
    resident = {t: (w.cpu(), {k: v.cpu() for k, v in s.items()}) for t, (w, s) in dmp_tables(dmp).items()}
    dw, ds = max_table_diff(resident, _host_tables(ebc))
    for name, value in (
        ("max_abs_output_diff", out_diff),
        ("max_abs_weight_diff", dw),
        ("max_abs_state_diff", ds),
    ):
        record_property(name, value)
    assert out_diff == 0.0 and dw == 0.0 and ds == 0.0, (out_diff, dw, ds)
    assert sum(s["rows_written_back"] for s in ebc.stats().values()) > 0


@pytest.mark.parametrize(
    "cfg",
    [
        CacheOptimizerConfig("sgd", learning_rate=0.1, kernel="fbgemm"),
        CacheOptimizerConfig("rowwise_adagrad", learning_rate=0.1, kernel="fbgemm"),
        CacheOptimizerConfig("adam", learning_rate=0.01, kernel="fbgemm"),
    ],
    ids=["sgd", "rowwise_adagrad", "adam"],
)
def test_cached_embedding_collection_equals_every_table_resident_on_the_device(
    cfg: CacheOptimizerConfig,
) -> None:
    """Unpooled (sequence) tables: the cached ``EmbeddingCollection`` on ``DEVICE`` equals the same collection
    with every table resident, FBGEMM's kernels on both sides."""
    _skip_without_fbgemm_kernel(cfg)
    from .test_cached_ec import TABLES, _train

    cached = CachedEmbeddingCollection(TABLES, {"t0": 64, "t1": 30}, cfg, seed=3, device=DEVICE)
    resident = CachedEmbeddingCollection(TABLES, {}, cfg, seed=3, device=DEVICE)
    out_c, out_r = _train(cached, True), _train(resident, False)
    for a, b in zip(out_c, out_r):
        assert all(a[k].device.type == DEVICE.type and torch.equal(a[k], b[k]) for k in a)
    cached.flush()
    for t in ("t0", "t1"):
        assert torch.equal(cached.stores[t].full_weights(), resident.cache_weights(t).cpu())
    assert cached.stats()["t0"]["rows_written_back"] > 0
