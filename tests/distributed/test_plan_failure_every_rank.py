"""Several ranks: the cached job's sharding plan is made on rank 0 and broadcast; a planner failure there reaches
every rank, instead of leaving the others waiting for the plan's broadcast."""

import datetime
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from ..conftest import free_port, start_method

#: rank 0's one line for TorchRec's PlannerError
_PLACED = "ConfigError: TorchRec's planner could not place the tables (Unable to find a plan"


def _worker(rank: int, port: int, outdir: str) -> None:
    from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder, lookahead_sharding_plan
    from torchrec_lookahead.distributed.topology import make_topology

    os.environ["PYTHONWARNINGS"] = "ignore"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=20),
    )  # fmt: skip
    out = {}
    try:
        tables = [  # 'big' (~51 TB) stays resident: no rank can hold it, the planner fails (on rank 0)
            EmbeddingBagConfig(name="big", embedding_dim=128, num_embeddings=10**11, feature_names=["a"]),
            EmbeddingBagConfig(name="small", embedding_dim=8, num_embeddings=100, feature_names=["b"]),
        ]
        model = nn.Sequential(EmbeddingBagCollection(tables=tables, device=torch.device("meta")))
        lookahead_sharding_plan(
            model,
            [LookaheadEmbeddingBagCollectionSharder(capacity={"small": 10})],
            {"small": 10},
            make_topology(2, "cpu"),
            pg=dist.group.WORLD,
        )
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(e).__name__}: {e}"[:300]
    Path(outdir, f"{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_a_plan_that_fails_on_rank_0_fails_on_every_rank(tmp_path):
    """TorchRec's collective_plan plans on rank 0 only: its error left rank 1 waiting in the plan's broadcast
    (until the process group's timeout, 30 minutes by default; a torchrun job hung there)."""
    mp.start_processes(_worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method=start_method())
    per_rank = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert per_rank[0]["error"].startswith(_PLACED), per_rank
    assert per_rank[1]["error"].startswith(f"SetupError: rank 0 could not plan the sharding ({_PLACED}"), (
        per_rank
    )
    assert "timed out" not in per_rank[1]["error"].lower() and "Timeout" not in per_rank[1]["error"], per_rank


def _strategy_worker(rank: int, port: int, outdir: str) -> None:
    from lightning.fabric.plugins.environments import LightningEnvironment

    from torchrec_lookahead.strategies import TorchRecStrategy

    os.environ.update(PYTHONWARNINGS="ignore", LOCAL_RANK=str(rank))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=20),
    )  # fmt: skip
    env = LightningEnvironment()
    env.set_world_size(2)
    env.set_global_rank(rank)
    strategy = TorchRecStrategy(parallel_devices=[torch.device("cpu")] * 2, cluster_environment=env)
    out = {}
    try:  # a resident job (no cached tables): TorchRecStrategy plans it itself
        table = EmbeddingBagConfig(name="big", embedding_dim=128, num_embeddings=10**11, feature_names=["a"])
        strategy.shard(nn.Sequential(EmbeddingBagCollection(tables=[table], device=torch.device("meta"))))
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(e).__name__}: {e}"[:300]
    Path(outdir, f"{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_a_resident_plan_of_the_strategy_that_fails_on_rank_0_fails_on_every_rank(tmp_path):
    """TorchRecStrategy's own plan of a job without cached tables: the same wait on rank 1."""
    mp.start_processes(
        _strategy_worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method=start_method()
    )
    per_rank = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert per_rank[0]["error"].startswith(_PLACED), per_rank
    assert per_rank[1]["error"].startswith(f"SetupError: rank 0 could not plan the sharding ({_PLACED}"), (
        per_rank
    )
