"""Helpers of the cache exactness tests: synthetic batches, a naive planner, the resident DMP baseline."""

from __future__ import annotations

import random
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.modules.embedding_configs import PoolingType

from torchrec_lookahead.errors import CapacityError
from torchrec_lookahead.modules import (
    CachedEmbeddingBagCollection,
    CacheOptimizerConfig,
    init_embedding_bag_tables_,
)
from torchrec_lookahead.oracle.types import BatchPlan, TablePlan

SEED = 7
CPU = torch.device("cpu")


def make_tables(mean_table: bool = False) -> List[EmbeddingBagConfig]:
    """t0 (2 features, multi-hot, dim 8), t1 (single-hot, dim 4), t2 (resident-friendly, dim 4)."""
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=200, feature_names=["f0", "f1"]),
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=120, feature_names=["f2"]),
        EmbeddingBagConfig(
            name="t2",
            embedding_dim=4,
            num_embeddings=30,
            feature_names=["f3"],
            pooling=PoolingType.MEAN if mean_table else PoolingType.SUM,
        ),
    ]


def make_batches(
    tables: Sequence[EmbeddingBagConfig],
    steps: int,
    batch_size: int = 8,
    seed: int = 0,
    multi_hot: bool = True,
) -> List[KeyedJaggedTensor]:
    """Skewed ids (reuse across steps); t1 single-hot, other features 0..3 ids per sample when multi_hot."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        keys, values, lengths = [], [], []
        for cfg in tables:
            for f in cfg.feature_names:
                if cfg.name == "t1" or not multi_hot:
                    lens = torch.ones(batch_size, dtype=torch.int64)
                else:
                    lens = torch.randint(0, 4, (batch_size,), generator=gen)
                n = int(lens.sum())
                # squared uniform -> small ids are hot
                ids = (torch.rand(n, generator=gen) ** 2 * cfg.num_embeddings).long()
                keys.append(f)
                values.append(ids)
                lengths.append(lens)
        out.append(KeyedJaggedTensor.from_lengths_sync(keys, torch.cat(values), torch.cat(lengths)))
    return out


def naive_plans(
    batches: Sequence[Dict[str, torch.Tensor]],
    capacity: Dict[str, int],
    policy: str = "belady",
    seed: int = 0,
) -> List[BatchPlan]:
    """Reference planner in plain Python: Belady (furthest next use), LRU or random eviction, on demand."""
    rng = random.Random(seed)
    plans: List[BatchPlan] = []
    state = {t: ({}, list(range(cap))[::-1], {}) for t, cap in capacity.items()}  # id->slot, free, last use
    for step, batch in enumerate(batches):
        tables: Dict[str, TablePlan] = {}
        for t, cap in capacity.items():
            slot_of, free, last = state[t]
            ids = batch[t].tolist()
            needed = list(dict.fromkeys(ids))
            if len(needed) > cap:
                raise CapacityError(f"step {step} table {t}: {len(needed)} rows needed, capacity {cap}")
            misses = [i for i in needed if i not in slot_of]
            ev_ids, ev_slots = [], []
            while len(free) < len(misses):
                candidates = [i for i in slot_of if i not in set(needed)]
                if policy == "belady":

                    def next_use(i: int, step: int = step, t: str = t) -> int:
                        for s in range(step + 1, len(batches)):
                            if i in set(batches[s][t].tolist()):
                                return s
                        return len(batches) + i  # never again: ties broken by id

                    victim = max(candidates, key=next_use)
                elif policy == "lru":
                    victim = min(candidates, key=lambda i: (last[i], i))
                else:
                    victim = rng.choice(sorted(candidates))
                slot = slot_of.pop(victim)
                ev_ids.append(victim)
                ev_slots.append(slot)
                free.append(slot)
            fe_ids, fe_slots = [], []
            for i in misses:
                slot = free.pop()
                slot_of[i] = slot
                fe_ids.append(i)
                fe_slots.append(slot)
            for i in needed:
                last[i] = step
            as_t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
            tables[t] = TablePlan(
                as_t(ev_ids), as_t(ev_slots), as_t(fe_ids), as_t(fe_slots), as_t([slot_of[i] for i in ids])
            )
        plans.append(BatchPlan(step, tables))
    return plans


def min_capacity(batches: Sequence[Dict[str, torch.Tensor]], tables: Sequence[str]) -> Dict[str, int]:
    """Largest number of distinct ids of one batch, per table (the on-demand planner's minimum)."""
    return {t: max(int(torch.unique(b[t]).numel()) for b in batches) for t in tables}


def make_dmp(
    tables: Sequence[EmbeddingBagConfig],
    optimizer: CacheOptimizerConfig,
    is_weighted: bool = False,
    device: torch.device = CPU,
) -> DistributedModelParallel:
    """The resident baseline: TorchRec EBC sharded table-wise with the FUSED kernel on the 1-rank group (on
    ``device``: FBGEMM's CPU or CUDA kernels)."""
    ebc = EmbeddingBagCollection(tables=list(tables), device=torch.device("meta"), is_weighted=is_weighted)
    sharder = EmbeddingBagCollectionSharder(fused_params=optimizer.fused_params())
    constraints = {
        t.name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"]) for t in tables
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device=device.type), constraints=constraints
    )
    plan = planner.collective_plan(ebc, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(ebc, device=device, sharders=[sharder], plan=plan)
    init_embedding_bag_tables_(dmp, tables, SEED)
    return dmp


def dmp_tables(dmp: DistributedModelParallel) -> Dict[str, Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
    """Table name -> (weights, states) of the resident baseline (clones)."""
    out = {}
    names = ("momentum1", "momentum2")
    for lookup in dmp.module._lookups:
        for emb in lookup._emb_modules:
            tbe = emb._emb_module
            table_names = [t.name for t in emb.config.embedding_tables]
            weights = tbe.split_embedding_weights()
            states = tbe.split_optimizer_states()
            for i, name in enumerate(table_names):
                st = (
                    {
                        names[k]: v.detach().clone().view(weights[i].shape[0], -1)
                        for k, v in enumerate(states[i])
                    }
                    if states
                    else {}
                )
                out[name] = (weights[i].detach().clone(), st)
    return out


def cached_tables(
    ebc: CachedEmbeddingBagCollection,
) -> Dict[str, Tuple[torch.Tensor, Dict[str, torch.Tensor]]]:
    """Table name -> (weights, states) of the full tables, read through state_dict (which flushes)."""
    sd = ebc.state_dict()
    out = {}
    for cfg in ebc.embedding_bag_configs():
        key = f"embedding_bags.{cfg.name}."
        states = {
            k[len(key) :]: v.clone() for k, v in sd.items() if k.startswith(key) and not k.endswith("weight")
        }
        out[cfg.name] = (sd[key + "weight"].clone(), states)
    return out


def max_table_diff(
    a: Dict[str, Tuple[torch.Tensor, Dict[str, torch.Tensor]]],
    b: Dict[str, Tuple[torch.Tensor, Dict[str, torch.Tensor]]],
) -> Tuple[float, float]:
    """(max |dw|, max |d state|) over every table."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    dw, ds = 0.0, 0.0
    for name in a:
        dw = max(dw, (a[name][0] - b[name][0]).abs().max().item())
        assert a[name][1].keys() == b[name][1].keys(), (name, sorted(a[name][1]), sorted(b[name][1]))
        for k in a[name][1]:
            ds = max(ds, (a[name][1][k] - b[name][1][k].reshape(a[name][1][k].shape)).abs().max().item())
    return dw, ds


def loss_weights(num_steps: int, width: int, seed: int = 1) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(8, width, generator=gen) for _ in range(num_steps)]


def train_steps(
    model: torch.nn.Module,
    batches: Sequence[KeyedJaggedTensor],
    weights: Sequence[torch.Tensor],
    plans: Optional[Sequence[BatchPlan]] = None,
    staged: bool = False,
) -> Iterator[torch.Tensor]:
    """One step per batch: (apply plan, remap), forward, loss = sum(out * w_t), backward. Yields outputs."""
    for step, kjt in enumerate(batches):
        if plans is not None:
            assert isinstance(model, CachedEmbeddingBagCollection)
            plan = plans[step]
            model.apply_plan(plan, model.stage(plan) if staged else None)
            kjt = model.remap(kjt, plan)
        out = model(kjt).values()
        (out * weights[step]).sum().backward()
        yield out.detach().clone()
