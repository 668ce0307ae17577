from types import SimpleNamespace

import pytest
import torch

from torchrec_lookahead.callbacks import PredictionWriter


def test_predictions_are_concatenated_in_batch_order_one_file_per_rank(tmp_path):
    writer = PredictionWriter(str(tmp_path / "out" / "p.pt"))
    batches = [torch.tensor([0.1, 0.2]), torch.tensor([[0.3]])]
    writer.write_on_epoch_end(SimpleNamespace(global_rank=0, world_size=1), None, batches, None)
    assert torch.equal(torch.load(tmp_path / "out" / "p.pt"), torch.tensor([0.1, 0.2, 0.3]))
    # several dataloaders: a list per dataloader; several ranks: a file per rank
    writer.write_on_epoch_end(
        SimpleNamespace(global_rank=1, world_size=2), None, [batches, batches[:1]], None
    )
    assert torch.equal(torch.load(tmp_path / "out" / "p.rank1.pt"), torch.tensor([0.1, 0.2, 0.3, 0.1, 0.2]))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["p.pt", "p.rank1.pt"]


def test_a_path_that_cannot_be_written_is_refused_at_set_up_and_a_failed_write_leaves_no_tmp(
    tmp_path, monkeypatch
):
    from torchrec_lookahead.errors import ConfigError

    one = SimpleNamespace(global_rank=0, world_size=1)
    with pytest.raises(
        ConfigError, match=f"path of PredictionWriter '{tmp_path}' is a directory; name the file"
    ):
        PredictionWriter(str(tmp_path)).setup(one, None, "predict")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=f"cannot be written: '{blocker}' is a file, not a directory"):
        PredictionWriter(str(blocker / "p.pt")).setup(one, None, "predict")
    (tmp_path / "p.rank1.pt").mkdir()  # several ranks: each rank's own file is checked
    with pytest.raises(ConfigError, match=r"p.rank1.pt' is a directory"):
        PredictionWriter(str(tmp_path / "p.pt")).setup(
            SimpleNamespace(global_rank=1, world_size=2), None, "predict"
        )
    PredictionWriter(str(tmp_path)).setup(one, None, "fit")  # it writes only after predict

    def full_disk(obj, f):
        with open(f, "wb") as out:
            out.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(
        ConfigError, match=r"'.*q.pt' cannot be written: no space left on its disk .* bytes were free"
    ):
        PredictionWriter(str(tmp_path / "q.pt")).write_on_epoch_end(one, None, [torch.ones(2)], None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "p.rank1.pt"]


def test_a_full_disk_seen_by_torch_zip_writer_is_one_config_error_not_its_enforce_message(
    tmp_path, monkeypatch
):
    from torchrec_lookahead.errors import ConfigError

    def short_write(obj, f):  # what torch.save raises when a full disk refuses its last bytes
        with open(f, "wb") as out:
            out.write(b"half")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", short_write)
    one = SimpleNamespace(global_rank=0, world_size=1)
    with pytest.raises(
        ConfigError, match=r"cannot be written: no space left on its disk \(the predictions take"
    ):
        PredictionWriter(str(tmp_path / "q.pt")).write_on_epoch_end(one, None, [torch.ones(3)], None)
    assert list(tmp_path.iterdir()) == []

    def other(obj, f):  # any other failure is not dressed up as a full disk
        raise RuntimeError("boom")

    monkeypatch.setattr(torch, "save", other)
    with pytest.raises(RuntimeError, match="boom"):
        PredictionWriter(str(tmp_path / "q.pt")).write_on_epoch_end(one, None, [torch.ones(3)], None)


def test_predict_to_a_directory_is_one_config_error_before_anything_is_predicted(
    capsys, tmp_path, monkeypatch
):
    from torchrec_lookahead.models import TorchRecModule

    from ..cli.test_errors import TINY, _short_error

    def never(*args, **kwargs):
        raise AssertionError("predicted before checking where to write")

    monkeypatch.setattr(TorchRecModule, "predict_step", never)
    line = _short_error(
        capsys,
        [
            "predict",
            "--config",
            TINY,
            "--trainer.logger=false",
            "--trainer.callbacks+=torchrec_lookahead.callbacks.PredictionWriter",
            f"--trainer.callbacks.path={tmp_path}",
        ],  # fmt: skip
    )
    assert line.startswith(f"ConfigError: path of PredictionWriter '{tmp_path}' is a directory"), line
    assert not list(tmp_path.iterdir())
