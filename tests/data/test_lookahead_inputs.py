"""What LookaheadDataModule refuses because it would train something other than the planned batches: batch hooks
that see or change them, a LookaheadDataModule around another, several training loaders, a loader that cannot be
read twice; and the ttl policy's own need checked before training."""

import lightning.pytorch as pl
import pytest

from torchrec_lookahead import CapacityError, ConfigError
from torchrec_lookahead.data import LookaheadDataModule

from ..helpers import fit_cached


def test_a_datamodule_with_batch_hooks_or_wrapped_twice_is_refused_and_the_wrapper_forwards_its_hooks():
    """The wrapped DataModule's batch hooks were silently dropped in cached training (0.37 from resident), and a
    LookaheadDataModule around another failed on the slots as out-of-range ids."""
    from torchrec_lookahead.data import CriteoSyntheticDataModule
    from torchrec_lookahead.data.wrapper import WrappedDataModule

    from ..conftest import tiny_data_args

    class Hooked(CriteoSyntheticDataModule):
        calls = 0

        def on_before_batch_transfer(self, batch, dataloader_idx):
            Hooked.calls += 1
            return batch

    class Moving(CriteoSyntheticDataModule):  # a move only, after the plan is applied: kept
        def transfer_batch_to_device(self, batch, device, dataloader_idx):
            return batch.to(device)

    hooked = Hooked(**tiny_data_args())
    with pytest.raises(
        ConfigError, match=r"Hooked overrides \['on_before_batch_transfer'\]: the lookahead cache"
    ):
        LookaheadDataModule(hooked)
    moving = LookaheadDataModule(Moving(**tiny_data_args()))
    assert moving.transfer_batch_to_device.__func__ is Moving.transfer_batch_to_device  # the wrapped one's
    plain = CriteoSyntheticDataModule(**tiny_data_args())
    with pytest.raises(ConfigError, match="is a LookaheadDataModule already"):
        LookaheadDataModule(LookaheadDataModule(plain))
    assert WrappedDataModule(hooked).on_before_batch_transfer("batch", 0) == "batch" and Hooked.calls == 1
    # hooks the wrapped DataModule does not override stay the LightningModule's (Lightning runs a DataModule's
    # hook instead of the LightningModule's where the DataModule has its own)
    from lightning.pytorch.utilities.model_helpers import is_overridden

    assert not is_overridden("on_after_batch_transfer", WrappedDataModule(hooked), pl.LightningDataModule)
    assert is_overridden("on_before_batch_transfer", WrappedDataModule(hooked), pl.LightningDataModule)


class _OneShot:
    """A loader with ``len()`` that can be read once (a dataset over a generator or a queue)."""

    def __init__(self, batches):
        self._it, self._n = iter(list(batches)), len(batches)

    def __len__(self):
        return self._n

    def __iter__(self):
        return self._it


def test_a_loader_that_cannot_be_read_twice_is_refused_at_the_end_of_its_stream(tmp_path, monkeypatch):
    """The epoch's capacity check read the one pass such a loader gives, and training then read nothing: 0 steps
    and exit 0, where a resident run trains the epoch."""
    from torchrec_lookahead import DataError
    from torchrec_lookahead.data import CriteoSyntheticDataModule

    plain = CriteoSyntheticDataModule.train_dataloader
    monkeypatch.setattr(CriteoSyntheticDataModule, "train_dataloader", lambda self: _OneShot(plain(self)))
    with pytest.raises(DataError, match="gave 0 batches where its pass for the capacity check gave 12"):
        fit_cached(tmp_path / "a", 12)
    trainer, _ = fit_cached(tmp_path / "b", 12, lookahead_kw={"capacity_check": "lookahead"})
    assert trainer.global_step == 12  # read once, by training


class _Shrinking:
    """A loader whose third pass (after the capacity check's and the first epoch's) is one batch shorter: a
    bucketing sampler's epoch lengths vary."""

    def __init__(self, batches):
        self._batches, self.passes = list(batches), 0

    def __len__(self):
        return len(self._batches)

    def __iter__(self):
        self.passes += 1
        return iter(self._batches if self.passes <= 2 else self._batches[:-1])


def test_only_the_pass_after_the_capacity_check_is_compared_with_it(tmp_path, monkeypatch):
    from torchrec_lookahead.data import CriteoSyntheticDataModule

    plain = CriteoSyntheticDataModule.train_dataloader
    monkeypatch.setattr(CriteoSyntheticDataModule, "train_dataloader", lambda self: _Shrinking(plain(self)))
    trainer, _ = fit_cached(tmp_path, 23)
    assert trainer.global_step == 23  # 12, then 11 in the second epoch: no refusal


def test_a_list_of_training_loaders_is_refused_naming_it(tmp_path, monkeypatch):
    """It failed with a DataError asking for a BatchAdapter, which cannot help."""
    from torchrec_lookahead.data import CriteoSyntheticDataModule

    plain = CriteoSyntheticDataModule.train_dataloader
    monkeypatch.setattr(
        CriteoSyntheticDataModule, "train_dataloader", lambda self: [plain(self), plain(self)]
    )
    with pytest.raises(
        ConfigError, match=r"train_dataloader\(\) returns a list of 2 loaders: the lookahead cache"
    ):
        fit_cached(tmp_path, 2)


def _late_ttl_capacity(table: str, batches: int, horizon: int, late: int) -> int:
    """A capacity for ``table`` with which the ``ttl`` policy (horizon ``horizon``) first runs short at a batch
    after ``late``: the oracle planning the tiny data alone, capacity by capacity."""
    from torchrec_lookahead.data import CriteoSyntheticDataModule
    from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig

    from ..conftest import tiny_data_args

    dm = CriteoSyntheticDataModule(**tiny_data_args(num_train_batches=batches))
    dm.setup("fit")
    stream = [{table: b.sparse_features[table[len("t_") :]].values()} for b in dm.train_dataloader()]
    rows = dm.num_embeddings_per_feature[table[len("t_") :]]
    for cap in range(1, rows):
        config = OracleConfig(
            capacity={table: cap}, num_embeddings={table: rows}, horizon=horizon, policy="ttl"
        )
        try:
            list(LookaheadOracle(config).plan_stream(stream))
        except CapacityError as e:
            if e.batch is not None and e.batch > late:
                return cap
            continue
        break
    raise AssertionError("the data has no late ttl shortfall")


def test_the_ttl_policys_own_need_is_checked_before_training(tmp_path):
    """The epoch's check measured window working sets, which the ttl policy exceeds (it keeps a row while its next
    use is within the horizon): a capacity the check passed ran short mid-epoch. The check now runs the loader's
    oracle over the batches it reads."""
    table, batches = "t_cat_15", 40
    cap = _late_ttl_capacity(table, batches, horizon=8, late=20)
    steps = []

    class Count(pl.Callback):
        def on_train_batch_start(self, *args):
            steps.append(1)

    with pytest.raises(CapacityError, match=rf"'{table}': policy 'ttl' needs \d+ cache rows at batch"):
        fit_cached(tmp_path, batches, capacity={table: cap}, policy="ttl", data={"num_train_batches": batches},
                   callbacks=[Count()])  # fmt: skip
    assert steps == []


class _BadResidentId:
    """The batches of a loader, with one id of resident feature ``cat_0`` out of its table at batch 5."""

    def __init__(self, loader, rows):
        self._loader, self._rows = loader, rows

    def __len__(self):
        return len(self._loader)

    def __iter__(self):
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        for i, b in enumerate(self._loader):
            if i == 5:
                kjt = b.sparse_features
                values = kjt.values().clone()
                values[kjt.offset_per_key()[kjt.keys().index("cat_0")]] = self._rows
                b.sparse_features = KeyedJaggedTensor(kjt.keys(), values, lengths=kjt.lengths())
            yield b


def test_a_resident_tables_bad_id_is_refused_before_training(tmp_path, monkeypatch):
    """The pre-scan checked only the cached tables' ids: a resident table's bad id failed at its step, after the
    steps before it had trained."""
    from torchrec_lookahead import InvalidIdError
    from torchrec_lookahead.data import CriteoSyntheticDataModule

    plain = CriteoSyntheticDataModule.train_dataloader

    def bad(self):
        return _BadResidentId(plain(self), self.num_embeddings_per_feature["cat_0"])

    monkeypatch.setattr(CriteoSyntheticDataModule, "train_dataloader", bad)
    steps = []

    class Count(pl.Callback):
        def on_train_batch_start(self, *args):
            steps.append(1)

    with pytest.raises(
        InvalidIdError, match=r"feature 'cat_0' of resident table 't_cat_0': batch 5 holds id"
    ):
        fit_cached(tmp_path, 12, callbacks=[Count()])
    assert steps == []
