import torch

from torchrec_lookahead.data import CriteoSyntheticDataset, ResumableBatchLoader, SyntheticCriteoConfig

from ..conftest import TINY_TABLES


def test_loader_resumes_where_it_stopped():
    cfg = SyntheticCriteoConfig(batch_size=8, num_batches=5, num_embeddings=TINY_TABLES)
    full = [b.labels for b in ResumableBatchLoader(CriteoSyntheticDataset(cfg))]
    loader = ResumableBatchLoader(CriteoSyntheticDataset(cfg))
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    assert state == {"batches_yielded": 2}
    fresh = ResumableBatchLoader(CriteoSyntheticDataset(cfg))
    fresh.load_state_dict(state)
    rest = [b.labels for b in fresh]
    assert len(rest) == 3 and all(torch.equal(a, b) for a, b in zip(rest, full[2:]))
    # the following epoch starts from the beginning again
    assert len(list(fresh)) == 5


def test_a_mid_epoch_position_is_refused_over_other_files(tmp_path):
    """A checkpoint's position counts batches of its files: resumed over an edited or other file, the rest of the
    epoch came from other rows, silently."""
    import pytest

    from torchrec_lookahead import CheckpointError
    from torchrec_lookahead.data import CriteoTSVDataModule

    from .test_readers import GOOD

    train = tmp_path / "train.tsv"
    train.write_text((GOOD + "\n") * 40)

    def loader():
        dm = CriteoTSVDataModule(train_files=str(train), batch_size=4, num_embeddings=100)
        dm.setup("fit")
        return dm.train_dataloader()

    first = loader()
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    assert state == {"batches_yielded": 2, "source": [["train.tsv", train.stat().st_size]], "batch_size": 4}
    loader().load_state_dict(state)  # the same file: resumes
    train.write_text((GOOD + "\n") * 30)  # fewer rows: the position would fall elsewhere
    with pytest.raises(CheckpointError) as err:
        loader().load_state_dict(state)
    before, after = 40 * (len(GOOD) + 1), 30 * (len(GOOD) + 1)
    assert str(err.value) == (
        f"the checkpoint stopped after batch 2 of an epoch over the files [train.tsv ({before:,} bytes)], but the "
        f"data module reads [train.tsv ({after:,} bytes)]: the rest of the epoch would come from other rows; resume "
        "with the files it was trained on, or from an end-of-epoch checkpoint"
    )
    loader().load_state_dict({**state, "batches_yielded": 0})  # an epoch's end: new data is a new epoch
    loader().load_state_dict({"batches_yielded": 2})  # a checkpoint that did not record its files


def test_a_mid_epoch_position_is_refused_with_another_batch_size(tmp_path):
    """A checkpoint's position counts batches: resumed with another batch_size, the epoch went on from another
    row (batch 2 of 4 rows resumed at row 16 of batches of 8), training rows twice or skipping them, silently."""
    import pytest

    from torchrec_lookahead import CheckpointError
    from torchrec_lookahead.data import CriteoTSVDataModule

    from .test_readers import GOOD

    train = tmp_path / "train.tsv"
    train.write_text((GOOD + "\n") * 40)

    def loader(batch_size):
        dm = CriteoTSVDataModule(train_files=str(train), batch_size=batch_size, num_embeddings=100)
        dm.setup("fit")
        return dm.train_dataloader()

    first = loader(4)
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    loader(4).load_state_dict(state)  # the same batches: resumes
    with pytest.raises(CheckpointError) as err:
        loader(8).load_state_dict(state)
    assert str(err.value) == (
        "the checkpoint stopped after batch 2 of an epoch of batches of 4 rows per rank, but the data module makes "
        "batches of 8: the rest of the epoch would start at row 16 instead of 8 (rows trained twice, or skipped); "
        "resume with batch_size 4, or from an end-of-epoch checkpoint"
    )
    loader(8).load_state_dict({**state, "batches_yielded": 0})  # an epoch's end: any batch size
    loader(8).load_state_dict({k: v for k, v in state.items() if k != "batch_size"})  # older checkpoints


def test_fit_does_not_read_the_test_files(tmp_path):
    """``setup("fit")`` set up every split: an empty (or damaged) test file stopped a fit that never reads it."""
    import pytest

    from torchrec_lookahead import DataError
    from torchrec_lookahead.data import CriteoTSVDataModule

    from .test_readers import GOOD

    train, empty = tmp_path / "train.tsv", tmp_path / "test.tsv"
    train.write_text((GOOD + "\n") * 8)
    empty.write_text("")
    dm = CriteoTSVDataModule(train_files=str(train), test_files=str(empty), batch_size=4, num_embeddings=100)
    dm.setup("fit")
    assert len(list(dm.train_dataloader())) == 2
    with pytest.raises(DataError, match="the test split would have no batches"):
        dm.setup("test")
