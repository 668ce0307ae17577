"""export: a cached run's checkpoint, served by the plain resident model, gives the cached model's predictions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchrec_lookahead.errors import CheckpointError
from torchrec_lookahead.export import export_checkpoint, resident_key, resident_state_dict
from torchrec_lookahead.models import DLRMModule

from .cli.test_cli import run_cli

CONFIG = "configs/dlrm_tiny_lookahead.yaml"


@pytest.mark.slow
def test_cached_checkpoint_exported_and_served_resident_gives_identical_predictions(tmp_path: Path) -> None:
    from torchrec_lookahead.launch import build_cli

    cli = build_cli(["--config", CONFIG, "--trainer.max_steps=7", "--trainer.logger=false",
                     "--trainer.enable_checkpointing=false", "--trainer.limit_val_batches=0",
                     f"--trainer.default_root_dir={tmp_path}"])  # fmt: skip
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    ckpt = tmp_path / "cached.ckpt"
    cli.trainer.save_checkpoint(ckpt)
    inner = cli.datamodule.datamodule
    inner.setup("validate")
    batch = next(iter(inner.val_dataloader()))
    cli.model.eval()
    with torch.no_grad():
        cached = cli.model(batch.dense_features, batch.sparse_features)
    cli.trainer.strategy.teardown()

    out = tmp_path / "served.ckpt"
    summary = export_checkpoint(ckpt, out, config=[CONFIG])
    assert summary["embedding_tables"] == 26
    served = DLRMModule.load_from_checkpoint(out)
    served.configure_model()
    served.load_state_dict(torch.load(out, weights_only=False)["state_dict"])
    served.eval()
    with torch.no_grad():
        resident = served(batch.dense_features, batch.sparse_features)
    assert torch.equal(cached, resident)
    keys = torch.load(out, weights_only=False)["state_dict"].keys()
    assert not [k for k in keys if "cache" in k.split(".") or k.endswith("momentum1")]


def test_resident_keys_and_states_dropped() -> None:
    cache = "model._dmp_wrapped_module.sparse_arch.embedding_bag_collection.cache"
    state = {
        f"{cache}.embedding_bags.t.weight": torch.ones(2),
        f"{cache}.embedding_bags.t.momentum1": torch.ones(2),
        f"{cache}.optimizer_step": torch.tensor(3),
        "model._dmp_wrapped_module.dense_arch.model.0.weight": torch.zeros(1),
    }
    out = resident_state_dict(state)
    assert sorted(out) == [
        "model.dense_arch.model.0.weight",
        "model.sparse_arch.embedding_bag_collection.embedding_bags.t.weight",
    ]
    assert resident_key("a.resident.embedding_bags.x.weight") == "a.embedding_bags.x.weight"


def test_export_refuses_missing_and_damaged_checkpoints_without_writing(tmp_path: Path) -> None:
    out = tmp_path / "served.ckpt"
    with pytest.raises(CheckpointError, match="no checkpoint"):
        export_checkpoint(tmp_path / "nope.ckpt", out)
    bad = tmp_path / "bad.ckpt"
    bad.mkdir()
    (bad / "meta.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        export_checkpoint(bad, out)
    (bad / ".metadata").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="meta.pt could not be read"):
        export_checkpoint(bad, out)
    assert not out.exists()


def test_export_refuses_a_damaged_meta_pt_or_metadata_before_gathering_the_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    import torch.distributed.checkpoint.format_utils as format_utils

    def never(*args: object) -> None:
        raise AssertionError("gathered the shards before reading meta.pt and .metadata")

    monkeypatch.setattr(format_utils, "dcp_to_torch_save", never)
    bad, out = tmp_path / "bad.ckpt", tmp_path / "served.ckpt"
    bad.mkdir()
    (bad / "meta.pt").write_text("hello\n")
    (bad / ".metadata").write_bytes(bytes(range(200)))
    with pytest.raises(
        CheckpointError, match=rf"checkpoint {bad}: meta.pt could not be read \(UnpicklingError"
    ):
        export_checkpoint(bad, out)
    torch.save({"epoch": 0}, bad / "meta.pt")
    with caplog.at_level(logging.WARNING):  # not torch's two warnings with tracebacks first
        with pytest.raises(CheckpointError, match=r"\.metadata could not be read \(UnpicklingError"):
            export_checkpoint(bad, out)
    assert not caplog.records and not out.exists()


def test_export_refuses_an_out_under_a_file_before_reading_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchrec_lookahead.export as export
    from torchrec_lookahead.errors import ConfigError

    def never(ckpt: Path) -> None:
        raise AssertionError("read the checkpoint before checking --out")

    monkeypatch.setattr(export, "_load_whole", never)
    blocker = tmp_path / "file"
    blocker.write_text("")
    ckpt = tmp_path / "c.ckpt"
    ckpt.write_bytes(b"")
    with pytest.raises(
        ConfigError, match=rf"--out '{blocker / 'x.pt'}' cannot be written: '{blocker}' is a file"
    ):
        export_checkpoint(ckpt, blocker / "x.pt")
    with pytest.raises(CheckpointError, match="is a directory"):  # as before
        export_checkpoint(ckpt, tmp_path)


@pytest.mark.slow
def test_export_command_line_refuses_a_missing_checkpoint(tmp_path: Path) -> None:
    out = run_cli("export", "--ckpt", str(tmp_path / "none"), "--out", str(tmp_path / "o.ckpt"))
    assert out.returncode != 0 and "CheckpointError" in out.stderr
    assert not (tmp_path / "o.ckpt").exists()
    ok = run_cli("export", "--help")
    assert ok.returncode == 0 and "--ckpt" in ok.stdout


@pytest.mark.parametrize("flag", ["--ckpt", "--out"])
def test_export_refuses_an_empty_path_naming_the_flag_not_the_working_directory(
    tmp_path: Path, monkeypatch, flag: str
) -> None:
    """``--ckpt ""`` (an unset shell variable) was read as ``.``: "CheckpointError: . is not a checkpoint directory"."""
    from torchrec_lookahead.export import main

    monkeypatch.chdir(tmp_path)
    paths = {"--ckpt": str(tmp_path / "c.ckpt"), "--out": str(tmp_path / "o.ckpt"), flag: ""}
    with pytest.raises(CheckpointError, match=f"^{flag} is empty; pass a path"):
        main([a for k, v in paths.items() for a in (k, v)])
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_a_file_that_is_not_a_checkpoint_dict(tmp_path: Path) -> None:
    listed = tmp_path / "list.pt"
    torch.save([1, 2], listed)
    with pytest.raises(CheckpointError, match=r"holds a list, not a Lightning checkpoint"):
        export_checkpoint(listed, tmp_path / "o.ckpt")
    assert not (tmp_path / "o.ckpt").exists()


def test_export_checks_its_config_before_reading_the_checkpoint(tmp_path: Path, monkeypatch) -> None:
    import torchrec_lookahead.export as export
    from torchrec_lookahead.errors import ConfigError

    def never(ckpt: Path) -> None:
        raise AssertionError("read the checkpoint before checking the config")

    monkeypatch.setattr(export, "_load_whole", never)
    ckpt = tmp_path / "c.ckpt"
    ckpt.write_bytes(b"")
    with pytest.raises(ConfigError, match="Config file not found"):
        export_checkpoint(ckpt, tmp_path / "o.ckpt", [str(tmp_path / "nope.yaml")])


# what torch's zip writer raises when the disk refuses its last bytes (seen on a full tmpfs)
_SHORT_WRITE = "[enforce fail at inline_container.cc:672] . unexpected pos 11456 vs 11408"


@pytest.mark.parametrize(
    "failure",
    [RuntimeError(_SHORT_WRITE), OSError(28, "No space left on device")],
    ids=["short_write", "enospc"],
)
def test_export_on_a_full_disk_is_a_checkpoint_error_naming_out_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    import torchrec_lookahead.export as export

    ckpt, out = tmp_path / "c.ckpt", tmp_path / "served.ckpt"
    torch.save({"state_dict": {"model.w": torch.zeros(4)}, "epoch": 0}, ckpt)

    def full(obj: object, path: Path) -> None:
        Path(path).write_bytes(b"half")
        raise failure

    monkeypatch.setattr(export.torch, "save", full)
    with pytest.raises(CheckpointError, match=rf"cannot write --out {out}: no space left .* bytes were free"):
        export_checkpoint(ckpt, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.ckpt"]


def test_export_with_a_full_temporary_directory_says_so_not_that_the_checkpoint_is_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed.checkpoint.format_utils as format_utils

    import torchrec_lookahead.strategies._checkpoint as checkpoint

    ckpt = tmp_path / "c.ckpt"
    ckpt.mkdir()
    for name in ("meta.pt", ".metadata", "__0_0.distcp"):
        (ckpt / name).write_bytes(b"x" * 10)
    monkeypatch.setattr(checkpoint, "load_meta_file", lambda path: {"epoch": 0})
    monkeypatch.setattr(checkpoint, "check_dcp_metadata", lambda path: None)

    def full(src: Path, dst: Path) -> None:
        raise RuntimeError(_SHORT_WRITE)

    monkeypatch.setattr(format_utils, "dcp_to_torch_save", full)
    with pytest.raises(CheckpointError, match=r"temporary directory .* no space left .* set TMPDIR") as info:
        export_checkpoint(ckpt, tmp_path / "o.ckpt")
    assert "cannot read" not in str(info.value)
    assert not (tmp_path / "o.ckpt").exists()


def test_export_against_another_config_is_one_line_naming_the_differences(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchrec_lookahead.export as export

    ckpt = tmp_path / "c.ckpt"
    torch.save({"state_dict": {"model.w": torch.zeros(4), "model.old": torch.zeros(1)}}, ckpt)
    other = torch.nn.Module()
    other.model = torch.nn.Module()
    other.model.w = torch.nn.Parameter(torch.zeros(5))
    other.model.new = torch.nn.Parameter(torch.zeros(1))
    monkeypatch.setattr(export, "_resident_model", lambda config: other)
    with pytest.raises(CheckpointError) as info:
        export_checkpoint(ckpt, tmp_path / "o.ckpt", ["other.yaml"])
    message = str(info.value)
    assert "\n" not in message and "\t" not in message
    assert "does not fit the resident model of the config(s) ['other.yaml']" in message
    assert 'Missing key(s) in state_dict: "model.new"' in message
    assert 'Unexpected key(s) in state_dict: "model.old"' in message
    assert "size mismatch for model.w" in message and message.endswith("with the config that trained it")
    assert not (tmp_path / "o.ckpt").exists()


def test_export_with_no_room_beside_the_checkpoint_for_a_disk_store_scratch_file_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torchrec_lookahead.export as export
    import torchrec_lookahead.store.pieces as pieces_module
    import torchrec_lookahead.strategies._checkpoint as checkpoint
    from torchrec_lookahead.errors import StoreError

    ckpt = tmp_path / "c.ckpt"
    (ckpt / "stores" / "rank0").mkdir(parents=True)
    piece = tmp_path / "t.0.abc.rows"
    piece.write_bytes(b"x" * 64)
    monkeypatch.setattr(checkpoint, "read_chain", lambda ckpt, rank, table: [str(piece)])

    def full(pieces: object, scratch: str) -> None:  # what open_pieces raises on a full disk
        raise StoreError(f"writing the index of '{scratch}/scratch.rows' failed (No space left on device)")

    monkeypatch.setattr(pieces_module, "open_pieces", full)
    state = {"model.sparse_arch.ebc.embedding_bags.t.store_files": 10}
    with pytest.raises(CheckpointError) as info:
        export._tables_from_files(ckpt, state)
    message = str(info.value)
    assert message.startswith(f"cannot export {ckpt}: no space left in {tmp_path} for the scratch file")
    assert "table embedding_bags.t's disk store" in message and "about 64 bytes" in message
    assert "cannot read the chain" not in message

    def damaged(pieces: object, scratch: str) -> None:  # other failures still read as a damaged chain
        raise StoreError("piece is not a checkpoint piece")

    monkeypatch.setattr(pieces_module, "open_pieces", damaged)
    with pytest.raises(CheckpointError, match="cannot read the chain of pieces"):
        export._tables_from_files(ckpt, state)
