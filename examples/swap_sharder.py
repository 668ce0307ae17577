"""A plain TorchRec training loop where only the sharder and the data wrapper change.

The loop is TorchRec's usual one (DistributedModelParallel, a fused embedding optimizer, a dense optimizer);
to train the large tables through the lookahead cache, two lines differ from the resident loop: the sharder
(``LookaheadEmbeddingBagCollectionSharder`` with cache capacities) and the batches (planned by
``LookaheadOracle`` and remapped to cache slots; ``apply_plan`` before each step).

    .venv/bin/python examples/swap_sharder.py --steps 50            # cached
    .venv/bin/python examples/swap_sharder.py --steps 50 --resident # every table resident, same results
    .venv/bin/torchrun --nproc_per_node=1 examples/swap_sharder.py
"""

from __future__ import annotations

import argparse
import os
import socket
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import Topology
from torchrec.models.dlrm import DLRM
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from torchrec_lookahead.data import CriteoSyntheticDataset, SyntheticCriteoConfig
from torchrec_lookahead.distributed import (
    LookaheadEmbeddingBagCollectionSharder,
    ShardedLookaheadEmbeddingBagCollection,
    check_all_sharded,
    lookahead_sharding_plan,
    with_default_sharders,
)
from torchrec_lookahead.modules import init_embedding_bag_tables_, remap_kjt
from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig

CAPACITY = {"t_cat_2": 5100, "t_cat_3": 2200, "t_cat_11": 4200, "t_cat_15": 2800, "t_cat_20": 3600}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, float]:
    """Train ``--steps`` steps; returns the last loss (identical with and without ``--resident``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--resident", action="store_true", help="train every table resident (the baseline)")
    args = p.parse_args(argv)

    if not dist.is_initialized():
        if "RANK" in os.environ:  # launched by torchrun
            dist.init_process_group("gloo")
        else:
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
            )
    torch.manual_seed(0)
    data = CriteoSyntheticDataset(SyntheticCriteoConfig(batch_size=args.batch_size, num_batches=args.steps))
    tables = [
        EmbeddingBagConfig(name=f"t_{f}", embedding_dim=16, num_embeddings=n, feature_names=[f])
        for f, n in data.num_embeddings_per_feature().items()
    ]
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=13,
        dense_arch_layer_sizes=[64, 16],
        over_arch_layer_sizes=[64, 32, 1],
        dense_device=torch.device("cpu"),
    )
    apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": 0.05, "eps": 1e-8})

    capacity = {} if args.resident else CAPACITY
    # --- the swap: the lookahead sharder and a plan with the cached tables -------------------------------
    # TorchRec's default sharders stay for every other module type (an EmbeddingCollection, ...)
    sharders = with_default_sharders([LookaheadEmbeddingBagCollectionSharder(capacity=capacity, seed=0)])
    plan = lookahead_sharding_plan(model, sharders, capacity, Topology(world_size=1, compute_device="cpu"))
    # ------------------------------------------------------------------------------------------------------
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=sharders, plan=plan)
    check_all_sharded(dmp)
    init_embedding_bag_tables_(dmp, [t for t in tables if t.name not in capacity], seed=0)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])

    f2t = {f: t.name for t in tables for f in t.feature_names}
    # --- the data wrapper: plans from the oracle, ids remapped to cache slots ---------------------------
    oracle = (
        LookaheadOracle(OracleConfig(capacity=capacity, horizon=64, feature_to_table=f2t))
        if capacity
        else None
    )
    batches = list(data)
    plans = oracle.plan_stream(b.sparse_features for b in batches) if oracle else iter([None] * len(batches))
    cached = [m for m in dmp.modules() if isinstance(m, ShardedLookaheadEmbeddingBagCollection)]
    # ------------------------------------------------------------------------------------------------------
    loss = torch.zeros(())
    for batch, step_plan in zip(batches, plans):
        features = batch.sparse_features
        if step_plan is not None:
            for m in cached:
                m.apply_plan(step_plan)
            features = remap_kjt(features, step_plan, f2t, sorted(capacity))
        logits = dmp(batch.dense_features, features).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for m in cached:
        m.flush()  # every cached row and its optimizer state back in the host store
    return {"loss": float(loss)}


if __name__ == "__main__":
    print(main())
