"""FAE inside the lookahead cache: pinned hot rows, the oracle planning the cold batches alone.

Anchors: cached FAE training equals resident training of the same hot/cold stream bit for bit (SGD, row-wise
Adagrad, Adagrad; the whole default job in the slow test); the hot rows sit in their pinned slots and hot
batches move no rows; mid-epoch resume equals the uninterrupted run; the cold batches read ahead are the ones
the training order serves, whatever the interleaving; bad input is refused before training.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch
from torchrec import KeyedJaggedTensor
from torchrec.datasets.utils import Batch

from torchrec_lookahead.callbacks import HotColdScheduler
from torchrec_lookahead.data import CriteoSyntheticDataModule, LookaheadDataModule
from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
from torchrec_lookahead.errors import CapacityError, ConfigError, DataError, InvalidIdError
from torchrec_lookahead.fae import BatchKind, HotColdDataModule, HotColdStream, PinnedRows
from torchrec_lookahead.fae.lookahead import ColdBatches, HotColdLookaheadLoader
from torchrec_lookahead.oracle.types import BatchPlan, TablePlan
from torchrec_lookahead.strategies import TorchRecStrategy
from torchrec_lookahead.verify import verify

from ..conftest import REPO, tiny_data_args
from ..helpers import _trainer, check_mid_epoch_resume, make_model

FAE = dict(hot_budget_bytes=40_000, sample_fraction=0.5, small_table_bytes=1024, num_chunks=4, chunk_rows=16)
CAPACITY = {"t_cat_2": 200, "t_cat_11": 160, "t_cat_15": 150}
TINY = str(REPO / "configs" / "dlrm_tiny_fae_lookahead.yaml")
_E = torch.empty(0, dtype=torch.int64)


def test_pinned_rows_map_hot_ids_to_their_slots_and_plan_the_rest() -> None:
    pins = PinnedRows({"t": torch.tensor([3, 7, 9])}, {"f": "t", "g": "t"}, {"t": 6}, {"t": 50})
    assert pins.pinned_rows == {"t": 3} and pins.dynamic_capacity() == {"t": 3}
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["f", "g"], torch.tensor([7, 40, 3, 41, 9, 40]), torch.tensor([2, 1, 2, 1])
    )
    cold = pins.cold_part(kjt)
    assert cold.values().tolist() == [40, 41, 40] and cold.lengths().tolist() == [1, 0, 1, 1]
    plan = BatchPlan(
        4, {"t": TablePlan(_E, _E, torch.tensor([40, 41]), torch.tensor([0, 2]), torch.tensor([0, 2, 0]))}
    )
    lifted = pins.lift(plan, kjt).tables["t"]
    assert lifted.fetch_slots.tolist() == [3, 5] and lifted.slots.tolist() == [1, 3, 0, 5, 2, 3]
    pin = pins.pin_plan().tables["t"]
    assert pin.fetch_ids.tolist() == [3, 7, 9] and pin.fetch_slots.tolist() == [0, 1, 2]
    hot = KeyedJaggedTensor.from_lengths_sync(["f", "g"], torch.tensor([9, 3, 7]), torch.tensor([1, 1, 1, 0]))
    assert pins.hot_plan(hot, 0).tables["t"].slots.tolist() == [2, 0, 1]
    with pytest.raises(DataError, match="id 40 of table 't', which is not a hot row"):
        pins.hot_plan(kjt, 0)


def test_pinned_rows_refuse_bad_input() -> None:
    with pytest.raises(CapacityError, match="pins 3 hot rows in a cache of 3 rows"):
        PinnedRows({"t": torch.tensor([1, 2, 3])}, {"f": "t"}, {"t": 3}, {"t": 50})
    with pytest.raises(InvalidIdError, match="hot id 50 of table 't' is outside"):
        PinnedRows({"t": torch.tensor([1, 50])}, {"f": "t"}, {"t": 8}, {"t": 50})
    with pytest.raises(ConfigError, match="sorted and unique"):
        PinnedRows({"t": torch.tensor([4, 2])}, {"f": "t"}, {"t": 8}, {"t": 50})


def _source(n: int = 30, rows: int = 6) -> Any:
    def src() -> Any:
        g = torch.Generator().manual_seed(3)
        for _ in range(n):
            ids = torch.randint(0, 6, (rows * 2,), generator=g)
            kjt = KeyedJaggedTensor(["a", "b"], ids, lengths=torch.ones(rows * 2, dtype=torch.int32))
            yield Batch(torch.randn(rows, 2, generator=g), kjt, torch.arange(rows, dtype=torch.float32))

    return src


def test_cold_batches_are_the_training_orders_whatever_the_interleaving() -> None:
    masks = {k: torch.tensor([True, True, True, False, False, False]) for k in "ab"}
    src = _source()
    from torchrec_lookahead.fae.stream import count_hot_samples

    num = count_hot_samples(src(), masks)
    for seed in range(3):
        stream = HotColdStream(src, masks, batch_size=4, window=3, num_samples=num)
        rng = random.Random(seed)
        served: List[Batch] = []
        it = iter(stream)
        while True:
            stream.request(rng.choice([BatchKind.HOT, BatchKind.COLD, None]))
            nxt = next(it, None)
            if nxt is None:
                break
            if nxt[0] is BatchKind.COLD:
                served.append(nxt[1])
        ahead = list(ColdBatches(stream))
        assert len(ahead) == len(served) == len(ColdBatches(stream)) > 3
        for a, b in zip(ahead, served):
            assert torch.equal(a.sparse_features.values(), b.sparse_features.values())
            assert torch.equal(a.dense_features, b.dense_features)
        resumed = ColdBatches(stream)
        resumed.load_state_dict({"batches_yielded": 2})
        assert [b.sparse_features.values().tolist() for b in resumed] == [
            b.sparse_features.values().tolist() for b in ahead[2:]
        ]


def _fit(
    tmp_path: Path,
    max_steps: int,
    cached: bool = True,
    ckpt_path: Optional[str] = None,
    callbacks: Optional[List[Any]] = None,
    capacity: Optional[Dict[str, int]] = None,
    recalibrate: Optional[str] = None,
    strategy_args: Optional[Dict[str, Any]] = None,
    **kw: Any,
) -> Any:
    import lightning.pytorch as pl

    pl.seed_everything(0, verbose=False)
    inner = CriteoSyntheticDataModule(**tiny_data_args())
    dm: Any = HotColdDataModule(inner, **FAE, recalibrate=recalibrate)
    if cached:
        dm = LookaheadDataModule(dm, horizon=8)
        strategy: Any = TorchRecStrategy(
            sharders=[LookaheadEmbeddingBagCollectionSharder(capacity=capacity or CAPACITY)],
            **(strategy_args or {}),
        )
    else:
        strategy = TorchRecStrategy()
    model = make_model(inner)
    sched = HotColdScheduler(initial_rate=50.0, patience=1)
    trainer = _trainer(
        tmp_path,
        max_steps,
        [sched, *(callbacks or [])],
        strategy=strategy,
        limit_val_batches=2,
        val_check_interval=3,
        **kw,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return trainer, model, sched, dm


def test_hot_rows_stay_pinned_and_hot_batches_move_nothing(tmp_path: Path) -> None:
    trainer, model, sched, dm = _fit(tmp_path, max_steps=-1, max_epochs=1)
    loader = dm.loader
    assert isinstance(loader, HotColdLookaheadLoader)
    per = loader.batches_per_epoch()
    assert sched.trained == per and loader.session.stats().hot_batches == per[BatchKind.HOT] > 0
    cache = trainer.strategy.cached_modules()[0].cache
    stats = cache.stats()
    slots = loader.pinned.pinned_slots
    for table, hot in loader.pinned.hot_ids.items():
        first, n = slots[table]
        assert torch.equal(cache.slot_ids(table)[first : first + n], hot)  # never evicted
        # Rows moved: the pinned rows once, then only cold ids (a hot id is never fetched again).
        assert stats[table]["rows_fetched"] >= hot.numel()
    assert trainer.global_step == sum(per.values())
    # The planner's cold pass and the training order shared one read of the source batches.
    source_batches = tiny_data_args()["num_train_batches"]
    assert loader.shared_read is not None and loader.shared_read.detached == 0
    assert loader.shared_read.source_reads == source_batches


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad"])
def test_fae_cached_equals_resident_on_the_same_stream(optimizer: str) -> None:
    out = verify(TINY, steps=30, overrides=[f"--model.init_args.embedding_optimizer.name={optimizer}"])
    assert out["passed"] and out["max_abs_weight_diff"] == 0.0 and out["max_abs_loss_diff"] == 0.0, out
    assert out["steps"] == 30


def test_fae_cached_under_ttl_equals_resident_with_the_cold_batches_planned_by_the_pre_scan(
    monkeypatch,
) -> None:
    """Under ``ttl`` the epoch's check plans the cold batches with the loader's own oracle (its need exceeds a
    window's): the pinned path runs it too, on the dynamic capacities."""
    from torchrec_lookahead.fae import lookahead as fae_lookahead

    seen: List[Any] = []
    prescan = fae_lookahead.prescan

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("oracle_fields"))
        return prescan(*args, **kwargs)

    monkeypatch.setattr(fae_lookahead, "prescan", recording)
    out = verify(TINY, steps=12, overrides=["--data.init_args.policy=ttl"])
    assert out["passed"] and out["max_abs_weight_diff"] == 0.0 and out["steps"] == 12, out
    assert seen and seen[0]["policy"] == "ttl" and seen[0]["capacity"]["t_cat_2"] < 200, seen


def test_a_training_order_left_behind_the_shared_read_reads_on_its_own_and_stays_exact(monkeypatch) -> None:
    import torchrec_lookahead.fae.lookahead as module

    reads: List[Any] = []

    class Recorded(module.SharedRead):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            reads.append(self)

    monkeypatch.setattr(module, "SharedRead", Recorded)
    monkeypatch.setattr(HotColdLookaheadLoader, "share_bound", lambda self: 1)
    out = verify(TINY, steps=12)
    assert out["passed"] and out["max_abs_weight_diff"] == 0.0 and out["steps"] == 12, out
    assert reads and all(r.detached == 1 for r in reads)


def test_mid_epoch_resume_equals_uninterrupted(tmp_path: Path) -> None:
    """Checkpoints at steps 4 and 8 of the 12-step epoch keep the cached tables, pinned rows flushed into them, as
    chains (``incremental_ram_stores``, written in the background): step 4's full pieces, step 8's deltas over
    them. Resumed from either, the run ends at step 12 with the uninterrupted run's weights, bit for bit."""
    from torchrec_lookahead.strategies._checkpoint import read_chain

    chains = dict(incremental_ram_stores=True, full_checkpoint_every=4, async_checkpoints=True)
    ckpt = check_mid_epoch_resume(_fit, tmp_path, every=4, steps=12, strategy_args=chains)
    for table in CAPACITY:
        assert len(read_chain(ckpt / "epoch=0-step=8.ckpt", 0, f"embedding_bags.{table}")) == 2


def test_a_cache_too_small_for_the_hot_rows_is_refused_before_training(tmp_path: Path) -> None:
    # the three tables share one cache (the pooled layout): its room is the sum of their capacities
    with pytest.raises(CapacityError, match=r"\(the sum of their capacities, 60 rows\) pins .* hot rows"):
        _fit(tmp_path, max_steps=2, capacity={t: 20 for t in CAPACITY})


@pytest.mark.slow
def test_default_fae_job_cached_equals_resident_over_a_full_epoch(tmp_path: Path) -> None:
    """With dropout on the bottom MLP: its masks come from the global stream, which the cached fit keeps."""
    out = verify(
        str(REPO / "configs" / "dlrm_fae.yaml"), steps=300, overrides=["--model.init_args.dropout=0.1"]
    )
    (tmp_path / "verify.json").write_text(json.dumps(out))
    assert out["passed"] and out["max_abs_weight_diff"] == 0.0 and out["steps"] == 300, out


def test_pinned_rows_with_cdlrm_averaging_are_refused_clearly() -> None:
    from torchrec_lookahead.runtime import CacheSession, CacheTarget

    dm = LookaheadDataModule(HotColdDataModule(CriteoSyntheticDataModule(**tiny_data_args()), **FAE))
    target = CacheTarget(CAPACITY, {"cat_2": "t_cat_2"}, {"t_cat_2": 300}, {}, num_ranks=2, average_every=4)
    with pytest.raises(ConfigError, match="Pinned hot rows .* drop average_every"):
        dm._pinned_loader(dm.datamodule, None, CacheSession(target))  # type: ignore[arg-type]


def _budget_override(tmp_path: Path, budget: int) -> str:
    import yaml

    sharder = {
        "class_path": "torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder",
        "init_args": {
            "capacity": None,
            "device_budget_bytes": budget,
            "planner_options": {"horizon": 8, "prefetch_depth": 1, "policy": "belady"},
        },
    }
    strategy = {
        "class_path": "torchrec_lookahead.strategies.TorchRecStrategy",
        "init_args": {"sharders": [sharder]},
    }
    path = tmp_path / "budget.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"strategy": strategy}}))
    return str(path)


def test_budget_planner_splits_the_device_budget_between_pinned_and_dynamic_rows() -> None:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    rows, dim = {"a": 1000, "b": 40}, 4
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=t, embedding_dim=dim, num_embeddings=n, feature_names=[f"f_{t}"])
                for t, n in rows.items()],
        device=torch.device("meta"),
    )  # fmt: skip
    hot = {"a": torch.arange(0, 200, 2), "b": torch.arange(40)}  # b wholly hot
    gen = torch.Generator().manual_seed(0)

    def batches() -> Any:
        for _ in range(20):
            a = torch.cat(
                [torch.randint(0, 200, (48,), generator=gen), torch.randint(200, 1000, (16,), generator=gen)]
            )
            b = torch.randint(0, 40, (64,), generator=gen)
            yield KeyedJaggedTensor(
                ["f_a", "f_b"], torch.cat([a, b]), lengths=torch.ones(128, dtype=torch.int32)
            )

    def plan(budget: int, pinned: Any) -> Dict[str, int]:
        sharder = LookaheadEmbeddingBagCollectionSharder(
            device_budget_bytes=budget,
            planner_options={"horizon": 4, "prefetch_depth": 1, "policy": "belady", "floor_headroom": 1.0},
        )
        sharder.plan_capacity(ebc, list(batches()), pinned=pinned)
        return dict(sharder.capacity)

    bpr = dim * 4 + 4  # weights and row-wise Adagrad's state
    pinned_bytes = (100 + 40) * bpr
    budget = pinned_bytes + 300 * bpr
    caps = plan(budget, hot)
    assert set(caps) == {"a"}  # b is wholly hot: resident
    # the dynamic part is planned over a's cold ids only, with what the pinned rows leave of the budget
    assert 100 < caps["a"] <= 100 + 300
    with pytest.raises(CapacityError, match="pinned hot rows"):
        plan(pinned_bytes, hot)
    # a budget above the pinned rows but below the cold floor: the error speaks of the user's budget, and the
    # total it asks for plans
    small = pinned_bytes + 5 * bpr
    with pytest.raises(CapacityError) as err:
        plan(small, hot)
    msg = str(err.value)
    assert (
        f"device_budget_bytes={small:,} leaves {5 * bpr:,} bytes after the {pinned_bytes:,} bytes" in msg
    ), msg
    enough = int(re.search(r"raise device_budget_bytes to at least ([\d,]+)", msg).group(1).replace(",", ""))
    assert enough > pinned_bytes and plan(enough, hot)["a"] > 100
    with pytest.raises(ConfigError, match="tables \\['c'\\]"):
        plan(budget, {"c": torch.arange(3)})


def test_fae_with_a_device_budget_equals_resident(tmp_path: Path) -> None:
    out = verify(TINY, steps=12, overrides=["--config", _budget_override(tmp_path, 40_000)])
    assert out["passed"] and out["max_abs_weight_diff"] == 0.0 and out["steps"] == 12, out


RECALIBRATE = ["--data.init_args.datamodule.init_args.recalibrate=epoch", "--trainer.max_epochs=3"]


@pytest.mark.slow
def test_fae_cached_with_recalibration_equals_resident_over_epochs() -> None:
    # 3 epochs of the tiny job: the hot set changes after the first (sampled -> exact counts); the cached side
    # writes every row back at the epoch start and pins the new hot rows.
    out = verify(TINY, steps=36, overrides=RECALIBRATE)
    assert out["passed"] and out["max_abs_weight_diff"] == 0.0 and out["max_abs_loss_diff"] == 0.0, out
    assert out["steps"] == 36


@pytest.mark.slow
def test_recalibration_repins_and_resumes_across_the_epoch_boundary(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ..helpers import local_state, max_abs_diff

    steps = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    ends = ModelCheckpoint(dirpath=tmp_path / "ends", filename="end-{epoch}", every_n_epochs=1, save_top_k=-1)
    trainer, full, _, dm = _fit(tmp_path / "full", max_steps=22, recalibrate="epoch", callbacks=[steps, ends])
    inner = dm.datamodule
    first = inner.recalibrations[0]
    assert first["promoted"] > 0 and first["demoted"] > 0
    # The epoch in force pins the recalibrated hot set (a new PinnedRows, with its dynamic capacities).
    loader = dm.loader
    assert isinstance(loader, HotColdLookaheadLoader) and inner.hot_set is not None
    for table, hot in loader.pinned.hot_ids.items():
        assert torch.equal(hot, inner.hot_set.tables[table].hot_ids)
        assert loader.pinned.dynamic_capacity()[table] == CAPACITY[table] - hot.numel()
        cache = trainer.strategy.cached_modules()[0].cache
        first, n = loader.pinned.pinned_slots[table]
        assert torch.equal(cache.slot_ids(table)[first : first + n], hot)
    # Resumed before the boundary (the counts re-read the epoch's prefix), at the epoch end (the next hot set
    # comes from the checkpoint) and after it (the hot set in force does): the same weights bit for bit.
    for ckpt in [*(tmp_path / "ckpt").glob("*step=10.ckpt"), *(tmp_path / "ckpt").glob("*step=20.ckpt")] + [
        tmp_path / "ends" / "end-epoch=0.ckpt"
    ]:
        t, resumed, _, _ = _fit(tmp_path / ckpt.stem, max_steps=22, recalibrate="epoch", ckpt_path=str(ckpt))
        assert t.global_step == 22
        assert max_abs_diff(local_state(full.model), local_state(resumed.model)) == 0.0, ckpt.name


def test_a_recalibrated_hot_set_that_no_longer_fits_its_cache_is_refused(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    class Grow(pl.Callback):  # the next hot set pins every slot of the tables' shared cache
        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            nxt = trainer.datamodule.datamodule.next_hot_set
            for table, cap in CAPACITY.items():
                nxt.tables[table].hot_ids = torch.arange(cap, dtype=torch.int64)

    steps: List[int] = []

    class Steps(pl.Callback):
        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            steps.append(trainer.global_step)

    with pytest.raises(CapacityError, match=r"\(the sum of their capacities, 510 rows\) pins 510 hot rows"):
        _fit(tmp_path, max_steps=-1, max_epochs=2, recalibrate="epoch", callbacks=[Grow(), Steps()])
    assert len(steps) == 1  # refused when the next epoch's loader is built, before it trains
