"""A plain TorchRec loop trained resident (TorchRec's sharder, planner and ``TrainPipelineBase``) and cached
(the lookahead sharder and ``LookaheadTrainPipeline``), for the pipeline's exactness tests.

Run under torchrun to compare the two on several ranks (each rank writes ``<out>/rank<r>.json``)::

    python -m torch.distributed.run --nproc_per_node=2 -m tests.pipeline_runs <out>

``TRL_TEST_DEVICE=cuda`` trains on the GPU (every rank on the current device, gloo between them: two ranks
share one GPU).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Tuple

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
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

from torchrec_lookahead import preserved_rng
from torchrec_lookahead.data import CriteoSyntheticDataset, SyntheticCriteoConfig
from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder, lookahead_sharding_plan
from torchrec_lookahead.export import resident_key
from torchrec_lookahead.modules import init_embedding_bag_tables_
from torchrec_lookahead.train_pipeline import LookaheadTrainPipeline

TABLES = [50, 20, 300, 100, 7, 3, 40, 30, 2, 60, 25, 200, 15, 5, 35, 150, 4, 22, 18, 3, 120, 6, 5, 45, 9, 55]
CAPACITY = {"t_cat_2": 200, "t_cat_11": 150, "t_cat_15": 120}
CPU = torch.device("cpu")


def whole_weights(dmp: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Weights and biases this rank holds whole, under the resident model's keys (sharded tables: the local
    shard when it is the whole table, i.e. table-wise on this rank; the cache's tables after a flush)."""
    out: Dict[str, torch.Tensor] = {}
    for key, v in dmp.state_dict().items():
        if not key.endswith((".weight", ".bias")):
            continue
        if isinstance(v, ShardedTensor):
            shards = v.local_shards()
            if len(shards) != 1 or tuple(shards[0].tensor.shape) != tuple(v.size()):
                continue
            v = shards[0].tensor
        out[resident_key(key)] = v.detach().clone()
    return out


def build(
    cached: bool,
    steps: int = 12,
    batch_size: int = 64,
    capacity: Mapping[str, int] = CAPACITY,
    dropout: float = 0.2,
    device: torch.device = CPU,
    **pipeline_kw: Any,
) -> Tuple[DistributedModelParallel, Any, CriteoSyntheticDataset]:
    """The sharded tiny DLRM on ``device`` (``dropout`` on its bottom MLP's output: its masks come from the
    global random stream), its pipeline (TorchRec's ``TrainPipelineBase`` when resident) and this rank's part of
    a ``steps``-batch stream. The model is sharded inside ``preserved_rng``, as a plain loop that compares the
    two must: TorchRec draws the random initial values of the tables it builds, and the plans differ."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    config = SyntheticCriteoConfig(batch_size=batch_size, num_batches=steps, num_embeddings=TABLES, seed=0,
                                   world_size=world, rank=rank)  # fmt: skip
    data = CriteoSyntheticDataset(config)
    tables = [
        EmbeddingBagConfig(name=f"t_{f}", embedding_dim=8, num_embeddings=n, feature_names=[f])
        for f, n in data.num_embeddings_per_feature().items()
    ]
    dlrm = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=13,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
    )
    if dropout:
        dlrm.dense_arch.register_forward_hook(
            lambda m, i, out: torch.nn.functional.dropout(out, dropout, m.training)
        )
    model = DLRMTrain(dlrm)
    apply_optimizer_in_backward(RowWiseAdagrad, dlrm.sparse_arch.parameters(), {"lr": 0.05, "eps": 1e-8})
    topology = Topology(world_size=world, compute_device=device.type)
    if cached:
        sharders: List[Any] = [LookaheadEmbeddingBagCollectionSharder(capacity=dict(capacity), seed=0)]
        plan = lookahead_sharding_plan(
            model, sharders, capacity, topology, sharding_types=["table_wise"], pg=dist.group.WORLD
        )
    else:
        sharders = [EmbeddingBagCollectionSharder()]
        cons = {t.name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
                for t in tables}  # fmt: skip
        plan = EmbeddingShardingPlanner(topology=topology, constraints=cons).collective_plan(model, sharders)
    with preserved_rng():
        dmp = DistributedModelParallel(model, device=device, sharders=sharders, plan=plan)
    init_embedding_bag_tables_(dmp, [t for t in tables if not cached or t.name not in capacity], seed=0)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    pipeline: Any = (
        LookaheadTrainPipeline(dmp, optimizer, device, **pipeline_kw)
        if cached
        else TrainPipelineBase(dmp, optimizer, device)
    )
    return dmp, pipeline, data


def counted(data: Iterable[Any], pulled: List[int]) -> Iterator[Any]:
    """``data``'s batches, counting in ``pulled[0]`` how many have been read."""
    for b in data:
        pulled[0] += 1
        yield b


def train(cached: bool, epochs: int = 1, horizon: int = 8, **kw: Any) -> Dict[str, Any]:
    """Train the tiny DLRM ``epochs`` times over this rank's part of the stream (:func:`build`); returns the
    per-step losses, :func:`whole_weights`, per step the batches read from the stream by then, the cached
    collections' synchronisation counters and the lookahead loader's queue depth."""
    dmp, pipeline, data = build(cached, **kw, **({"horizon": horizon} if cached else {}))
    losses: List[float] = []
    pulled, read = [0], []
    for _ in range(epochs):
        it = counted(data, pulled)  # streamed: the pipeline reads the iterator as training goes
        while True:
            try:
                loss, _, _ = pipeline.progress(it)
            except StopIteration:
                break
            losses.append(float(loss))
            read.append(pulled[0])
        pipeline.reset()  # TorchRec's way to start the next stream
    sync = dict(pipeline.session.stats().sync) if isinstance(pipeline, LookaheadTrainPipeline) else {}
    loader = pipeline.loader if isinstance(pipeline, LookaheadTrainPipeline) else None
    queue_depth = None if loader is None else loader.queue_depth  # as the loader raised it
    return {
        "losses": losses,
        "weights": whole_weights(dmp),
        "read": read,
        "sync": sync,
        "queue_depth": queue_depth,
    }


def compare(a: Mapping[str, Any], b: Mapping[str, Any]) -> Dict[str, Any]:
    """Largest weight difference over the keys both runs hold whole, and whether the losses are equal."""
    common = sorted(set(a["weights"]) & set(b["weights"]))
    dw = max((a["weights"][k].cpu() - b["weights"][k].cpu()).abs().max().item() for k in common)
    return {
        "max_dw": dw,
        "keys": common,
        "losses_equal": a["losses"] == b["losses"],
        "steps": len(a["losses"]),
    }


def main(out: str) -> None:
    dist.init_process_group("gloo")
    device = torch.device(os.environ.get("TRL_TEST_DEVICE", "cpu"))
    resident = train(cached=False, device=device)
    cached = train(cached=True, device=device)
    result = compare(cached, resident)
    result["sync"] = cached["sync"]
    result["all_keys"] = sorted(resident["weights"])
    result["device"] = str(device)
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
