"""Delayed synchronisation on 2 gloo ranks: exact against TorchRec's resident 2-rank training.

Each rank trains the cached collection (LRPP, delayed synchronisation on) on its slice of hand-made global
batches in which ids are read by one rank, by both, needed at the next step or not, and in which shared rows
whose synchronisation is delayed are evicted at the very next step. The reference is TorchRec's own
``DistributedModelParallel`` training of the resident tables (table-wise, FUSED kernel) for SGD, row-wise
Adagrad and Adagrad; for Adam, which FBGEMM has no CPU kernel for, the resident collection trained on the
global batch in one process with TorchRec's gradient division (the sum of the ranks' gradients over W).
Every comparison is bit for bit.
"""

from __future__ import annotations

import datetime
import os
import traceback
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from torchrec_lookahead.distributed.lrpp import LRPPTracker, slice_samples
from torchrec_lookahead.modules import (
    CachedEmbeddingBagCollection,
    CacheOptimizerConfig,
    remap_kjt,
)
from torchrec_lookahead.oracle import LookaheadOracle, table_ids

from ..conftest import free_port, start_method

pytestmark = pytest.mark.beside_launches  # its ranks: torch.multiprocessing, not torchrun

WORLD = 2
STEPS = 10
PER_RANK = 3  # samples per rank
TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=24, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=16, feature_names=["f1"]),
]
CAPACITY = {"t0": 9, "t1": 5}
F2T = {"f0": "t0", "f1": "t1"}
OPTIMIZERS = {
    "sgd": CacheOptimizerConfig("exact_sgd", learning_rate=0.3),
    "rowwise_adagrad": CacheOptimizerConfig("exact_row_wise_adagrad", learning_rate=0.3, eps=1e-8),
    "adagrad": CacheOptimizerConfig("exact_adagrad", learning_rate=0.3, eps=1e-8),
    "adam": CacheOptimizerConfig("adam", learning_rate=0.05, weight_decay=0.01),
}
CHECKPOINT_AT = 4  # state_dict() taken after this step's backward, with its delayed rows still in flight


def global_batches() -> List[KeyedJaggedTensor]:
    """Hand-made global batches (rank r reads samples [3r, 3r + 3)): ids read by both ranks at every step
    (critical), ids read by both ranks every other step (delayed, then read again), a fresh id read by both
    ranks once (delayed, then evicted), ids read by one rank only, and fresh ids that push rows out of the
    small caches."""
    g = torch.Generator().manual_seed(5)
    out = []
    for s in range(STEPS):
        f0 = [
            [1, 2 + s % 2],
            [3 + 2 * s % 9],
            [10 + s],
            [1],
            [2 + s % 2, 5 + s % 3],
            [11 + (s * 7) % 13, 10 + s],
        ]
        f1 = [[0], [1 + s % 3], [int(torch.randint(4, 16, (1,), generator=g))], [0, 1 + s % 3], [2], [3]]
        vals, lens = [], []
        for feat in (f0, f1):
            for sample in feat:
                vals.extend(sample)
                lens.append(len(sample))
        out.append(
            KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor(vals), lengths=torch.tensor(lens))
        )
    return out


def targets() -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return [torch.randn(WORLD * PER_RANK, generator=g) for _ in range(STEPS)]


def local_loss(pooled: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A non-linear loss, so that a stale or late row changes later gradients."""
    return ((pooled.sum(1) - target) ** 2).mean() + pooled.pow(2).sum() * 0.01


def _full_rows(dmp: Any) -> Dict[str, torch.Tensor]:
    """Whole tables of a resident DMP (shards gathered; a collective, complete on rank 0)."""
    out = {}
    for key, value in dmp.state_dict().items():
        if not key.endswith(".weight"):
            continue
        full = torch.zeros(value.size()) if dist.get_rank() == 0 else None
        value.gather(0, full)
        if full is not None:
            out[key.split(".")[-2]] = full
    return out


def _lr(name: str, step: int) -> float:
    """A decaying learning-rate schedule: deferred updates must land with their own step's rate."""
    return OPTIMIZERS[name].learning_rate / (1.0 + 0.25 * step)


def _schedule(optimizer: Any, lr: float) -> None:
    """What an LR scheduler does to a DMP's fused optimizer, then its step() hands the rate to the kernels."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()


def _resident_dmp(name: str, batches: List[KeyedJaggedTensor], tgts: List[torch.Tensor]) -> Dict[str, Any]:
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from torchrec_lookahead.modules import init_embedding_bag_tables_

    cfg = OPTIMIZERS[name]
    ebc = EmbeddingBagCollection(tables=TABLES, device=torch.device("meta"))
    if name == "sgd":
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": cfg.learning_rate})
    elif name == "adagrad":
        apply_optimizer_in_backward(
            torch.optim.Adagrad, ebc.parameters(), {"lr": cfg.learning_rate, "eps": cfg.eps}
        )
    else:
        apply_optimizer_in_backward(
            RowWiseAdagrad, ebc.parameters(), {"lr": cfg.learning_rate, "eps": cfg.eps}
        )
    sharder = EmbeddingBagCollectionSharder()
    constraints = {
        t.name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"]) for t in TABLES
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=WORLD, compute_device="cpu"), constraints=constraints
    )
    plan = planner.collective_plan(ebc, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), sharders=[sharder], plan=plan)
    init_embedding_bag_tables_(dmp, TABLES, seed=0)
    rank = dist.get_rank()
    snapshots = {}
    for step, (kjt, tgt) in enumerate(zip(batches, tgts)):
        _schedule(dmp.fused_optimizer, _lr(name, step))
        lo, hi = rank * PER_RANK, (rank + 1) * PER_RANK
        out = dmp(slice_samples(kjt, lo, hi))
        out = out.wait() if hasattr(out, "wait") else out
        local_loss(out.values(), tgt[lo:hi]).backward()
        if step == CHECKPOINT_AT:
            snapshots["mid"] = _full_rows(dmp)
    snapshots["end"] = _full_rows(dmp)
    return snapshots


def _resident_reference(
    name: str, batches: List[KeyedJaggedTensor], tgts: List[torch.Tensor]
) -> Dict[str, Any]:
    """One process, every table resident (the PyTorch kernel): each step's loss is the ranks' local losses
    summed and divided by W, i.e. TorchRec's gradient division."""
    ebc = CachedEmbeddingBagCollection(TABLES, capacity={}, optimizer=OPTIMIZERS[name], seed=0)
    snapshots = {}
    for step, (kjt, tgt) in enumerate(zip(batches, tgts)):
        ebc.set_learning_rate(_lr(name, step))
        pooled = ebc(kjt).values()  # one lookup: one optimizer iteration per step
        total = torch.zeros(())
        for r in range(WORLD):
            lo, hi = r * PER_RANK, (r + 1) * PER_RANK
            total = total + local_loss(pooled[lo:hi], tgt[lo:hi])
        (total / WORLD).backward()
        if step == CHECKPOINT_AT or step == STEPS - 1:
            snapshots["mid" if step == CHECKPOINT_AT else "end"] = {
                t.name: ebc.cache_weights(t.name).detach().clone() for t in TABLES
            }
    return snapshots


def _cached(
    name: str, batches: List[KeyedJaggedTensor], tgts: List[torch.Tensor], delayed: bool
) -> Tuple[Dict[str, Any], Dict[str, int], Dict[str, int]]:
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import Topology

    from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder, lookahead_sharding_plan

    rank = dist.get_rank()
    sharder = LookaheadEmbeddingBagCollectionSharder(
        capacity=CAPACITY, optimizer=OPTIMIZERS[name], seed=0, delayed_sync=delayed
    )
    ebc = EmbeddingBagCollection(tables=TABLES, device=torch.device("meta"))
    plan = lookahead_sharding_plan(ebc, [sharder], CAPACITY, Topology(world_size=WORLD, compute_device="cpu"))
    dmp = DistributedModelParallel(ebc, device=torch.device("cpu"), sharders=[sharder], plan=plan)
    sharded = dmp.module
    # prefetch_depth 0 (plans applied without staged rows): rows read at step t may be evicted at t + 1
    cache = sharded.cache
    oracle = LookaheadOracle(cache.oracle_config(horizon=2, prefetch_depth=0, num_ranks=WORLD))
    tracker = LRPPTracker({t: cache.cache_rows(t) for t in CAPACITY}, WORLD)
    cached = sorted(CAPACITY)
    snapshots: Dict[str, Any] = {}
    facts = {"evicted_next": 0, "pending_at_checkpoint": 0, "delayed_read_later": 0}
    previous_delayed: Dict[str, set] = {}
    plans = list(oracle.plan_stream(batches))
    for step, (kjt, tgt, step_plan) in enumerate(zip(batches, tgts, plans)):
        lrpp = tracker.step(
            step_plan, table_ids(kjt, F2T, cached), features=remap_kjt(kjt, step_plan, F2T, cached)
        )
        for t in cached:  # the rows delayed at the previous step that this plan evicts / reads
            before = previous_delayed.get(t, set())
            facts["evicted_next"] += len(before & set(step_plan.tables[t].evict_slots.tolist()))
            if step + 1 < STEPS:
                later = set(plans[step + 1].tables[t].slots.tolist())
                facts["delayed_read_later"] += len(before & later)
            previous_delayed[t] = set(lrpp.tables[t].delayed_slots.tolist())
        # The new rate first (as a loop that calls zero_grad() before the step would): the rows delayed at the
        # previous step, which land in apply_plan, must still get that step's rate.
        _schedule(dmp.fused_optimizer, _lr(name, step))
        sharded.apply_plan(step_plan, lrpp=lrpp)
        lo, hi = rank * PER_RANK, (rank + 1) * PER_RANK
        local = slice_samples(remap_kjt(kjt, step_plan, F2T, cached), lo, hi)
        out = dmp(local)
        out = out.wait() if hasattr(out, "wait") else out
        local_loss(out.values(), tgt[lo:hi]).backward()
        if step == CHECKPOINT_AT:
            facts["pending_at_checkpoint"] = len(sharded.step_state.pending)
            state = sharded.state_dict()  # flushes: the pending delayed rows must land first
            snapshots["mid"] = {t: state[f"cache.embedding_bags.{t}.weight"].clone() for t in cached}
    sharded.flush()
    snapshots["end"] = {t: sharded.cache.stores[t].full_weights().clone() for t in cached}
    return snapshots, dict(sharded.sync_counters), facts


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    # A bounded timeout: a failing rank makes its peer's collectives fail instead of hanging the test.
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    result: Dict[str, Any] = {}
    try:
        batches, tgts = global_batches(), targets()
        for name in OPTIMIZERS:
            on, counters_on, facts = _cached(name, batches, tgts, delayed=True)
            off, counters_off, _ = _cached(name, batches, tgts, delayed=False)
            if name == "adam":
                ref = _resident_reference(name, batches, tgts)
            else:
                ref = _resident_dmp(name, batches, tgts)
            result[name] = {"on": on, "off": off, "ref": ref, "counters_on": counters_on,
                            "counters_off": counters_off, "facts": facts}  # fmt: skip
    except BaseException:
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.distributed
def test_delayed_sync_equals_resident_two_rank_training(tmp_path):
    mp.start_processes(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, start_method=start_method())
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for r in results:
        assert "error" not in r, r.get("error")
    for name in OPTIMIZERS:
        res = results[0][name]
        facts, on, off = res["facts"], res["counters_on"], res["counters_off"]
        # the data exercise every kind of row
        assert on["rows_synced_delayed"] > 0 and on["rows_synced_critical"] > on["rows_refreshed"] > 0, on
        assert on["rows_skipped"] > 0, on
        assert facts["evicted_next"] > 0 and facts["delayed_read_later"] > 0, facts
        assert facts["pending_at_checkpoint"] > 0, facts
        # delayed rows leave the critical path; nothing else changes
        assert off["rows_synced_delayed"] == 0
        assert on["rows_synced_critical"] + on["rows_synced_delayed"] == off["rows_synced_critical"]
        assert on["rows_skipped"] == off["rows_skipped"]
        for when in ("mid", "end"):
            for t in CAPACITY:
                ref = res["ref"][when][t]
                for mode in ("on", "off"):
                    # bit for bit: TorchRec's order of accumulation, FBGEMM's kernel (SGD, Adagrad)
                    diff = (res[mode][when][t] - ref).abs().max().item()
                    assert diff == 0.0, (name, mode, when, t, diff)
                    assert (res[mode][when][t] - results[1][name][mode][when][t]).abs().max().item() == 0.0
        # delayed on and off apply the same formula to the same sums: bit for bit equal
        for t in CAPACITY:
            assert torch.equal(res["on"]["end"][t], res["off"]["end"][t]), (name, t)
        assert not np.isnan(sum(v.sum().item() for v in res["ref"]["end"].values()))
