"""Contract 1 for Adam: fbgemm-gpu-cpu has no Adam kernel, so on CPU the cache runs its PyTorch kernel.

Checked two ways: cached == the same collection with every table resident (state travels with the row), and
resident == an independent naive reference (dense autograd gradients, Adam on the rows the batch touched,
FBGEMM's formula with the global step counter for bias correction).
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import pytest
import torch
import torch.nn.functional as F
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

from torchrec_lookahead.modules import CachedEmbeddingBagCollection, CacheOptimizerConfig
from torchrec_lookahead.store import init_rows

from .cache_helpers import (
    SEED,
    cached_tables,
    loss_weights,
    make_batches,
    make_tables,
    max_table_diff,
    min_capacity,
    naive_plans,
    train_steps,
)

TOL = 1e-5


def _naive_adam(
    tables: Sequence[EmbeddingBagConfig],
    batches: Sequence[KeyedJaggedTensor],
    weights: Sequence[torch.Tensor],
    cfg: CacheOptimizerConfig,
) -> Dict[str, tuple]:
    rowwise = cfg.optim.value == "partial_row_wise_adam"
    w = {
        t.name: init_rows(SEED, t.name, 0, t.num_embeddings, t.embedding_dim, t.num_embeddings)
        for t in tables
    }
    m1 = {n: torch.zeros_like(v) for n, v in w.items()}
    m2 = {n: torch.zeros(v.shape[0], 1 if rowwise else v.shape[1]) for n, v in w.items()}
    for step, kjt in enumerate(batches, start=1):
        params = {n: v.clone().requires_grad_() for n, v in w.items()}
        feats = kjt.to_dict()
        outs, touched = [], {n: [] for n in w}
        for t in tables:
            for f in t.feature_names:
                jt = feats[f]
                mode = "mean" if t.pooling == PoolingType.MEAN else "sum"
                outs.append(
                    F.embedding_bag(
                        jt.values(), params[t.name], jt.offsets(), mode=mode, include_last_offset=True
                    )
                )
                touched[t.name].append(jt.values())
        (torch.cat(outs, 1) * weights[step - 1]).sum().backward()
        for n in w:
            rows = torch.unique(torch.cat(touched[n]))
            g = params[n].grad[rows]
            a = cfg.beta1 * m1[n][rows] + (1 - cfg.beta1) * g
            sq = (g * g).mean(1, keepdim=True) if rowwise else g * g
            b = cfg.beta2 * m2[n][rows] + (1 - cfg.beta2) * sq
            m1[n][rows], m2[n][rows] = a, b
            upd = a / (1 - cfg.beta1**step) / ((b / (1 - cfg.beta2**step)).sqrt() + cfg.eps)
            w[n][rows] = w[n][rows] - cfg.learning_rate * (upd + cfg.weight_decay * w[n][rows])
    return {n: (w[n], {"momentum1": m1[n], "momentum2": m2[n]}) for n in w}


@pytest.mark.parametrize(
    "cfg",
    [
        CacheOptimizerConfig("adam", learning_rate=0.05),
        CacheOptimizerConfig("adam", learning_rate=0.05, weight_decay=0.01),
        CacheOptimizerConfig("partial_row_wise_adam", learning_rate=0.05),
    ],
    ids=["adam", "adam_wd", "partial_rowwise_adam"],
)
@pytest.mark.parametrize("cap_scale", [1.0, 2.0])
def test_adam_cached_equals_resident_and_reference(cfg: CacheOptimizerConfig, cap_scale: float) -> None:
    steps = 25
    tables = make_tables(mean_table=True)
    batches = make_batches(tables, steps)
    cached = ("t0", "t1", "t2")
    probe = CachedEmbeddingBagCollection(tables, {t: 1 for t in cached}, cfg)
    ids = [probe.table_ids(b) for b in batches]
    capacity = {t: int(c * cap_scale) for t, c in min_capacity(ids, list(cached)).items()}
    plans = naive_plans(ids, capacity, "belady")
    weights = loss_weights(steps, 24)
    cached_ebc = CachedEmbeddingBagCollection(tables, capacity, cfg, seed=SEED)
    resident = CachedEmbeddingBagCollection(tables, {}, cfg, seed=SEED)
    out_diff = 0.0
    for a, b in zip(
        train_steps(resident, batches, weights), train_steps(cached_ebc, batches, weights, plans)
    ):
        out_diff = max(out_diff, (a - b).abs().max().item())
    got, want = cached_tables(cached_ebc), cached_tables(resident)
    dw, ds = max_table_diff(want, got)
    assert out_diff <= TOL and dw <= TOL and ds <= TOL, (out_diff, dw, ds)
    assert sum(s["rows_written_back"] for s in cached_ebc.stats().values()) > 0
    assert cached_ebc.state_dict()["optimizer_step"].item() == steps
    ref = _naive_adam(tables, batches, weights, cfg)
    dw, ds = max_table_diff(ref, want)
    assert dw <= TOL and ds <= TOL, (dw, ds)


def test_adam_on_cpu_is_refused_by_fbgemm_kernel_choice() -> None:
    from torchrec_lookahead.errors import ConfigError

    with pytest.raises(ConfigError, match="FBGEMM has no CPU kernel"):
        CachedEmbeddingBagCollection(make_tables(), {"t0": 10}, CacheOptimizerConfig("adam", kernel="fbgemm"))


def test_resident_tables_start_from_store_values() -> None:
    tables: List[EmbeddingBagConfig] = make_tables()
    ebc = CachedEmbeddingBagCollection(tables, {"t0": 10}, seed=3)
    sd = ebc.state_dict()
    for t in tables:
        want = init_rows(3, t.name, 0, t.num_embeddings, t.embedding_dim, t.num_embeddings)
        assert torch.equal(sd[f"embedding_bags.{t.name}.weight"], want)
