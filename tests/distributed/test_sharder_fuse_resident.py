"""``fuse_resident``: the resident tables of a cached collection trained in the cache's kernel on one rank, exactly as
TorchRec's own module trains them, or left to TorchRec where it would train them differently."""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.planner import Topology

from torchrec_lookahead import ConfigError
from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder, lookahead_sharding_plan

_TABLES = [
    EmbeddingBagConfig(name="big", embedding_dim=4, num_embeddings=500, feature_names=["a", "b"]),
    EmbeddingBagConfig(name="small", embedding_dim=8, num_embeddings=30, feature_names=["c"]),
]


def _fused_and_split(optimizers=None, fuse=None, compute_kernel="fused", sharding_types=None):
    """Two DMP models of one EBC (a cached table "big", a resident "small", weights from the module): one with
    the resident table in the cache's kernel (``fuse``), one with it in TorchRec's own sharded module."""
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed import DistributedModelParallel

    from ..conftest import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    tables = _TABLES
    capacity = {"big": 64}
    models = []
    for f in (fuse, False):
        torch.manual_seed(0)
        ebc = EmbeddingBagCollection(tables=tables)  # real weights: sharding copies them
        if optimizers is not None:
            from torch.distributed.optim import _apply_optimizer_in_backward

            for name, (cls, kw) in optimizers.items():
                _apply_optimizer_in_backward(cls, [ebc.embedding_bags[name].weight], dict(kw))
        fp = (
            None
            if optimizers is not None
            else {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
        )
        sharder = LookaheadEmbeddingBagCollectionSharder(
            capacity=capacity, seed=3, fuse_resident=f, fused_params=fp
        )
        plan = lookahead_sharding_plan(
            ebc,
            [sharder],
            capacity,
            Topology(world_size=1, compute_device="cpu"),
            compute_kernel=compute_kernel,
            sharding_types=sharding_types,
        )
        models.append(
            DistributedModelParallel(ebc, device=torch.device("cpu"), sharders=[sharder], plan=plan)
        )
    return models


def _module_weights():
    from torchrec import EmbeddingBagCollection

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=_TABLES)
    return {n: b.weight.detach() for n, b in ebc.embedding_bags.items()}


def _batches(n=8):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        a, b = torch.randint(0, 500, (6,), generator=g), torch.randint(0, 500, (6,), generator=g)
        c = torch.randint(0, 30, (12,), generator=g)
        lengths = torch.tensor([1] * 12 + [2] * 6, dtype=torch.int32)
        out.append(KeyedJaggedTensor(keys=["a", "b", "c"], values=torch.cat([a, b, c]), lengths=lengths))
    return out


def test_resident_tables_train_in_the_cache_kernel_on_one_rank_exactly_like_torchrec_module():
    from torchrec_lookahead.modules import init_embedding_bag_tables_
    from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig

    fused, split = _fused_and_split()
    small = [EmbeddingBagConfig(name="small", embedding_dim=8, num_embeddings=30, feature_names=["c"])]
    torch.testing.assert_close(  # the fused table starts from the module's weights, as TorchRec's sharding does
        fused.module.cache.cache_weights("small"), _module_weights()["small"], rtol=0, atol=0
    )
    for m in (
        fused,
        split,
    ):  # the split module's table starts from TorchRec's own values: same values for both
        init_embedding_bag_tables_(m, small, seed=5)
    assert fused.module.resident is None and "small" in fused.module.cache.feature_to_table.values()
    assert split.module.resident is not None and "small" not in split.module.cache.feature_to_table.values()
    batches = _batches()
    f2t = {"a": "big", "b": "big", "c": "small"}
    oracle = LookaheadOracle(OracleConfig(capacity={"big": 64}, horizon=4, feature_to_table=f2t))
    for kjt, plan in zip(batches, oracle.plan_stream(batches)):
        outs = []
        for m in (fused, split):
            m.module.apply_plan(plan)
            out = m(m.module.cache.remap(kjt, plan))
            out.values().pow(2).sum().backward()
            outs.append(out.values())
        assert torch.equal(
            outs[0], outs[1]
        )  # step 0 too: the resident table started from the module's weights
    sd_f, sd_s = fused.state_dict(), split.state_dict()
    assert torch.equal(sd_f["cache.embedding_bags.big.weight"], sd_s["cache.embedding_bags.big.weight"])
    w_s = sd_s["resident.embedding_bags.small.weight"]
    w_s = w_s.local_shards()[0].tensor if hasattr(w_s, "local_shards") else w_s
    assert torch.equal(sd_f["cache.embedding_bags.small.weight"], w_s)
    # evaluation reads the fused resident table from the kernel, the cached one from its store
    fused.eval(), split.eval()
    with torch.no_grad():
        assert torch.equal(fused(batches[0]).values(), split(batches[0]).values())


def test_fuse_resident_falls_back_or_refuses_when_the_resident_tables_use_another_optimizer():
    from torchrec.optim import RowWiseAdagrad

    opts = {"big": (RowWiseAdagrad, {"lr": 0.1}), "small": (torch.optim.SGD, {"lr": 0.1})}
    fused, split = _fused_and_split(optimizers=opts)
    assert (
        fused.module.resident is not None
    )  # fell back to TorchRec's module: SGD is not the cache's optimizer
    with pytest.raises(ConfigError, match="fuse_resident=True.*trains with.*not the cached tables"):
        _fused_and_split(optimizers=opts, fuse=True)


def test_fuse_resident_keeps_torchrec_module_for_tables_planned_with_another_kernel():
    dense = {"compute_kernel": "dense", "sharding_types": ["data_parallel"]}
    fused, _ = _fused_and_split(**dense)
    assert fused.module.resident is not None and "small" not in fused.module.cache.feature_to_table.values()
    with pytest.raises(ConfigError, match="fuse_resident=True.*'small'.*data_parallel"):
        _fused_and_split(fuse=True, **dense)


def _init_pg():
    import torch.distributed as dist

    from ..conftest import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def test_init_seed_starts_fused_resident_tables_from_the_stores_values():
    """A model built with real weights: the strategy's init_seed gives the fused table init_rows' values, as it
    gives TorchRec's module and the all-resident baseline (contract 1 compares against that baseline)."""
    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec import EmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad

    from torchrec_lookahead.store import init_rows
    from torchrec_lookahead.strategies import TorchRecStrategy

    _init_pg()
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=_TABLES)
    _apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.1})
    strategy = TorchRecStrategy(
        init_seed=0, sharders=[LookaheadEmbeddingBagCollectionSharder(capacity={"big": 64})]
    )
    strategy.parallel_devices = [torch.device("cpu")]
    sharded = strategy.shard(ebc).module
    assert sharded.resident is None
    assert torch.equal(sharded.cache.cache_weights("small"), init_rows(0, "small", 0, 30, 8, 30))


def test_fuse_resident_falls_back_where_torchrec_would_train_the_resident_tables_differently():
    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed import DistributedModelParallel
    from torchrec.optim import RowWiseAdagrad

    _init_pg()
    rowwise = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
    sgd = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.5}
    cases = {  # name: (fused_params, tables declaring RowWiseAdagrad(lr=0.1) in backward)
        "gradient clipping in fused_params": (
            {**rowwise, "gradient_clipping": True, "max_gradient": 1e-3},
            [],
        ),
        "resident table without a declaration (fused_params' SGD)": (sgd, ["big"]),
        "declaration over fused_params' eps": ({"eps": 0.5}, ["big", "small"]),
    }
    for name, (fp, declared) in cases.items():
        ebc = EmbeddingBagCollection(tables=_TABLES, device=torch.device("meta"))
        for t in declared:
            _apply_optimizer_in_backward(RowWiseAdagrad, [ebc.embedding_bags[t].weight], {"lr": 0.1})
        sharder = LookaheadEmbeddingBagCollectionSharder(capacity={"big": 64}, fused_params=fp)
        plan = lookahead_sharding_plan(
            ebc, [sharder], {"big": 64}, Topology(world_size=1, compute_device="cpu")
        )
        dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), sharders=[sharder], plan=plan)
        assert dmp.module.resident is not None, name


def _mean_batch(weighted: bool) -> KeyedJaggedTensor:
    """Bags of 0 to 7 ids of features a, b (table big) and c (table small), 10 samples."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 8, (30,), generator=g)
    lengths[[3, 17, 25]] = 0
    ab, c = int(lengths[:20].sum()), int(lengths[20:].sum())
    values = torch.cat([torch.randint(0, 500, (ab,), generator=g), torch.randint(0, 30, (c,), generator=g)])
    return KeyedJaggedTensor(
        keys=["a", "b", "c"],
        values=values,
        lengths=lengths,
        weights=torch.rand(ab + c, generator=g) if weighted else None,
    )


def _eval_output(tables, capacity, kjt, fuse=None):
    """The eval forward of a DMP of ``tables`` with ``capacity`` cached (TorchRec's own sharder when empty), every
    table's weights from seed 5."""
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from torchrec_lookahead.modules import init_embedding_bag_tables_

    weighted = kjt.weights_or_none() is not None
    ebc = EmbeddingBagCollection(tables=tables, is_weighted=weighted, device=torch.device("meta"))
    fp = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
    if capacity:
        sharder = LookaheadEmbeddingBagCollectionSharder(
            capacity=capacity, fuse_resident=fuse, fused_params=fp, seed=5
        )
    else:
        sharder = EmbeddingBagCollectionSharder(fused_params=fp)
    plan = lookahead_sharding_plan(ebc, [sharder], capacity, Topology(world_size=1, compute_device="cpu"))
    dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), sharders=[sharder], plan=plan)
    if capacity:
        assert (dmp.module.resident is None) == (fuse is None)
    init_embedding_bag_tables_(dmp, [t for t in tables if t.name not in capacity], seed=5)
    dmp.eval()
    with torch.no_grad():
        return dmp(kjt).values()


@pytest.mark.parametrize("weighted", [True, False])
def test_evaluation_of_a_mean_fused_table_equals_torchrec_module(weighted):
    """FBGEMM's MEAN is the bag's sum times 1/length: torch's mean (a division) differed in the last bit."""
    from torchrec import PoolingType

    _init_pg()
    tables = [
        _TABLES[0],
        EmbeddingBagConfig(
            name="small", embedding_dim=8, num_embeddings=30, feature_names=["c"], pooling=PoolingType.MEAN
        ),
    ]
    kjt = _mean_batch(weighted)
    fused, split = (_eval_output(tables, {"big": 64}, kjt, fuse) for fuse in (None, False))
    assert torch.equal(fused, split)


@pytest.mark.parametrize("weighted", [True, False])
def test_evaluation_of_a_cached_mean_table_equals_resident_torchrec(weighted):
    from torchrec import PoolingType

    _init_pg()
    tables = [
        EmbeddingBagConfig(
            name="big",
            embedding_dim=4,
            num_embeddings=500,
            feature_names=["a", "b"],
            pooling=PoolingType.MEAN,
        ),
        _TABLES[1],
    ]
    kjt = _mean_batch(weighted)
    cached = _eval_output(tables, {"big": 64}, kjt, fuse=False)
    resident = _eval_output(tables, {}, kjt)
    assert torch.equal(cached, resident)


@pytest.mark.parametrize("fuse", [None, False])
def test_weights_given_to_an_unweighted_collection_are_refused(fuse):
    """TorchRec's sharded kernel applies a batch's weights whatever is_weighted says; the cache did not: training
    differed silently from resident training. It is a DataError at the first forward, training or evaluation."""
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed import DistributedModelParallel

    from torchrec_lookahead import DataError

    _init_pg()
    ebc = EmbeddingBagCollection(tables=_TABLES, device=torch.device("meta"))
    sharder = LookaheadEmbeddingBagCollectionSharder(
        capacity={"big": 64}, fuse_resident=fuse, fused_params={"optimizer": EmbOptimType.EXACT_SGD}
    )
    plan = lookahead_sharding_plan(ebc, [sharder], {"big": 64}, Topology(world_size=1, compute_device="cpu"))
    dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), sharders=[sharder], plan=plan)
    for mode in (True, False):
        dmp.train(mode)
        with pytest.raises(DataError, match=r"per-id weights .* is unweighted \(is_weighted=False\)"):
            dmp(_mean_batch(weighted=True))
