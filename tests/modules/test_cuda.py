"""The cache on a CUDA device: staged rows in pinned memory, cache rows and optimizer state on the GPU.

Skipped where torch sees no GPU (CI). On a GPU machine without FBGEMM's CUDA kernels (``fbgemm-gpu-cpu``) the
cache runs its PyTorch kernel, which is what these tests pin down: cached == resident on the GPU, and the GPU
run == the same run on the CPU.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from torchrec_lookahead.modules import CachedEmbeddingBagCollection, CacheOptimizerConfig

from .cache_helpers import (
    SEED,
    cached_tables,
    loss_weights,
    make_batches,
    make_tables,
    max_table_diff,
    min_capacity,
    naive_plans,
)

# TRL_TEST_DEVICE=cpu runs the same comparisons on the CPU (a check of the test itself).
DEVICE = torch.device(os.environ.get("TRL_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"
)

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
