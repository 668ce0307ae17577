import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.planner import Topology

from torchrec_lookahead import ConfigError, DataError
from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder, lookahead_sharding_plan
from torchrec_lookahead.models import DLRMModule
from torchrec_lookahead.modules import CachedEmbeddingBagCollection, CacheOptimizerConfig

from ..helpers import fit_cached, max_abs_diff, weights


def test_compute_kernels_and_argument_checks():
    from torchrec_lookahead.distributed import lookahead_planning

    sharder = LookaheadEmbeddingBagCollectionSharder(capacity={"t": 8})
    with lookahead_planning():
        assert "customized_kernel" in sharder.compute_kernels("data_parallel", "cpu")
        assert "customized_kernel" not in sharder.compute_kernels("table_wise", "cpu")
    # outside lookahead_sharding_plan: TorchRec's own planner is asking, which cannot place cached tables
    with pytest.raises(
        ConfigError, match=r"\['t'\].*plan=torchrec_lookahead.distributed.lookahead_sharding_plan"
    ):
        sharder.compute_kernels("data_parallel", "cpu")
    # nothing to cache: TorchRec's own kernels, so TorchRec's planner works as with its own sharder
    assert "customized_kernel" not in LookaheadEmbeddingBagCollectionSharder().compute_kernels(
        "data_parallel", "cpu"
    )
    with pytest.raises(ConfigError, match="positive"):
        LookaheadEmbeddingBagCollectionSharder(capacity={"t": 0})
    with pytest.raises(ConfigError, match="not both"):
        LookaheadEmbeddingBagCollectionSharder(capacity={"t": 4}, device_budget_bytes=100)


def test_store_sharding_is_a_string_enum_and_bad_values_list_the_valid_ones():
    from torchrec_lookahead.distributed import StoreSharding

    assert LookaheadEmbeddingBagCollectionSharder().store_sharding is StoreSharding.HOST
    sharder = LookaheadEmbeddingBagCollectionSharder(store_sharding="row_wise")
    assert sharder.store_sharding is StoreSharding.ROW_WISE and sharder.store_sharding == "row_wise"
    assert (
        LookaheadEmbeddingBagCollectionSharder(store_sharding=StoreSharding.ROW_WISE).store_sharding
        == "row_wise"
    )
    with pytest.raises(ConfigError, match=r"one of \['host', 'row_wise'\] but got 'rows'"):
        LookaheadEmbeddingBagCollectionSharder(store_sharding="rows")


def test_dmp_without_a_lookahead_plan_is_refused_with_the_fix():
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    _init_pg()
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=100, feature_names=[f"f{i}"])
        for i in range(2)
    ]

    def ebc():
        m = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        apply_optimizer_in_backward(torch.optim.SGD, m.parameters(), {"lr": 0.1})
        return m

    cpu = torch.device("cpu")
    # TorchRec's own planner (no plan): refused before it reaches its estimators, naming the fix
    with pytest.raises(
        ConfigError, match=r"\['t0'\].*plan=torchrec_lookahead.distributed.lookahead_sharding_plan"
    ):
        DistributedModelParallel(
            ebc(), device=cpu, sharders=[LookaheadEmbeddingBagCollectionSharder(capacity={"t0": 8})]
        )
    # a plan made for TorchRec's sharder would train the table resident: refused too
    plan = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu")).plan(
        ebc(), [EmbeddingBagCollectionSharder()]
    )
    with pytest.raises(ConfigError, match=r"\['t0'\] have a cache capacity.*would train resident"):
        DistributedModelParallel(
            ebc(),
            device=cpu,
            sharders=[LookaheadEmbeddingBagCollectionSharder(capacity={"t0": 8})],
            plan=plan,
        )
    # nothing to cache: TorchRec's planner places every table with its own kernels
    dmp = DistributedModelParallel(ebc(), device=cpu, sharders=[LookaheadEmbeddingBagCollectionSharder()])
    kernels = {ps.compute_kernel for mp in dmp.plan.plan.values() for ps in mp.values()}
    assert kernels and "customized_kernel" not in kernels


def test_sharding_plan_marks_cached_tables_customized_and_refuses_unknown_tables():
    from torchrec import EmbeddingBagCollection

    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=4, num_embeddings=100, feature_names=[f"f{i}"])
        for i in range(3)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    sharder = LookaheadEmbeddingBagCollectionSharder(capacity={"t1": 10})
    plan = lookahead_sharding_plan(ebc, [sharder], {"t1": 10}, Topology(world_size=1, compute_device="cpu"))
    module_plan = plan.plan[""]
    assert module_plan["t1"].compute_kernel == "customized_kernel"
    assert module_plan["t1"].sharding_type == "data_parallel"
    assert module_plan["t0"].compute_kernel == "fused"
    with pytest.raises(ConfigError, match="Unknown table"):
        lookahead_sharding_plan(ebc, [sharder], {"t9": 10}, Topology(world_size=1, compute_device="cpu"))
    # a cache of the whole table is allowed; more rows than the table has is refused, naming both
    lookahead_sharding_plan(ebc, [sharder], {"t1": 100}, Topology(world_size=1, compute_device="cpu"))
    with pytest.raises(
        ConfigError,
        match=r"capacity of table 't1' is 100,000,000,000 rows but the table has 100; give at most 100",
    ):
        lookahead_sharding_plan(ebc, [sharder], {"t1": 10**11}, Topology(world_size=1, compute_device="cpu"))


@pytest.mark.parametrize("capacity", [[1, 2], 100, "t_cat_2"])
def test_a_capacity_that_is_not_a_mapping_is_refused(capacity):
    with pytest.raises(ConfigError, match=r"capacity must be a mapping of table name to cache rows"):
        LookaheadEmbeddingBagCollectionSharder(capacity=capacity)


def test_a_budget_that_holds_every_table_trains_them_all_resident(tmp_path):
    from torchrec_lookahead.launch import build_cli

    sharders = (
        '--trainer.strategy.init_args.sharders=[{"class_path": '
        '"torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder", "init_args": '
        '{"capacity": null, "device_budget_bytes": 100000000, "planner_options": {"num_sample_batches": 4}}}]'
    )
    cli = build_cli(["--config", "configs/dlrm_tiny_lookahead.yaml", sharders, "--trainer.max_steps=2",
                     "--trainer.limit_val_batches=0", "--trainer.logger=false",
                     f"--trainer.default_root_dir={tmp_path}"])  # fmt: skip
    with pytest.warns(UserWarning, match="no cached tables"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    (sharder,) = cli.trainer.strategy._sharders
    assert sharder.cache_plan is not None and sharder.capacity == {}
    assert cli.trainer.global_step == 2
    # planned, nothing cached: TorchRec's own planner places the tables; before planning it is refused
    assert "customized_kernel" not in sharder.compute_kernels("data_parallel", "cpu")
    with pytest.raises(ConfigError, match="device_budget_bytes=100"):
        LookaheadEmbeddingBagCollectionSharder(device_budget_bytes=100).compute_kernels(
            "data_parallel", "cpu"
        )


def test_dmp_path_equals_the_module_path():
    """The sharded module under DMP computes what the cached collection computes on its own."""
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed import DistributedModelParallel

    from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig

    from ..conftest import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    tables = [
        EmbeddingBagConfig(name="big", embedding_dim=4, num_embeddings=500, feature_names=["a", "b"]),
        EmbeddingBagConfig(name="small", embedding_dim=4, num_embeddings=20, feature_names=["c"]),
    ]
    opt = CacheOptimizerConfig("exact_row_wise_adagrad", learning_rate=0.1)
    capacity = {"big": 64}
    sharder = LookaheadEmbeddingBagCollectionSharder(capacity=capacity, optimizer=opt, seed=3)
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    plan = lookahead_sharding_plan(ebc, [sharder], capacity, Topology(world_size=1, compute_device="cpu"))
    dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), sharders=[sharder], plan=plan)
    sharded = dmp.module
    alone = CachedEmbeddingBagCollection([tables[0]], capacity, optimizer=opt, seed=3)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(8):
        a = torch.randint(0, 500, (6,), generator=g)
        b = torch.randint(0, 500, (6,), generator=g)
        c = torch.randint(0, 20, (6,), generator=g)
        batches.append(
            KeyedJaggedTensor(
                keys=["a", "b", "c"], values=torch.cat([a, b, c]), lengths=torch.ones(18, dtype=torch.int32)
            )
        )
    oracle = LookaheadOracle(
        OracleConfig(capacity=capacity, horizon=4, feature_to_table={"a": "big", "b": "big", "c": "small"})
    )
    for kjt, step_plan in zip(batches, oracle.plan_stream(batches)):
        sharded.apply_plan(step_plan)
        alone.apply_plan(step_plan)
        remapped = alone.remap(kjt, step_plan)
        out_dmp = dmp(remapped)
        out_alone = alone(remapped.permute([0, 1]))
        assert torch.allclose(out_dmp["a"], out_alone["a"]) and torch.allclose(out_dmp["b"], out_alone["b"])
        (out_dmp.values().sum()).backward()
        out_alone.values().sum().backward()
    sharded.flush()
    alone.flush()
    assert torch.equal(sharded.cache.stores["big"].full_weights(), alone.stores["big"].full_weights())
    # a batch without a feature the tables read is bad data, named as such
    wrong = KeyedJaggedTensor(
        keys=["a", "b", "x"],
        values=torch.zeros(3, dtype=torch.int64),
        lengths=torch.ones(3, dtype=torch.int32),
    )
    with pytest.raises(DataError, match=r"features \['c'\] are missing from the batch"):
        dmp(wrong)


def test_shared_store_directories_of_dead_owners_are_removed_and_live_ones_kept(tmp_path):
    import os
    import subprocess
    import sys
    import time

    from torchrec_lookahead.distributed._store_dirs import (
        STORE_DIR_PREFIX,
        hold_store_dir,
        remove_orphaned_store_dirs,
    )

    old = time.time() - 3600

    def make(name: str) -> str:
        path = tmp_path / f"{STORE_DIR_PREFIX}{name}"
        path.mkdir()
        (path / "t.bin").write_bytes(b"rows")
        return str(path)

    live = make("live")
    fd = hold_store_dir(live)  # this process owns it
    dead = make("dead")
    # a process that took the lock and was killed: the kernel released its lock
    code = (
        "import os, signal; from torchrec_lookahead.distributed._store_dirs import hold_store_dir; "
        f"hold_store_dir({dead!r}); os.kill(os.getpid(), signal.SIGKILL)"
    )
    subprocess.run([sys.executable, "-c", code], check=False)
    young = make("young")  # unlocked but just created (another run may be setting it up): kept for its age
    os.close(hold_store_dir(young))
    unlocked = make("no_lock")  # an older layout without a lock file: never touched
    for p in (live, dead, unlocked):
        os.utime(p, (old, old))
    try:
        removed = remove_orphaned_store_dirs(str(tmp_path))
    finally:
        os.close(fd)
    assert removed == [dead]
    assert os.path.exists(live) and os.path.exists(young) and os.path.exists(unlocked)


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


def test_evaluation_of_a_weighted_mean_fused_table_equals_torchrec_module():
    from torchrec import EmbeddingBagCollection, PoolingType
    from torchrec.distributed import DistributedModelParallel

    from torchrec_lookahead.modules import init_embedding_bag_tables_

    _init_pg()
    tables = [
        _TABLES[0],
        EmbeddingBagConfig(
            name="small", embedding_dim=8, num_embeddings=30, feature_names=["c"], pooling=PoolingType.MEAN
        ),
    ]
    g = torch.Generator().manual_seed(1)
    values = torch.cat([torch.randint(0, 500, (16,), generator=g), torch.randint(0, 30, (16,), generator=g)])
    kjt = KeyedJaggedTensor(
        keys=["a", "b", "c"],
        values=values,
        lengths=torch.tensor([1] * 16 + [2, 0, 3, 1, 2, 1, 3, 4], dtype=torch.int32),
        weights=torch.rand(32, generator=g),
    )
    outs = []
    for fuse in (None, False):
        ebc = EmbeddingBagCollection(tables=tables, is_weighted=True, device=torch.device("meta"))
        fp = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
        sharder = LookaheadEmbeddingBagCollectionSharder(
            capacity={"big": 64}, fuse_resident=fuse, fused_params=fp
        )
        plan = lookahead_sharding_plan(
            ebc, [sharder], {"big": 64}, Topology(world_size=1, compute_device="cpu")
        )
        dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), sharders=[sharder], plan=plan)
        assert (dmp.module.resident is None) == (fuse is None)
        init_embedding_bag_tables_(dmp, tables[1:], seed=5)
        dmp.eval()
        with torch.no_grad():
            outs.append(dmp(kjt).values())
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)


class _ScheduledDLRM(DLRMModule):
    """The tiny DLRM with a per-step learning-rate decay on every parameter group (embeddings included)."""

    def configure_optimizers(self):
        opt = super().configure_optimizers()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.5 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.mark.parametrize("fuse", [None, False], ids=["fused", "split"])
def test_a_learning_rate_scheduler_reaches_the_cached_tables_as_torchrec_resident_ones(tmp_path, fuse):
    """A scheduler on the model's optimizer schedules the cache (and fused resident tables) through the sharded
    module's fused_optimizer, step for step as it schedules TorchRec's fused TBE."""
    steps = 12
    _, resident = fit_cached(tmp_path / "r", steps, capacity={}, model_cls=_ScheduledDLRM)
    trainer, cached = fit_cached(
        tmp_path / "c", steps, model_cls=_ScheduledDLRM, sharder_kw={"fuse_resident": fuse}
    )
    assert max_abs_diff(weights(resident), weights(cached)) <= 1e-6
    _, unscheduled = fit_cached(tmp_path / "u", steps, sharder_kw={"fuse_resident": fuse})
    assert max_abs_diff(weights(unscheduled), weights(cached)) > 1e-4  # the schedule mattered
    (cache,) = [m for m in cached.modules() if isinstance(m, CachedEmbeddingBagCollection)]
    assert cache.learning_rate == float(torch.tensor(0.05 / (1.0 + 0.5 * (steps - 1)), dtype=torch.float32))


def test_set_learning_rate_refuses_bad_values():
    ebc = CachedEmbeddingBagCollection(
        [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=100, feature_names=["f"])], {"t": 10}
    )
    for bad in (-0.1, float("nan"), float("inf"), "0.1", True):
        with pytest.raises(ConfigError, match="learning rate"):
            ebc.set_learning_rate(bad)
    ebc.set_learning_rate(torch.tensor(0.5))
    assert ebc.learning_rate == 0.5


def test_cache_fused_optimizer_steps_hyper_parameters_and_saved_groups():
    """TorchRec's fused-optimizer calls reach the cache; several caches' groups restore apart."""
    from torchrec.optim.keyed import CombinedOptimizer

    from torchrec_lookahead.distributed import CacheFusedOptimizer

    def cache(lr):
        tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=100, feature_names=["f"])]
        return CachedEmbeddingBagCollection(tables, {"t": 10}, CacheOptimizerConfig("adam", learning_rate=lr))

    a, b = cache(0.5), cache(0.25)
    opt = CombinedOptimizer([("a", CacheFusedOptimizer(a)), ("b", CacheFusedOptimizer(b))])
    opt.set_optimizer_step(7)
    assert a.optimizer_step == b.optimizer_step == 7
    opt.optimizers[0][1].update_hyper_parameters({"lr": 0.125})
    assert a.learning_rate == 0.125 and b.learning_rate == 0.25
    with pytest.raises(ConfigError, match="only 'lr'"):
        opt.optimizers[0][1].update_hyper_parameters({"eps": 1e-3})
    opt.save_param_groups(True)
    saved = opt.state_dict()
    for group in opt.param_groups:
        group["lr"] = 1.0
    opt.load_state_dict(saved)
    opt.step()
    assert (a.learning_rate, b.learning_rate) == (0.125, 0.25)


class _TwoCollections(torch.nn.Module):
    """A pooled and a sequence collection side by side (the model shape of issue reports)."""

    def __init__(self) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingCollection, EmbeddingConfig

        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="big", embedding_dim=4, num_embeddings=500, feature_names=["a"])],
            device=torch.device("meta"),
        )
        self.ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name="seq", embedding_dim=4, num_embeddings=50, feature_names=["s"])],
            device=torch.device("meta"),
        )


def test_sharders_add_to_torchrec_defaults_and_an_unsharded_collection_is_refused():
    import lightning.pytorch as pl
    import torch.distributed as dist
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import ShardedEmbeddingCollection

    from torchrec_lookahead.distributed import (
        ShardedLookaheadEmbeddingBagCollection,
        check_all_sharded,
        with_default_sharders,
    )
    from torchrec_lookahead.strategies import TorchRecStrategy

    from ..conftest import free_port

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    opt = CacheOptimizerConfig("exact_row_wise_adagrad", learning_rate=0.1)
    capacity = {"big": 64}

    def sharder() -> LookaheadEmbeddingBagCollectionSharder:
        return LookaheadEmbeddingBagCollectionSharder(capacity=capacity, optimizer=opt, seed=3)

    # the strategy: sharders=[lookahead sharder] keeps TorchRec's EmbeddingCollection sharder
    strategy = TorchRecStrategy(sharders=[sharder()], init_seed=3)
    pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    dmp = strategy.shard(_TwoCollections())
    assert isinstance(dmp.module.ebc, ShardedLookaheadEmbeddingBagCollection)
    assert isinstance(dmp.module.ec, ShardedEmbeddingCollection)
    # a plain TorchRec loop given only the lookahead sharder leaves the EmbeddingCollection unsharded
    topology = Topology(world_size=1, compute_device="cpu")
    model = _TwoCollections()
    plan = lookahead_sharding_plan(model, [sharder()], capacity, topology)
    bare = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[sharder()], plan=plan)
    assert not isinstance(bare.module.ec, ShardedEmbeddingCollection)
    with pytest.raises(ConfigError, match=r"\['ec \(EmbeddingCollection\)'\] were left unsharded"):
        check_all_sharded(bare)
    model = _TwoCollections()
    plan = lookahead_sharding_plan(model, with_default_sharders([sharder()]), capacity, topology)
    full = DistributedModelParallel(
        model, device=torch.device("cpu"), sharders=with_default_sharders([sharder()]), plan=plan
    )
    check_all_sharded(full)
    assert isinstance(full.module.ec, ShardedEmbeddingCollection)


@pytest.mark.parametrize("keep", [False, True])
def test_one_rank_store_dir_is_removed_after_the_run_unless_kept(tmp_path, monkeypatch, keep):
    import os
    import shutil
    import time

    from torchrec_lookahead.distributed import _store_dirs
    from torchrec_lookahead.distributed._store_dirs import STORE_DIR_PREFIX

    at_exit = []
    monkeypatch.setattr(_store_dirs.atexit, "register", lambda f, *a: at_exit.append((f, a)))
    orphan = tmp_path / f"{STORE_DIR_PREFIX}killed_run"  # a killed run's stores: no live owner holds the lock
    orphan.mkdir()
    (orphan / ".owner.lock").touch()
    (orphan / "big.bin").write_bytes(b"rows")
    os.utime(orphan, (time.time() - 3600, time.time() - 3600))
    trainer, model = fit_cached(
        tmp_path / "run", max_steps=3, sharder_kw={"store_dir": str(tmp_path), "keep_stores": keep}
    )
    assert trainer.global_step == 3
    assert not orphan.exists()  # swept when the run made its own directory
    made = sorted(p for p in os.listdir(tmp_path) if p.startswith("torchrec_lookahead_"))
    assert len(made) == 1 and os.listdir(tmp_path / made[0])  # this run's directory, holding the tables
    removals = [a[0] for f, a in at_exit if f is shutil.rmtree]
    if keep:
        assert made[0].startswith("torchrec_lookahead_kept_stores_") and not removals
    else:
        assert removals == [str(tmp_path / made[0])]
        for f, a in at_exit:  # what the process runs when it exits
            f(*a)
        assert not any(p.startswith("torchrec_lookahead_") for p in os.listdir(tmp_path))
