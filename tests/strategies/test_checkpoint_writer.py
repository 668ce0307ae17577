"""Writing a checkpoint directory: a full disk."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import torchrec_lookahead.strategies._checkpoint_writer as writer
from torchrec_lookahead.errors import CheckpointError

_SHORT_WRITE = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


def _checkpoint() -> dict:
    return {"state_dict": {"model.w": torch.zeros(10)}, "optimizer_states": [], "epoch": 0}


def test_a_full_disk_under_the_sharded_state_is_one_checkpoint_error_naming_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = tmp_path / "checkpoints" / "epoch=0-step=20.ckpt"
    final.parent.mkdir()

    def full(state: object, checkpoint_id: Path) -> None:
        Path(checkpoint_id).mkdir(parents=True, exist_ok=True)
        raise CheckpointException("failed", {0: (RuntimeError(_SHORT_WRITE), None)})

    monkeypatch.setattr(writer.dcp, "save", full)
    with pytest.raises(CheckpointError) as info:
        writer.write_checkpoint(_checkpoint(), final, None, 0, 1, 1, None)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        f"cannot write the checkpoint {final}: no space left on the disk of {final.parent}"
    )
    assert "takes about 40 bytes" in message and "bytes were free there" in message
    assert sorted(p.name for p in final.parent.iterdir()) == []


def test_a_full_disk_under_the_lightning_part_is_one_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = tmp_path / "last.ckpt"
    monkeypatch.setattr(writer.dcp, "save", lambda state, checkpoint_id: None)

    def full(obj: object, path: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer.torch, "save", full)
    with pytest.raises(CheckpointError, match=r"no space left on the disk of .* bytes were free there"):
        writer.write_checkpoint(_checkpoint(), final, None, 0, 1, 1, None)
    assert not final.exists()


def test_other_failures_are_left_as_they_are(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(state: object, checkpoint_id: Path) -> None:
        raise ValueError("something else")

    monkeypatch.setattr(writer.dcp, "save", broken)
    with pytest.raises(ValueError, match="something else"):
        writer.write_checkpoint(_checkpoint(), tmp_path / "c.ckpt", None, 0, 1, 1, None)
