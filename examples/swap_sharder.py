"""A plain TorchRec training loop that adopts the lookahead cache by changing three lines.

The loop is TorchRec's usual one: ``DistributedModelParallel`` over ``DLRMTrain``, a fused embedding optimizer
and a dense optimizer combined, and a train pipeline whose ``progress(iterator)`` runs one step on the next
batch of a streamed dataset. To train the large tables through the lookahead cache, three lines differ from
the resident loop (marked ``# <-``): the sharder (``LookaheadEmbeddingBagCollectionSharder`` with cache
capacities), the sharding plan (``lookahead_sharding_plan``: TorchRec's planner places the resident tables, the
cached ones go to the cache) and the pipeline (``LookaheadTrainPipeline``, which plans the cache ahead in
background threads and writes every cached row back when the stream ends). The losses are those of the
resident loop, bit for bit.

    .venv/bin/python examples/swap_sharder.py --steps 50            # cached
    .venv/bin/python examples/swap_sharder.py --steps 50 --resident # TorchRec's resident loop, same losses
    .venv/bin/torchrun --nproc_per_node=2 examples/swap_sharder.py  # each rank its part of every batch
"""

from __future__ import annotations

import argparse
import os
import socket
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.train_pipeline import TrainPipelineBase
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from torchrec_lookahead import LookaheadTrainPipeline
from torchrec_lookahead.data import CriteoSyntheticDataset, SyntheticCriteoConfig
from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder, lookahead_sharding_plan
from torchrec_lookahead.modules import init_embedding_bag_tables_

CAPACITY = {"t_cat_2": 5100, "t_cat_3": 2200, "t_cat_11": 4200, "t_cat_15": 2800, "t_cat_20": 3600}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Train ``--steps`` steps; returns this rank's per-step ``losses`` (identical with ``--resident``) and the
    last ``loss``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=1024, help="rows per batch on each rank")
    p.add_argument("--resident", action="store_true", help="TorchRec's resident loop (the baseline)")
    args = p.parse_args(argv)
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size)):
        if value < 1:
            p.error(f"{flag} must be at least 1 but got {value}")

    if not dist.is_initialized():
        if "RANK" in os.environ:  # launched by torchrun
            dist.init_process_group("gloo")
        else:
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
            )
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    # A stream: each rank reads its own part of every batch, as training goes (nothing is held in memory).
    config = SyntheticCriteoConfig(
        batch_size=args.batch_size, num_batches=args.steps, world_size=world, rank=rank
    )
    data = CriteoSyntheticDataset(config)
    tables = [
        EmbeddingBagConfig(name=f"t_{f}", embedding_dim=16, num_embeddings=n, feature_names=[f])
        for f, n in data.num_embeddings_per_feature().items()
    ]
    dlrm = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=13,
        dense_arch_layer_sizes=[64, 16],
        over_arch_layer_sizes=[64, 32, 1],
        dense_device=torch.device("cpu"),
    )
    model = DLRMTrain(dlrm)
    apply_optimizer_in_backward(RowWiseAdagrad, dlrm.sparse_arch.parameters(), {"lr": 0.05, "eps": 1e-8})
    device = torch.device("cpu")
    topology = Topology(world_size=world, compute_device="cpu")
    # every resident table whole on one rank with FBGEMM's fused kernel, in both loops
    fused = {
        t.name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"]) for t in tables
    }

    if args.resident:  # TorchRec's resident loop
        sharders: List[Any] = [EmbeddingBagCollectionSharder()]
        plan = EmbeddingShardingPlanner(topology, constraints=fused).collective_plan(model, sharders)
    else:  # the same loop through the lookahead cache
        sharders = [LookaheadEmbeddingBagCollectionSharder(capacity=CAPACITY, seed=0)]  # <-
        plan = lookahead_sharding_plan(model, sharders, CAPACITY, topology, constraints=fused)  # <-
    dmp = DistributedModelParallel(model, device=device, sharders=sharders, plan=plan)
    # Resident tables start from the values the cache's host stores start from (seed 0).
    init_embedding_bag_tables_(dmp, [t for t in tables if args.resident or t.name not in CAPACITY], seed=0)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    if args.resident:
        pipeline: TrainPipelineBase[Any, Any] = TrainPipelineBase(dmp, optimizer, device)
    else:
        pipeline = LookaheadTrainPipeline(dmp, optimizer, device)  # <-

    losses: List[float] = []
    batches = iter(data)
    while True:
        try:
            loss, _, _ = pipeline.progress(batches)
        except StopIteration:  # the cached pipeline has written every cached row back to its host store
            break
        losses.append(float(loss))
    return {"loss": losses[-1], "losses": losses}


if __name__ == "__main__":
    print({"loss": main()["loss"]})
