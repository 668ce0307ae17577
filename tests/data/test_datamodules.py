"""The file-backed DataModules' splits: a split without files is refused when a loader asks for it, with the fix."""

from __future__ import annotations

import pytest

from torchrec_lookahead import ConfigError
from torchrec_lookahead.data import CriteoTSVDataModule

from .test_readers import GOOD, _write


def test_a_split_without_files_says_how_to_do_without_it(tmp_path):
    dm = CriteoTSVDataModule(_write(tmp_path, "a.tsv", [GOOD] * 4), num_embeddings=100, batch_size=2)
    dm.setup("fit")
    assert len(list(dm.train_dataloader())) == 2
    with pytest.raises(
        ConfigError, match=r"no 'val' data; .* or turn validation off \(trainer.limit_val_batches: 0\)"
    ):
        dm.val_dataloader()
    with pytest.raises(ConfigError, match=r"no 'test' data; configure files or batches for it$"):
        dm.test_dataloader()


def _trainer(world_size=2, **limits):
    """The trainer attributes a DataModule reads at setup (ranks and ``limit_*_batches``)."""
    from types import SimpleNamespace

    base = dict(
        limit_train_batches=1.0, limit_val_batches=1.0, limit_test_batches=1.0, limit_predict_batches=1.0
    )
    return SimpleNamespace(world_size=world_size, global_rank=0, **{**base, **limits})


def test_a_split_that_will_not_be_read_is_not_refused(tmp_path):
    """409 validation rows are fewer than a batch of 256 x 2 ranks: with limit_val_batches 0 the val split is
    never read and `fit` (and `verify`, which turns validation off) must not refuse it."""
    from torchrec_lookahead import DataError

    train = _write(tmp_path, "train.tsv", [GOOD] * 1024)
    small = _write(tmp_path, "small.tsv", [GOOD] * 409)
    dm = CriteoTSVDataModule(train, val_files=small, test_files=small, num_embeddings=100, batch_size=256)
    dm.trainer = _trainer(limit_val_batches=0)
    dm.setup("fit")
    assert len(dm.dataset("train")) == 2
    dm.trainer = _trainer(limit_val_batches=0.0, limit_test_batches=0)
    dm.setup("validate")
    dm.setup("test")
    dm.trainer = _trainer(limit_predict_batches=0)
    dm.setup("predict")
    dm.trainer = _trainer()
    with pytest.raises(DataError, match="the val split would have no batches"):
        dm.setup("validate")
    # a fit whose module has no validation_step does not read the val split either (Lightning's loop skips it)
    import lightning.pytorch as pl

    fresh = CriteoTSVDataModule(train, val_files=small, num_embeddings=100, batch_size=256)
    fresh.trainer = _trainer()
    fresh.trainer.lightning_module = pl.LightningModule()
    fresh.setup("fit")
    assert len(fresh.dataset("train")) == 2


def test_no_batches_on_several_ranks_hints_a_batch_size_that_works(tmp_path):
    """drop_last=False fails on several ranks with rows that do not split evenly: the hint gives a batch_size."""
    from torchrec_lookahead import DataError

    small = _write(tmp_path, "small.tsv", [GOOD] * 409)
    dm = CriteoTSVDataModule(small, val_files=small, num_embeddings=100, batch_size=256)
    dm.trainer = _trainer()
    with pytest.raises(DataError) as err:
        dm.setup("validate")
    msg = str(err.value)
    assert "drop_last=False" not in msg
    assert "use a batch_size of at most 204 (rows // ranks)" in msg and "trainer.limit_val_batches: 0" in msg
    works = CriteoTSVDataModule(small, val_files=small, num_embeddings=100, batch_size=204)
    works.trainer = _trainer()
    works.setup("validate")
    assert len(works.dataset("val")) == 1
    one = CriteoTSVDataModule(small, num_embeddings=100, batch_size=512, drop_last=True)
    with pytest.raises(DataError, match="use drop_last=False or a smaller batch_size$"):
        one.setup("fit")
