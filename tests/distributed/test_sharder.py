import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.planner import Topology

from torchrec_lookahead import ConfigError, DataError
from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder, lookahead_sharding_plan
from torchrec_lookahead.models import DLRMModule
from torchrec_lookahead.modules import CachedEmbeddingBagCollection, CacheOptimizerConfig

from ..helpers import fit_cached, max_abs_diff, weights
from .test_sharder_fuse_resident import _init_pg


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


def test_a_disk_store_refuses_an_explicit_host_sharding(tmp_path):
    """The disk tier is row-sharded (a host tier per rank): `store: disk` with `store_sharding: host` ran row-wise
    without a word."""
    from torchrec_lookahead.distributed import StoreSharding

    disk = {"store": "disk", "store_dir": str(tmp_path), "host_budget_bytes": 1 << 20}
    with pytest.raises(
        ConfigError, match=r"store_sharding='host' with store='disk': the disk tier is row-sharded"
    ):
        LookaheadEmbeddingBagCollectionSharder(store_sharding="host", **disk)
    with pytest.raises(ConfigError, match="the disk tier is row-sharded"):
        LookaheadEmbeddingBagCollectionSharder(store_sharding=StoreSharding.HOST, **disk)
    assert (
        LookaheadEmbeddingBagCollectionSharder(store_sharding="row_wise", **disk).store_sharding == "row_wise"
    )
    assert LookaheadEmbeddingBagCollectionSharder(**disk).store_kind == "disk"  # unset: row-sharded
    assert LookaheadEmbeddingBagCollectionSharder(store_sharding="host").store_sharding == "host"  # ram: fine


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


def test_the_design_notes_give_the_age_at_which_dead_runs_store_directories_are_removed():
    """docs/design.md said "older than a minute"; the code removes them from 10 s."""
    import pathlib
    import re

    from torchrec_lookahead.distributed._store_dirs import _ORPHAN_MIN_AGE_S

    text = (pathlib.Path(__file__).parents[2] / "docs" / "design.md").read_text()
    paragraph = text.split("**The shared store after a restart.**", 1)[1].split("\n\n", 1)[0]
    (age,) = re.findall(r"older than (\d+) seconds", " ".join(paragraph.split()))
    assert float(age) == _ORPHAN_MIN_AGE_S
