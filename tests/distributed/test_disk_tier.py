"""The sharder's ``store="disk"``: options refused clearly, and training over disk stores with a small host tier
equal to resident TorchRec training (one process: a whole epoch of the default job under both host policies;
under torchrun, 2 ranks and kill -9 then resume: ``test_disk_tier_torchrun.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Tuple, Union

import lightning.pytorch as pl
import pytest
import torch

from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
from torchrec_lookahead.errors import CapacityError, ConfigError
from torchrec_lookahead.store import DiskStore

from ..conftest import TINY_TABLES, tiny_data_args
from ..helpers import fit_cached

TINY_CAPACITY = "{t_cat_2: 140, t_cat_11: 120, t_cat_15: 110}"


def disk_sharder(
    store_dir: Path, budget: Union[int, str], capacity: str = TINY_CAPACITY, extra: str = ""
) -> str:
    """The CLI override that swaps the config's sharder for one over disk stores (``budget``: bytes, or a
    ``{table: bytes}`` mapping in YAML)."""
    return (
        "--trainer.strategy.init_args.sharders=[{class_path: torchrec_lookahead.distributed."
        f"LookaheadEmbeddingBagCollectionSharder, init_args: {{capacity: {capacity}, store: disk, "
        f"store_dir: {store_dir}, host_budget_bytes: {budget}{extra}}}}}]"
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"store": "ssd"}, "store must be one of"),
        ({"store": "disk"}, "needs host_budget_bytes"),
        ({"store": "disk", "host_budget_bytes": 0}, "must be positive"),
        ({"host_budget_bytes": 1000}, "are for store='disk'"),
        ({"store": "mmap"}, "needs store_dir"),
        ({"store": "ram", "store_dir": "/tmp"}, "keeps no files"),
        (
            {"store": "disk", "host_budget_bytes": 1000, "disk_options": {"o_direct": True}},
            "not \\['o_direct'\\]",
        ),
    ],
)
def test_bad_store_options_are_refused(kwargs: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        LookaheadEmbeddingBagCollectionSharder(capacity={"t": 10}, **kwargs)


def test_host_budget_is_split_by_table_bytes_and_a_share_below_one_row_is_refused(tmp_path: Path) -> None:
    from torchrec import EmbeddingBagConfig

    from torchrec_lookahead.modules import CacheOptimizerConfig

    sharder = LookaheadEmbeddingBagCollectionSharder(
        capacity={"a": 10, "b": 10}, store="disk", store_dir=str(tmp_path), host_budget_bytes=30_000
    )
    cfgs = [
        EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=3000, feature_names=["fa"]),
        EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=1000, feature_names=["fb"]),
    ]
    opt = CacheOptimizerConfig("exact_row_wise_adagrad")
    stores = sharder.cache_stores(cfgs, opt, _one_rank())
    assert {k: type(s) for k, s in stores.items()} == {"a": DiskStore, "b": DiskStore}
    assert [s.host_budget_bytes for s in stores.values()] == [22_500, 7_500]  # type: ignore[attr-defined]
    for s in stores.values():
        s.close()  # type: ignore[attr-defined]
    tiny = LookaheadEmbeddingBagCollectionSharder(
        capacity={"a": 10, "b": 10}, store="disk", store_dir=str(tmp_path), host_budget_bytes=50
    )
    with pytest.raises(
        CapacityError, match="table 'b' gets 12 bytes .* below one row \\(20 bytes\\)"
    ) as info:
        tiny.cache_stores(cfgs, opt, _one_rank())
    assert "raise host_budget_bytes to at least 80 " in str(info.value)  # b's quarter of 80 is its one row
    enough = LookaheadEmbeddingBagCollectionSharder(
        capacity={"a": 10, "b": 10}, store="disk", store_dir=str(tmp_path / "80"), host_budget_bytes=80
    )
    for s in enough.cache_stores(cfgs, opt, _one_rank()).values():
        s.close()  # type: ignore[attr-defined]


ROW_BYTES = 36  # embedding_dim 8 and row-wise Adagrad's one state column, float32
DISK_DATA = {"num_embeddings": [4000 if i == 2 else n for i, n in enumerate(TINY_TABLES)], "batch_size": 256}


def _host_need(depth: int) -> Tuple[int, int]:
    """Naive reference: the most distinct ids of table ``t_cat_2`` any window of the epoch (a batch and the
    ``depth`` before it) reads, and the last batch of the first window that reads that many."""
    from torchrec_lookahead.data import CriteoSyntheticDataModule

    dm = CriteoSyntheticDataModule(**tiny_data_args(**DISK_DATA))
    dm.setup("fit")
    batches = [set(b.sparse_features["cat_2"].values().tolist()) for b in dm.train_dataloader()]
    needs = [len(set().union(*batches[max(i - depth, 0) : i + 1])) for i in range(len(batches))]
    return max(needs), needs.index(max(needs))


class _Steps(pl.Callback):
    """The training steps started."""

    def __init__(self) -> None:
        self.started: List[int] = []

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        self.started.append(trainer.global_step)


def _fit_over_disk(path: Path, budget_rows: int, steps: _Steps, disk: Any = None, **lookahead: Any) -> Any:
    sharder = {
        "store": "disk",
        "store_dir": str(path / "stores"),
        "host_budget_bytes": budget_rows * ROW_BYTES,
    }
    if disk:
        sharder["disk_options"] = disk
    return fit_cached(path, 12, capacity={"t_cat_2": 600}, data=DISK_DATA, sharder_kw=sharder,
                      lookahead_kw=lookahead, callbacks=[steps])  # fmt: skip


@pytest.mark.parametrize("depth", [0, 2])
def test_a_host_budget_below_one_window_is_refused_before_training_and_one_at_it_trains(
    tmp_path: Path, depth: int
) -> None:
    """One step's rows under the LRU host policy, a step's and the next ``disk_prefetch_depth`` steps' under the
    lookahead policy: one row fewer is refused by the pre-scan before the first step, naming the host tier, the
    table, the window and the rows; exactly that many trains."""
    need, batch = _host_need(depth)
    disk = {"host_policy": "lookahead", "disk_prefetch_depth": depth} if depth else None
    steps = _Steps()
    with pytest.raises(CapacityError, match="rows in the host tier of its disk store but it holds") as info:
        _fit_over_disk(tmp_path / "short", need - 1, steps, disk)
    facts = {"table": "t_cat_2", "batch": batch, "needed": need, "available": need - 1, "tier": "host"}
    assert info.value.facts == facts and steps.started == []
    assert f"one int for all tables: host_budget_bytes >= {need * ROW_BYTES:,}" in str(
        info.value
    )  # one table
    assert 100 < need < 4000 // 4
    steps = _Steps()
    trainer, _ = _fit_over_disk(tmp_path / "exact", need, steps, disk)
    assert trainer.global_step == 12 and steps.started == list(range(12))


def test_a_host_window_beyond_a_bounded_pre_scan_is_refused_by_the_planner_before_it_is_trained(
    tmp_path: Path,
) -> None:
    """The pre-scan reads one batch (which fits); the planner thread checks every window as it reads the
    batches, ``horizon`` batches ahead of training, and refuses the first that does not fit before any step."""
    first, _ = _host_need(0)
    need, _ = _host_need(2)
    disk = {"host_policy": "lookahead", "disk_prefetch_depth": 2}
    steps = _Steps()
    with pytest.raises(CapacityError, match="disk_prefetch_depth=2") as info:
        _fit_over_disk(tmp_path, need - 1, steps, disk, capacity_check_batches=1)
    assert (info.value.tier, info.value.needed, info.value.available) == ("host", need, need - 1)
    assert steps.started == []  # the window's batches are within the oracle's horizon of the first step
    assert first < need - 1
    for check in ({"capacity_check": "lookahead"}, {"capacity_check_batches": 1}):
        with pytest.raises(CapacityError, match="host tier") as info:
            _fit_over_disk(tmp_path / "lead", first, _Steps(), disk, **check)
        # every batch alone fits (the pre-scan's one batch too); batches 0..1 together do not
        assert info.value.batch == 1 and info.value.available == first


def _one_rank() -> Any:
    from torchrec.distributed.types import ShardingEnv

    return ShardingEnv(world_size=1, rank=0, pg=None)


@pytest.fixture
def disk_stores(monkeypatch: pytest.MonkeyPatch) -> List[DiskStore]:
    """Every DiskStore the sharder creates in this test."""
    made: List[DiskStore] = []

    class Recorded(DiskStore):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr("torchrec_lookahead.distributed._stores.DiskStore", Recorded)
    return made


@pytest.mark.slow
def test_tiny_job_over_disk_stores_equals_resident_training(
    tmp_path: Path, disk_stores: List[DiskStore], shared_resident: None
) -> None:
    from torchrec_lookahead.verify import verify

    # 6,552 bytes: the smallest budget whose shares hold one step's rows of each table (t_cat_15's 42 of 150)
    result = verify("configs/dlrm_tiny_lookahead.yaml", steps=24, overrides=[disk_sharder(tmp_path, 6552)])
    assert result["passed"] and result["max_abs_weight_diff"] == result["max_abs_loss_diff"] == 0.0, result
    assert len(disk_stores) == 3
    for store in disk_stores:
        stats = store.stats()
        assert stats["rows_read"] > 0 and stats["host_rows"] <= stats["host_capacity"] < store.num_embeddings


@pytest.mark.slow
def test_tiny_job_over_lookahead_host_tiers_equals_resident_training(
    tmp_path: Path, disk_stores: List[DiskStore], shared_resident: None
) -> None:
    """The host tiers planned from the lookahead (Belady, rows read 4 steps ahead in the background) change
    where rows are, never their values."""
    from torchrec_lookahead.verify import verify

    extra = ", disk_options: {host_policy: lookahead, disk_prefetch_depth: 4}"
    # 14,976 bytes: the smallest budget whose shares hold five steps' rows (t_cat_15's 96 of 150)
    result = verify(
        "configs/dlrm_tiny_lookahead.yaml", steps=24, overrides=[disk_sharder(tmp_path, 14976, extra=extra)]
    )
    assert result["passed"] and result["max_abs_weight_diff"] == result["max_abs_loss_diff"] == 0.0, result
    assert len(disk_stores) == 3 and all(s.host_policy == "lookahead" for s in disk_stores)
    stats = [s.stats() for s in disk_stores]
    assert all(st["host_rows"] <= st["host_capacity"] for st in stats)
    # rows left the host tiers for the files and were read back (49 of them on an idle machine). How many the
    # background thread read ahead of their gathers depends on its share of the CPU at this size (13 to 15 idle,
    # none once on a loaded one): the whole-epoch test below checks that most are
    assert sum(st["rows_written"] for st in stats) > 0 and sum(st["rows_read"] for st in stats) > 0, stats


def test_bad_host_policy_is_refused() -> None:
    with pytest.raises(ConfigError, match="host_policy must be one of"):
        LookaheadEmbeddingBagCollectionSharder(
            capacity={"t": 10}, store="disk", host_budget_bytes=1000, disk_options={"host_policy": "mru"}
        )


# The smallest host tiers the capacity check accepts for the default job under each policy: one step's rows of
# each table under LRU (1.02 MB split by table bytes: t_cat_3's 986 rows bound it); a step's and the next two
# steps' under lookahead, given per table (874 KB, 3.9 % of the tables).
_DEFAULT_JOB_HOST = {
    "lru": ("1020000", ""),
    "lookahead": (
        "{t_cat_2: 184348, t_cat_3: 155448, t_cat_11: 182444, t_cat_15: 172516, t_cat_20: 179656}",
        ", disk_options: {host_policy: lookahead, disk_prefetch_depth: 2}",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["lru", "lookahead"])
def test_default_job_whole_epoch_over_a_minimal_host_tier_equals_resident_training(
    tmp_path: Path, disk_stores: List[DiskStore], shared_resident: None, policy: str
) -> None:
    """The default job (332 K cached rows, 17.9 K device rows) over disk stores whose host tiers are the smallest
    the capacity check accepts (4.5 % of the tables under LRU, 3.9 % under lookahead): a whole epoch, bit for
    bit, under both host policies. With dropout on the bottom MLP: this is also the one-rank whole-epoch check of
    a model that draws from the global random stream (``tests/test_rng.py``), sharing the epoch's work. Both
    policies are compared with one resident epoch (``shared_resident``)."""
    from torchrec_lookahead.verify import verify

    capacity = "{t_cat_2: 5100, t_cat_3: 2200, t_cat_11: 4200, t_cat_15: 2800, t_cat_20: 3600}"
    budget, extra = _DEFAULT_JOB_HOST[policy]
    overrides = [disk_sharder(tmp_path, budget, capacity, extra=extra), "--model.init_args.dropout=0.1"]
    result = verify("configs/dlrm_lookahead.yaml", steps=300, overrides=overrides)
    assert result["passed"] and result["steps"] == 300, result
    assert result["max_abs_weight_diff"] == result["max_abs_loss_diff"] == 0.0, result
    assert all(s.host_policy == policy for s in disk_stores)
    stats = [s.stats() for s in disk_stores]
    assert sum(st["rows_read"] for st in stats) > 300 * 500  # most steps read from disk
    if policy == "lookahead":
        assert sum(st["rows_prefetched"] for st in stats) > 300 * 500, stats  # most of them read ahead


@pytest.mark.slow
def test_fae_pinned_rows_over_disk_stores_equal_resident_training(
    tmp_path: Path, disk_stores: List[DiskStore]
) -> None:
    """FAE's hot rows pinned in the device caches, the cold rows behind a host tier of a few dozen rows (3,588
    bytes: the smallest whose shares hold one step's cold rows, t_cat_15's 23)."""
    from torchrec_lookahead.verify import verify

    capacity = "{t_cat_2: 200, t_cat_11: 160, t_cat_15: 150}"  # configs/dlrm_tiny_fae_lookahead.yaml's
    result = verify(
        "configs/dlrm_tiny_fae_lookahead.yaml", steps=24, overrides=[disk_sharder(tmp_path, 3588, capacity)]
    )
    assert result["passed"] and result["max_abs_weight_diff"] == result["max_abs_loss_diff"] == 0.0, result
    assert len(disk_stores) == 3 and sum(s.stats()["rows_read"] for s in disk_stores) > 0


@pytest.mark.slow
def test_embedding_collection_over_disk_stores_equals_resident_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, disk_stores: List[DiskStore]
) -> None:
    """The sequence model: its EmbeddingCollection's table is cached over a disk store too."""
    from torchrec_lookahead.verify import verify

    from ..conftest import REPO
    from ..helpers import small_sequence_config

    options = (
        f"capacity: {{t_movie: 400, t_user: 40}}, store: disk, store_dir: {tmp_path}, host_budget_bytes: 4000"
    )
    small = small_sequence_config(tmp_path, options=options)
    monkeypatch.chdir(REPO)
    out = verify([str(REPO / "configs" / "movielens_sequence_lookahead.yaml"), str(small)], steps=12)  # type: ignore[arg-type]
    assert out["passed"] and out["max_abs_weight_diff"] == 0.0 and out["steps"] == 12, out
    assert {s.name for s in disk_stores} >= {"t_movie"}, [s.name for s in disk_stores]


@pytest.mark.slow
def test_a_checkpoint_trained_over_disk_stores_exports_the_tables_the_files_hold(tmp_path: Path) -> None:
    from torchrec_lookahead.export import export_checkpoint
    from torchrec_lookahead.launch import build_cli

    cli = build_cli(["--config", "configs/dlrm_tiny_lookahead.yaml", "--trainer.max_steps=6",
                     "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={tmp_path}",
                     disk_sharder(tmp_path / "stores", 6552)])  # fmt: skip
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    cli.trainer.save_checkpoint(tmp_path / "run.ckpt")
    stores = {n: s for m in cli.trainer.strategy.cached_modules() for n, s in m.cache.stores.items()}
    assert {type(s) for s in stores.values()} == {DiskStore}
    summary = export_checkpoint(tmp_path / "run.ckpt", tmp_path / "served.ckpt")
    assert summary["embedding_tables"] == 26
    served = torch.load(tmp_path / "served.ckpt", weights_only=False)["state_dict"]
    for name, store in stores.items():
        key = next(k for k in served if k.endswith(f"embedding_bags.{name}.weight"))
        rows, _ = store.gather(torch.arange(store.num_embeddings))
        assert torch.equal(served[key], rows), name
