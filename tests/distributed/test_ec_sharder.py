"""EmbeddingCollection tables through the lookahead cache in a plain DistributedModelParallel loop, against
TorchRec's resident EmbeddingCollection with its fused optimizer."""

from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import Topology
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from torchrec_lookahead import ConfigError
from torchrec_lookahead.distributed import (
    LookaheadEmbeddingBagCollectionSharder,
    LookaheadEmbeddingCollectionSharder,
    ShardedLookaheadEmbeddingCollection,
    lookahead_sharding_plan,
    with_default_sharders,
)
from torchrec_lookahead.modules import init_embedding_bag_tables_
from torchrec_lookahead.oracle import LookaheadOracle

from ..conftest import REPO, free_port
from ..helpers import small_sequence_config

# a table read by two features, two cached tables, a resident one beside them (TorchRec's EC: one dimension)
TABLES = [
    EmbeddingConfig(name="item", embedding_dim=8, num_embeddings=400, feature_names=["history", "target"]),
    EmbeddingConfig(name="cats", embedding_dim=8, num_embeddings=60, feature_names=["cat_history"]),
    EmbeddingConfig(name="users", embedding_dim=8, num_embeddings=30, feature_names=["user"]),
]
FEATURES = ["history", "target", "cat_history", "user"]
CAPACITY = {"item": 96, "cats": 40}
SEED = 5


class _SeqModel(torch.nn.Module):
    """Mean of the history's embeddings, dot target, plus a linear term: the EC's output feeds dense layers."""

    def __init__(self) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(tables=TABLES, device=torch.device("meta"))
        self.proj = torch.nn.Linear(8, 8)
        g = torch.Generator().manual_seed(0)  # the same dense weights in every model (on CPU: DMP keeps them)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(8, 8, generator=g))
            self.proj.bias.copy_(torch.randn(8, generator=g))

    def forward(self, kjt: KeyedJaggedTensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        out = self.ec(kjt)
        hist = out["history"]
        b = hist.lengths().numel()
        seg = torch.repeat_interleave(torch.arange(b), hist.lengths())
        pooled = torch.zeros(b, 8).index_add_(0, seg, hist.values()) / hist.lengths().clamp(min=1).unsqueeze(
            1
        )
        cats = torch.zeros(b, 8).index_add_(
            0,
            torch.repeat_interleave(torch.arange(b), out["cat_history"].lengths()),
            out["cat_history"].values(),
        )
        logit = (pooled * out["target"].values()).sum(1) + (self.proj(cats) * out["user"].values()).sum(1)
        return logit, {k: v.values() for k, v in out.items()}


def _batches(n: int = 12, b: int = 16) -> List[KeyedJaggedTensor]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        hist_len = torch.randint(0, 6, (b,), generator=g)
        cat_len = torch.randint(0, 4, (b,), generator=g)
        hist = (torch.randint(0, 20, (int(hist_len.sum()),), generator=g) ** 2) % 400  # skewed, repeating ids
        values = [hist, torch.randint(0, 400, (b,), generator=g)]
        values += [
            torch.randint(0, 60, (int(cat_len.sum()),), generator=g),
            torch.randint(0, 30, (b,), generator=g),
        ]
        lengths = torch.cat(
            [hist_len, torch.ones(b, dtype=torch.long), cat_len, torch.ones(b, dtype=torch.long)]
        )
        out.append(KeyedJaggedTensor(keys=FEATURES, values=torch.cat(values), lengths=lengths))
    return out


def _pg() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def _model(optim: type, lr: float) -> _SeqModel:
    model = _SeqModel()
    apply_optimizer_in_backward(optim, model.ec.embeddings.parameters(), {"lr": lr})
    return model


def _train(model: torch.nn.Module, dmp: DistributedModelParallel, cached: bool) -> Tuple[List, Dict]:
    dense = torch.optim.SGD(dict(dmp.named_parameters()).values(), lr=0.05)
    batches = _batches()
    plans = iter([None] * len(batches))
    sharded = dmp.module.ec
    if cached:
        plans = iter(LookaheadOracle(sharded.cache.oracle_config(horizon=3)).plan_stream(batches))
    outputs = []
    for kjt, plan in zip(batches, plans):
        if cached:
            sharded.apply_plan(plan)
            kjt = sharded.cache.remap(kjt, plan)
        logit, embs = dmp(kjt)
        outputs.append({k: v.detach().clone() for k, v in embs.items()})
        loss = torch.nn.functional.softplus(logit).mean()
        dense.zero_grad()
        loss.backward()
        dense.step()
    if cached:
        sharded.flush()
        tables = {n: s.full_weights() for n, s in sharded.cache.stores.items()}
        tables["users"] = sharded.resident.state_dict()["embeddings.users.weight"].local_shards()[0].tensor
    else:
        state = sharded.state_dict()
        tables = {c.name: state[f"embeddings.{c.name}.weight"].local_shards()[0].tensor for c in TABLES}
    tables["proj"] = dmp.module.proj.weight.detach()
    return outputs, tables


@pytest.mark.parametrize(("optim", "lr"), [(torch.optim.SGD, 0.3), (RowWiseAdagrad, 0.2)])
def test_plain_dmp_loop_with_cached_embedding_collection_equals_resident_torchrec(optim, lr):
    _pg()
    # resident: TorchRec's EmbeddingCollection sharded by DMP with its default sharders and fused optimizer
    resident_model = _model(optim, lr)
    resident = DistributedModelParallel(resident_model, device=torch.device("cpu"))
    init_embedding_bag_tables_(resident, TABLES, seed=SEED)
    # cached: the lookahead EBC sharder (its EC sibling comes with it) and a plan with cached tables
    cached_model = _model(optim, lr)
    sharders = with_default_sharders([LookaheadEmbeddingBagCollectionSharder(capacity=CAPACITY, seed=SEED)])
    plan = lookahead_sharding_plan(
        cached_model, sharders, CAPACITY, Topology(world_size=1, compute_device="cpu")
    )
    cached = DistributedModelParallel(cached_model, device=torch.device("cpu"), sharders=sharders, plan=plan)
    assert isinstance(cached.module.ec, ShardedLookaheadEmbeddingCollection)
    assert sorted(cached.module.ec.cached_tables) == ["cats", "item"]
    init_embedding_bag_tables_(cached, [TABLES[2]], seed=SEED)

    out_r, tables_r = _train(resident_model, resident, cached=False)
    out_c, tables_c = _train(cached_model, cached, cached=True)
    for step, (a, b) in enumerate(zip(out_r, out_c)):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (step, k)
    assert tables_r.keys() == tables_c.keys()
    for k in tables_r:
        assert (tables_r[k] - tables_c[k]).abs().max().item() == 0.0, k
    assert (tables_r["item"] - cached.module.ec.cache.stores["item"].full_weights()).abs().max() == 0.0
    # evaluation reads ids (not slots) from the stores: the resident model's outputs
    resident.eval()
    cached.eval()
    with torch.no_grad():
        for kjt in _batches(n=2):
            (logit_r, embs_r), (logit_c, embs_c) = resident(kjt), cached(kjt)
            assert torch.equal(logit_r, logit_c) and all(torch.equal(embs_r[k], embs_c[k]) for k in embs_r)
    # the cache did move rows: fewer slots than the ids it served
    stats = cached.module.ec.cache.stats()
    assert stats["item"]["rows_fetched"] > CAPACITY["item"] and stats["item"]["rows_written_back"] > 0


def test_ec_sharder_shares_its_source_configuration_and_refuses_what_it_cannot_cache():
    source = LookaheadEmbeddingBagCollectionSharder(capacity={"item": 8})
    sharder = LookaheadEmbeddingCollectionSharder(source)
    assert sharder.capacity is source.capacity
    assert LookaheadEmbeddingCollectionSharder(capacity={"x": 4}).capacity == {"x": 4}
    with pytest.raises(ConfigError, match="not both"):
        LookaheadEmbeddingCollectionSharder(source, capacity={"x": 4})
    # an explicit EC sharder is kept; a lookahead EBC sharder brings one otherwise
    given = with_default_sharders([source, sharder])
    assert sum(isinstance(s, LookaheadEmbeddingCollectionSharder) for s in given) == 1


def test_plan_names_embedding_collection_tables_and_need_indices_is_refused():
    _pg()
    model = _model(torch.optim.SGD, 0.1)
    sharders = with_default_sharders([LookaheadEmbeddingBagCollectionSharder(capacity=CAPACITY)])
    topology = Topology(world_size=1, compute_device="cpu")
    plan = lookahead_sharding_plan(model, sharders, CAPACITY, topology)
    assert plan.plan["ec"]["item"].compute_kernel == "customized_kernel"
    assert plan.plan["ec"]["users"].compute_kernel == "fused"
    with pytest.raises(ConfigError, match=r"Unknown table\(s\) \['nope'\]"):
        lookahead_sharding_plan(model, sharders, {"nope": 3}, topology)
    ec = EmbeddingCollection(tables=TABLES, device=torch.device("meta"), need_indices=True)
    apply_optimizer_in_backward(torch.optim.SGD, ec.embeddings.parameters(), {"lr": 0.1})
    plan = lookahead_sharding_plan(ec, sharders, CAPACITY, topology)
    with pytest.raises(ConfigError, match="need_indices"):
        DistributedModelParallel(ec, device=torch.device("cpu"), sharders=sharders, plan=plan)


@pytest.fixture(scope="module")
def sequence_two_rank_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Dict[str, Dict[str, Any]]:
    """The sequence model's 2-rank ``verify`` comparisons, one per optimizer, in one torchrun launch."""
    from ..verify_runs import launch, selected

    tmp = tmp_path_factory.mktemp("ec_two_ranks")
    config = [
        str(REPO / "configs" / "movielens_sequence_lookahead.yaml"),
        str(small_sequence_config(tmp, devices=2, rows=1500)),
    ]
    runs = [
        {"name": f"test_two_rank_cached_sequence_model_equals_torchrec_two_rank_training[{optimizer}]",
         "config": config, "steps": 16, "overrides": [f"--model.init_args.embedding_optimizer.name={optimizer}"]}
        for optimizer in ("sgd", "rowwise_adagrad")
    ]  # fmt: skip
    return launch(tmp, selected(request, runs))[0]


@pytest.mark.distributed
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_two_rank_cached_sequence_model_equals_torchrec_two_rank_training(
    request: pytest.FixtureRequest, sequence_two_rank_results: Dict[str, Dict[str, Any]], optimizer: str
) -> None:
    """torchrun verify: the EC and EBC caches on 2 ranks (LRPP, delayed sync) against TorchRec's own 2-rank DMP
    training of the resident sequence model."""
    result = sequence_two_rank_results[request.node.name]
    assert result["passed"] and result["max_abs_weight_diff"] == 0.0 and result["steps"] == 16, result
