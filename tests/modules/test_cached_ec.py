"""CachedEmbeddingCollection on its own: cached == every table resident (state travels with the row) for the
FBGEMM and the PyTorch kernel (Adam), the PyTorch kernel against a naive per-id reference, checkpoints under
TorchRec's EmbeddingCollection keys, and refusals."""

from typing import Dict, List

import pytest
import torch
from torchrec import EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

from torchrec_lookahead import ConfigError
from torchrec_lookahead.modules import CachedEmbeddingCollection, CacheOptimizerConfig
from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig

TABLES = [
    EmbeddingConfig(name="t0", embedding_dim=8, num_embeddings=300, feature_names=["a", "b"]),
    EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=50, feature_names=["c"]),
]
F2T = {"a": "t0", "b": "t0", "c": "t1"}


def _batches(n: int = 10, b: int = 8) -> List[KeyedJaggedTensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 5, (3 * b,), generator=g)
        na, nb, nc = (int(lengths[i * b : (i + 1) * b].sum()) for i in range(3))
        values = torch.cat(
            [
                (torch.rand(na + nb, generator=g) ** 3 * 300).long(),
                torch.randint(0, 50, (nc,), generator=g),
            ]
        )
        out.append(KeyedJaggedTensor(keys=["a", "b", "c"], values=values, lengths=lengths))
    return out


def _train(ec: CachedEmbeddingCollection, cached: bool) -> List[Dict[str, torch.Tensor]]:
    batches = _batches()
    plans = (
        LookaheadOracle(OracleConfig(capacity=ec.capacity, horizon=3, feature_to_table=F2T)).plan_stream(
            batches
        )
        if cached
        else [None] * len(batches)
    )
    outs = []
    for step, (kjt, plan) in enumerate(zip(batches, plans)):
        if cached:
            ec.apply_plan(plan)
            kjt = ec.remap(kjt, plan)
        out = ec(kjt)
        outs.append({k: v.values().detach().clone() for k, v in out.items()})
        scale = torch.arange(1, 9, dtype=torch.float32) * (step + 1) / 10  # a different gradient per column
        sum(
            (v.values()[:, : scale.numel()] * scale[: v.values().shape[1]].to(v.values().device)).sum()
            for v in out.values()
        ).backward()
    return outs


@pytest.mark.parametrize(
    "optimizer",
    [
        CacheOptimizerConfig("sgd", learning_rate=0.1),
        CacheOptimizerConfig("rowwise_adagrad", learning_rate=0.1),
        CacheOptimizerConfig("adam", learning_rate=0.01),
    ],  # fmt: skip
    ids=["sgd", "rowwise_adagrad", "adam_torch_kernel"],
)
def test_cached_equals_every_table_resident_for_each_kernel(optimizer):
    cached = CachedEmbeddingCollection(TABLES, {"t0": 64, "t1": 30}, optimizer, seed=3)
    resident = CachedEmbeddingCollection(TABLES, {}, optimizer, seed=3)
    assert [k.pooling.name for k in cached._kernels] == ["NONE", "NONE"]  # one unpooled kernel per dimension
    out_c, out_r = _train(cached, True), _train(resident, False)
    for a, b in zip(out_c, out_r):
        assert all(torch.equal(a[k], b[k]) for k in a)
    cached.flush()
    for t in ("t0", "t1"):
        assert torch.equal(cached.stores[t].full_weights(), resident.cache_weights(t))
    assert cached.stats()["t0"]["rows_written_back"] > 0  # rows were evicted and fetched again


def test_torch_kernel_equals_a_naive_per_id_reference():
    """The PyTorch kernel's unpooled path: output rows are the ids' rows, and SGD subtracts lr x the sum of a
    row's output gradients."""
    ec = CachedEmbeddingCollection(
        TABLES[:1], {}, CacheOptimizerConfig("sgd", learning_rate=0.5, kernel="torch")
    )
    w0 = ec.cache_weights("t0").clone()
    kjt = KeyedJaggedTensor(
        keys=["a", "b"], values=torch.tensor([3, 7, 3, 9]), lengths=torch.tensor([2, 0, 1, 1])
    )
    out = ec(kjt)
    assert torch.equal(out["a"].values(), w0[[3, 7]]) and torch.equal(out["b"].values(), w0[[3, 9]])
    grads = {"a": torch.full((2, 8), 1.0), "b": torch.full((2, 8), 2.0)}
    sum((out[k].values() * grads[k]).sum() for k in grads).backward()
    want = w0.clone()
    want[3] -= 0.5 * (1.0 + 2.0)
    want[7] -= 0.5
    want[9] -= 0.5 * 2.0
    assert torch.allclose(ec.cache_weights("t0"), want)


def test_checkpoint_has_torchrec_embedding_collection_keys_and_loads_into_it():
    ec = CachedEmbeddingCollection(TABLES, {"t0": 64}, CacheOptimizerConfig("rowwise_adagrad"), seed=1)
    _train(ec, True)
    state = ec.state_dict()
    assert {"embeddings.t0.weight", "embeddings.t0.momentum1", "embeddings.t1.weight"} <= set(state)
    resident = EmbeddingCollection(tables=TABLES[:1])  # TorchRec's EC holds one dimension
    resident.load_state_dict({k: v for k, v in state.items() if k == "embeddings.t0.weight"})
    assert torch.equal(resident.embeddings["t0"].weight, ec.stores["t0"].full_weights())
    again = CachedEmbeddingCollection(TABLES, {"t0": 64}, CacheOptimizerConfig("rowwise_adagrad"), seed=9)
    again.load_state_dict(state)
    assert torch.equal(again.stores["t0"].full_weights(), ec.stores["t0"].full_weights())


def test_pooled_configs_are_refused():
    with pytest.raises(
        ConfigError, match="EmbeddingBagConfig; an embedding collection takes EmbeddingConfig"
    ):
        CachedEmbeddingCollection(
            [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])], {}
        )
