"""The files of a checkpoint directory read before its shards: ``meta.pt`` and torch.distributed.checkpoint's
``.metadata``, a damaged one refused with one CheckpointError naming it."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import pytest
import torch

from torchrec_lookahead.errors import CheckpointError
from torchrec_lookahead.strategies._checkpoint import check_dcp_metadata, load_meta_file, load_sharded


def test_a_damaged_metadata_file_is_one_checkpoint_error_before_torch_logs_a_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / ".metadata").write_bytes(bytes(range(256)) * 2)
    with caplog.at_level(logging.WARNING):
        with pytest.raises(CheckpointError, match=r"\.metadata could not be read \(UnpicklingError") as e:
            load_sharded({}, tmp_path)  # the loader would log two warnings with tracebacks, then fail
    assert str(tmp_path) in str(e.value) and "use another checkpoint" in str(e.value)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    (tmp_path / ".metadata").write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(CheckpointError, match=r"\.metadata could not be read \(AttributeError"):
        check_dcp_metadata(tmp_path)


def test_a_damaged_meta_file_is_a_checkpoint_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "meta.pt").write_text("hello\n")
    with pytest.raises(
        CheckpointError, match=r"meta.pt could not be read \(UnpicklingError\); the file is damaged"
    ):
        load_meta_file(tmp_path)
    torch.save([1, 2], tmp_path / "meta.pt")
    with pytest.raises(CheckpointError, match=r"meta.pt holds a list, not the dict TorchRecStrategy writes"):
        load_meta_file(tmp_path)
    torch.save({"epoch": 3}, tmp_path / "meta.pt")
    assert load_meta_file(tmp_path) == {"epoch": 3}


def test_a_checkpoint_saved_inside_a_training_step_is_refused_for_a_resume(tmp_path: Path) -> None:
    """Ctrl-C with Lightning's OnExceptionCheckpoint saved a checkpoint between a step's fetch and its optimizer
    step: resumed, the run skipped that batch (its loader counted it) and went on from weights that may hold part
    of the step, silently. A checkpoint written between steps resumes."""
    import shutil

    from lightning.pytorch.callbacks import ModelCheckpoint

    from torchrec_lookahead.strategies._checkpoint import META_FILE, check_between_steps

    from ..helpers import fit_cached

    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    fit_cached(tmp_path / "a", 4, callbacks=[every])
    between = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    meta = load_meta_file(between)
    check_between_steps(meta, between)  # ModelCheckpoint's: fetched, processed, its end hooks running
    inside = tmp_path / "inside.ckpt"
    shutil.copytree(between, inside)
    progress = meta["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    for counters in (progress["total"], progress["current"]):  # step 3's batch fetched, not processed
        counters.update(ready=3, started=3, processed=2, completed=2)
    torch.save(meta, inside / META_FILE)
    with pytest.raises(CheckpointError, match=r"was saved inside training step 3 \(after an interrupt"):
        fit_cached(tmp_path / "b", 4, ckpt_path=str(inside))
    trainer, _ = fit_cached(tmp_path / "c", 4, ckpt_path=str(between))
    assert trainer.global_step == 4


def test_a_checkpoint_directory_is_checked_before_anything_is_built(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """Through the CLI a damaged or inside-a-step checkpoint was refused only when the strategy loaded it, after
    about 55 lines of set-up and the sharding: now it is the run's first line."""
    import shutil

    from lightning.pytorch.callbacks import ModelCheckpoint

    from torchrec_lookahead.launch import LookaheadCLI
    from torchrec_lookahead.strategies._checkpoint import META_FILE

    from ..cli.test_errors import TINY, _short_error
    from ..helpers import fit_cached

    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    fit_cached(tmp_path / "a", 2, callbacks=[every])
    good = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("built the Trainer, model and data before checking the checkpoint")

    monkeypatch.setattr(LookaheadCLI, "instantiate_classes", never)
    lost = tmp_path / "lost.ckpt"
    shutil.copytree(good, lost)
    (lost / ".metadata").unlink()
    line = _short_error(capsys, ["fit", "--config", TINY, f"--ckpt_path={lost}"])
    assert line.startswith(
        f"CheckpointError: checkpoint {lost} is incomplete: torch.distributed.checkpoint's"
    ), line
    inside = tmp_path / "inside.ckpt"
    shutil.copytree(good, inside)
    meta = load_meta_file(inside)
    meta["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"].update(ready=3, processed=2)
    torch.save(meta, inside / META_FILE)
    line = _short_error(capsys, ["fit", "--config", TINY, f"--ckpt_path={inside}"])
    assert line.startswith(f"CheckpointError: checkpoint {inside} was saved inside training step 3"), line


def _fake_checkpoint(path: Path, world_size: int) -> Path:
    path.mkdir(parents=True)
    torch.save({"torchrec_lookahead_world_size": world_size, "epoch": 0}, path / "meta.pt")
    (path / ".metadata").write_bytes(b"")
    (path / "__0_0.distcp").write_bytes(b"")
    return path


@pytest.mark.parametrize("name", ["meta.pt", "__0_0.distcp"])
def test_a_file_inside_a_checkpoint_directory_says_to_pass_the_directory(tmp_path: Path, name: str) -> None:
    """It said "an ordinary checkpoint ... run with --trainer.strategy=auto"."""
    from torchrec_lookahead.strategies._checkpoint import read_checkpoint_meta

    ckpt = _fake_checkpoint(tmp_path / "epoch=0-step=20.ckpt", 1)
    with pytest.raises(CheckpointError) as info:
        read_checkpoint_meta(ckpt / name, 1)
    assert str(info.value) == (
        f"{ckpt / name} is a file inside the checkpoint directory {ckpt}: a checkpoint of TorchRecStrategy is the "
        f"whole directory; pass --ckpt_path {ckpt}"
    )


def test_a_directory_of_checkpoints_names_the_newest_to_pass(tmp_path: Path) -> None:
    import os

    from torchrec_lookahead.strategies._checkpoint import read_checkpoint_meta

    old = _fake_checkpoint(tmp_path / "epoch=0-step=5.ckpt", 1)
    new = _fake_checkpoint(tmp_path / "epoch=0-step=10.ckpt", 1)
    os.utime(old, (1, 1))
    with pytest.raises(CheckpointError) as info:
        read_checkpoint_meta(tmp_path, 1)
    assert str(info.value) == (
        f"{tmp_path} is a directory of 2 checkpoint(s) (a ModelCheckpoint dirpath), not one checkpoint: pass one "
        f"of them, e.g. the newest, --ckpt_path {new}"
    )


def test_another_world_size_says_rank_once_and_offers_export_where_nothing_is_resumed(tmp_path: Path) -> None:
    """It said "written by 1 ranks" and told predict to "resume it with 2 ranks"."""
    from torchrec_lookahead.strategies._checkpoint import read_checkpoint_meta

    ckpt = _fake_checkpoint(tmp_path / "c.ckpt", 1)
    with pytest.raises(CheckpointError) as info:
        read_checkpoint_meta(ckpt, 2, fitting=False)
    message = str(info.value)
    assert message.startswith(f"checkpoint {ckpt} was written by 1 rank but this run has 2: "), message
    assert f"python -m torchrec_lookahead export --ckpt {ckpt}" in message and "resume" not in message
    with pytest.raises(CheckpointError, match=r"written by 1 rank but .* resume it with 1 rank \("):
        read_checkpoint_meta(ckpt, 2, fitting=True)


@pytest.mark.parametrize("capacity", [None, {}], ids=["cached", "resident"])
def test_a_weights_only_checkpoint_is_refused_to_resume_saying_so(tmp_path: Path, capacity) -> None:
    """fit --ckpt_path of a ModelCheckpoint(save_weights_only=True) checkpoint said it was 'written by another
    configuration', to be resumed 'with the config that wrote it' (the one given): it lacks the optimizer state.
    validate after a fit (test with ckpt_path='best' of such a ModelCheckpoint) failed with the same message."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ..helpers import fit_cached

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_weights_only=True)
    fit_cached(tmp_path / "a", max_steps=2, capacity=capacity, callbacks=[ckpt])
    path = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    with pytest.raises(
        CheckpointError, match=r"holds the model's weights only \(ModelCheckpoint save_weights_only"
    ):
        fit_cached(tmp_path / "b", max_steps=4, capacity=capacity, ckpt_path=str(path))
    trainer, model = fit_cached(tmp_path / "c", max_steps=2, capacity=capacity, limit_val_batches=None)
    assert trainer.validate(model, datamodule=trainer.datamodule, ckpt_path=str(path), verbose=False)


@pytest.mark.parametrize("store", ["ram", "disk"])
def test_validate_of_a_weights_only_checkpoint_equals_that_of_the_full_one(
    tmp_path: Path, store: str
) -> None:
    """validate --ckpt_path of a weights-only checkpoint reads the weights alone (no optimizer state): the
    metrics and every weight equal, bit for bit, those read from the full checkpoint of the same step (the
    cached table's rows in a RAM or a disk store)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ..helpers import fit_cached, weights

    def sharder(name: str) -> dict:
        return (
            {"store": "disk", "host_budget_bytes": 64 * 1024, "store_dir": str(tmp_path / name)}
            if store == "disk"
            else {}
        )

    wo = ModelCheckpoint(
        tmp_path / "w", every_n_train_steps=2, save_weights_only=True, filename="w-{step}", save_top_k=-1
    )
    full = ModelCheckpoint(tmp_path / "f", every_n_train_steps=1, save_top_k=-1)
    kw = {"capacity": {"t_cat_2": 140}}
    fit_cached(tmp_path / "a", max_steps=4, callbacks=[wo, full], sharder_kw=sharder("sa"), **kw)
    trainer, model = fit_cached(
        tmp_path / "b", max_steps=3, limit_val_batches=None, sharder_kw=sharder("sb"), **kw
    )
    read = []
    for path in (tmp_path / "w" / "w-step=2.ckpt", tmp_path / "f" / "epoch=0-step=2.ckpt"):
        metrics = trainer.validate(model, datamodule=trainer.datamodule, ckpt_path=str(path), verbose=False)
        read.append((metrics, weights(model)))
    (m_wo, w_wo), (m_full, w_full) = read
    assert m_wo == m_full
    assert w_wo.keys() == w_full.keys() and all(torch.equal(w_wo[k], w_full[k]) for k in w_wo)
