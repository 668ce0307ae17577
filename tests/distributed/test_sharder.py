import importlib.util

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.planner import Topology

from torchrec_lookahead import ConfigError
from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder, lookahead_sharding_plan
from torchrec_lookahead.modules import CachedEmbeddingBagCollection, CacheOptimizerConfig

from ..conftest import REPO


def _example():
    spec = importlib.util.spec_from_file_location("swap_sharder", REPO / "examples" / "swap_sharder.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plain_torchrec_loop_with_the_swapped_sharder_equals_the_resident_loop():
    ex = _example()
    cached = ex.main(["--steps", "6", "--batch-size", "256"])
    resident = ex.main(["--steps", "6", "--batch-size", "256", "--resident"])
    assert cached["loss"] == pytest.approx(resident["loss"], abs=1e-6)


def test_compute_kernels_and_argument_checks():
    sharder = LookaheadEmbeddingBagCollectionSharder(capacity={"t": 8})
    assert "customized_kernel" in sharder.compute_kernels("data_parallel", "cpu")
    assert "customized_kernel" not in sharder.compute_kernels("table_wise", "cpu")
    with pytest.raises(ConfigError, match="positive"):
        LookaheadEmbeddingBagCollectionSharder(capacity={"t": 0})
    with pytest.raises(ConfigError, match="not both"):
        LookaheadEmbeddingBagCollectionSharder(capacity={"t": 4}, device_budget_bytes=100)


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


def test_shared_store_directories_of_dead_owners_are_removed_and_live_ones_kept(tmp_path):
    import os
    import subprocess
    import sys
    import time

    from torchrec_lookahead.distributed.sharder import (
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
    code = f"import os, signal; from torchrec_lookahead.distributed.sharder import hold_store_dir; hold_store_dir({dead!r}); os.kill(os.getpid(), signal.SIGKILL)"
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
