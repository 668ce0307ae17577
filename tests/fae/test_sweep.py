"""FAE's odd but valid combinations: a lookahead DataModule whose model caches no table, every row of a cached table
hot, and the refusals that must name a fix that works."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from torchrec_lookahead.callbacks import HotColdScheduler
from torchrec_lookahead.data import CriteoSyntheticDataModule, LookaheadDataModule
from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
from torchrec_lookahead.errors import CapacityError
from torchrec_lookahead.fae import BatchKind, HotColdDataModule, PinnedRows
from torchrec_lookahead.strategies import TorchRecStrategy

from ..conftest import tiny_data_args
from ..helpers import _trainer, local_state, make_model
from .test_lookahead import FAE, _fit


def _fit_uncached(tmp_path: Path, max_steps: int) -> Any:
    """LookaheadDataModule(HotColdDataModule) with a lookahead sharder that caches no table."""
    pl.seed_everything(0, verbose=False)
    inner = CriteoSyntheticDataModule(**tiny_data_args())
    dm = LookaheadDataModule(HotColdDataModule(inner, **FAE), horizon=8)
    strategy = TorchRecStrategy(sharders=[LookaheadEmbeddingBagCollectionSharder(capacity={})])
    model = make_model(inner)
    sched = HotColdScheduler(initial_rate=50.0, patience=1)
    trainer = _trainer(
        tmp_path, max_steps, [sched], strategy=strategy, limit_val_batches=2, val_check_interval=3
    )
    trainer.fit(model, datamodule=dm)
    return trainer, model, sched, dm


@pytest.mark.filterwarnings("ignore:LookaheadDataModule. the model has no cached tables")
def test_a_lookahead_datamodule_with_no_cached_table_schedules_the_hot_cold_loader(tmp_path: Path) -> None:
    """Every table resident (every row of the cached tables hot: leave them out of capacity, as the refusal says;
    or a budget that caches nothing): the lookahead DataModule passes the hot/cold loader through, and the
    scheduler refused it ("HotColdScheduler needs the hot/cold training loader: wrap the DataModule in
    HotColdDataModule"). It schedules it, and training equals the resident run's bit for bit."""
    trainer, model, sched, dm = _fit_uncached(tmp_path / "uncached", max_steps=12)
    per = dm.datamodule.loader.batches_per_epoch()
    assert trainer.global_step == 12 and sched.trained == per and per[BatchKind.HOT] > 0
    _, resident, _, _ = _fit(tmp_path / "resident", max_steps=12, cached=False)
    a, b = local_state(model.model), local_state(resident.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_wholly_hot_table_is_told_to_stay_resident() -> None:
    """A cache holds at most its table's rows, so "raise the capacity above the hot rows" could not be done."""
    hot = {"a": torch.arange(6), "b": torch.tensor([1])}
    with pytest.raises(CapacityError, match=r"every row of 'a' is hot: leave it out of capacity \(resident"):
        PinnedRows(hot, {"fa": "a", "fb": "b"}, {"a": 6, "b": 1}, {"a": 6, "b": 9}, {"s": ("a", "b")})
    with pytest.raises(CapacityError, match=r"every row of 'a' is hot: leave it out of capacity"):
        PinnedRows({"a": torch.arange(6)}, {"fa": "a"}, {"a": 6}, {"a": 6})
    with pytest.raises(CapacityError, match="raise the capacity"):  # not wholly hot: a larger cache would do
        PinnedRows({"a": torch.arange(6)}, {"fa": "a"}, {"a": 6}, {"a": 9})
    # in a shared cache with room, a wholly hot table trains: its slots come out of the cache's rest
    pins = PinnedRows(hot, {"fa": "a", "fb": "b"}, {"a": 6, "b": 4}, {"a": 6, "b": 9}, {"s": ("a", "b")})
    assert pins.dynamic_capacity() == {"a": 1, "b": 2}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"sample_fraction": "0.5"}, "sample_fraction in"),  # a TypeError of round()
        ({"confidence": "0.9"}, "confidence in"),  # a TypeError of a comparison
        ({"calibration_seed": 1.5}, "seed to be an integer"),  # a RuntimeError of torch.manual_seed
        ({"embedding_dim": 2.5}, "embedding_dim to be a positive integer"),  # accepted: 2.5-wide rows
        ({"small_table_bytes": 1.5}, "small_table_bytes to be an integer"),  # accepted
        ({"hot_set": 3}, "hot_set to be a file path"),  # a TypeError of os.path
    ],
)
def test_bad_calibration_values_are_config_errors_at_construction(kwargs: Any, match: str) -> None:
    from torchrec_lookahead.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        HotColdDataModule(
            CriteoSyntheticDataModule(**tiny_data_args()), **{**FAE, "embedding_dim": 8, **kwargs}
        )


def test_a_hot_set_path_may_be_a_path_object(tmp_path: Path) -> None:
    dm = HotColdDataModule(CriteoSyntheticDataModule(**tiny_data_args()), **FAE, embedding_dim=8,
                           hot_set=tmp_path / "hot.pt")  # fmt: skip
    dm.setup("fit")
    assert (tmp_path / "hot.pt").is_file() and dm.hot_set_path == str(tmp_path / "hot.pt")


def _dm(**kw: Any) -> HotColdDataModule:
    return HotColdDataModule(
        CriteoSyntheticDataModule(**tiny_data_args()), **{**FAE, "embedding_dim": 8, **kw}
    )


def test_a_resume_that_switches_recalibration_checks_the_hot_set_in_force() -> None:
    """A recalibrating run's checkpoint keeps its hot set, not the fingerprint a fixed set's checks: resumed
    without recalibrating (or a fixed set's checkpoint resumed with it), another hot set was taken silently, the
    loader's position counting the other set's hot and cold batches."""
    from torchrec_lookahead.errors import CheckpointError

    recal = _dm(recalibrate="epoch")
    recal.setup("fit")
    same = recal.state_dict()  # the first epoch's hot set: the calibrated one, as a fixed run's
    assert recal.hot_set is not None
    recal.hot_set.tables["t_cat_2"].hot_ids = recal.hot_set.tables["t_cat_2"].hot_ids[:-1]  # recalibrated
    moved = recal.state_dict()
    fixed = _dm()
    fixed.load_state_dict(same)
    fixed.setup("fit")
    fixed = _dm()
    fixed.load_state_dict(moved)
    with pytest.raises(CheckpointError, match="another hot set than this run's .* recalibrate"):
        fixed.setup("fit")
    # a fixed set's checkpoint resumed with recalibration: its fingerprint is checked too
    trained = _dm(hot_budget_bytes=30_000)
    trained.setup("fit")
    resumed = _dm(recalibrate="epoch")
    resumed.load_state_dict(trained.state_dict())
    with pytest.raises(CheckpointError, match="another hot set"):
        resumed.setup("fit")
    resumed = _dm(recalibrate="epoch", hot_budget_bytes=30_000)
    resumed.load_state_dict(trained.state_dict())
    resumed.setup("fit")


def test_per_id_weights_travel_with_their_ids_through_the_regrouping() -> None:
    """A weighted collection's batches (per-id weights in the KeyedJaggedTensor) lost their weights when FAE
    regrouped them: every hot and cold batch came out unweighted, silently."""
    from torchrec import KeyedJaggedTensor
    from torchrec.datasets.utils import Batch

    from torchrec_lookahead.errors import DataError
    from torchrec_lookahead.fae import HotColdStream, Samples
    from torchrec_lookahead.fae.stream import count_hot_samples

    def source() -> Any:
        g = torch.Generator().manual_seed(1)
        for _ in range(6):
            ids = torch.randint(0, 6, (12,), generator=g)
            kjt = KeyedJaggedTensor(["a", "b"], ids, lengths=torch.tensor([1, 2, 0, 1, 1, 1] * 2, dtype=torch.int32),
                                    weights=ids.to(torch.float32) * 10 + 0.5)  # fmt: skip
            yield Batch(torch.randn(6, 2, generator=g), kjt, torch.arange(6, dtype=torch.float32))

    masks = {k: torch.tensor([True, True, True, False, False, False]) for k in "ab"}
    stream = HotColdStream(
        source, masks, batch_size=4, window=3, num_samples=count_hot_samples(source(), masks)
    )
    served = [b.sparse_features for _, b in stream]
    assert served and all(kjt.weights_or_none() is not None for kjt in served)
    for kjt in served:  # each weight still belongs to its id
        assert torch.equal(kjt.weights(), kjt.values().to(torch.float32) * 10 + 0.5)
    # the ranks' all-gathered slices keep them too
    s = Samples.of(next(iter(source())))
    joined = s.joined([s.tensors(), s.select(torch.tensor([True, False] * 3)).tensors()])
    assert joined.weights is not None and torch.equal(
        joined.batch().sparse_features.weights(),
        joined.batch().sparse_features.values().to(torch.float32) * 10 + 0.5,
    )
    unweighted = Samples.of(Batch(torch.zeros(1, 2), KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2]),
                                  lengths=torch.tensor([1, 1])), torch.zeros(1)))  # fmt: skip
    with pytest.raises(DataError, match="per-id weights and others do not"):
        Samples.cat([s, unweighted])


def test_a_slot_space_of_one_table_is_named_by_its_table() -> None:
    """A space of one table (a kernel group with one cached table) named the space ('table 't+0' pins ...') in
    the refusal, and the oracle's refusals (which name the table) were not translated to the whole cache."""
    from torchrec_lookahead.errors import CapacityError

    with pytest.raises(CapacityError, match="^table 't' pins 5 hot rows") as err:
        PinnedRows({"t": torch.arange(5)}, {"f": "t"}, {"t": 5}, {"t": 50}, {"t+0": ("t",)})
    assert err.value.table == "t"
    pins = PinnedRows({"t": torch.arange(3)}, {"f": "t"}, {"t": 5}, {"t": 50}, {"t+0": ("t",)})
    whole = pins.whole_cache_error(CapacityError("t", table="t", batch=2, needed=4, available=2))
    assert (whole.needed, whole.available) == (7, 5) and "besides its 3 pinned hot rows" in str(whole)
