"""Checkpoint pieces of in-memory stores: the rows written since the previous piece, tracked as they are
written; any chain read back equals the store when it was saved; refusals name the piece."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, List, Tuple

import pytest
import torch

from torchrec_lookahead.errors import ConfigError, StoreError
from torchrec_lookahead.store import MmapStore, TensorStore
from torchrec_lookahead.store import _row_chain as row_chain

N, D = 20000, 4
WIDTHS = {"momentum1": 1}


def _same(a: Any, b: Any) -> bool:
    return torch.equal(a.full_weights(), b.full_weights()) and torch.equal(
        a.full_states()["momentum1"], b.full_states()["momentum1"]
    )


@pytest.mark.parametrize("kind", ["ram", "mmap"])
def test_any_checkpoint_of_a_chain_reads_back_the_store_as_it_was(tmp_path: Path, kind: str) -> None:
    def make(name: str) -> Any:
        if kind == "mmap":
            return MmapStore(tmp_path / f"{name}.bin", N, D, WIDTHS, name="t", seed=3)
        return TensorStore(N, D, WIDTHS, name="t", seed=3)

    store = make("run")
    store.keep_files()
    g = torch.Generator().manual_seed(0)
    kept: List[Tuple[List[str], Any]] = []
    for step in range(12):
        ids = torch.randint(0, N // 8 if step % 3 else N, (300,), generator=g).unique()
        store.scatter(
            ids, torch.randn(ids.numel(), D, generator=g), {"momentum1": torch.rand(ids.numel(), 1)}
        )
        then = TensorStore(N, D, WIDTHS, name="t", seed=3)
        then.load(store.full_weights(), store.full_states())
        kept.append((store.save_files(str(tmp_path / "pieces"), max_chain=4), then))
    lengths = [len(c) for c, _ in kept]
    assert lengths == [1, 2, 3, 4] * 3, lengths
    full, delta = os.path.getsize(kept[0][0][0]), os.path.getsize(kept[1][0][1])
    assert delta * 5 < full, (delta, full)  # a delta holds the ~300 rows written, the full every row touched
    fresh = make("fresh")
    for chain, then in kept[::-1]:
        fresh.load_files(chain)
        assert _same(fresh, then)
    assert (
        store.save_files(str(tmp_path / "pieces"), max_chain=4) == kept[-1][0]
    )  # nothing written: same chain


@pytest.mark.parametrize("concurrent", [False, True])
def test_a_piece_written_while_the_store_goes_on_reads_back_the_store_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, concurrent: bool
) -> None:
    """Pieces taken, then written after (or while) the next rows are written: a full piece saves the old value
    of a row written before it has copied the row's block, so every piece reads back the store as it was when
    taken."""
    monkeypatch.setattr(row_chain, "_BLOCK_ROWS", 1000)  # pieces of many blocks
    store = TensorStore(N, D, WIDTHS, name="t", seed=3)
    store.keep_files()
    g = torch.Generator().manual_seed(0)
    kept: List[Tuple[List[str], Any]] = []

    def write(batches: int) -> None:
        for _ in range(batches):
            ids = torch.randint(0, N, (200,), generator=g).unique()
            store.scatter(
                ids, torch.randn(ids.numel(), D, generator=g), {"momentum1": torch.rand(ids.numel(), 1)}
            )

    for _ in range(6):
        write(4)
        chain, pending = store.snapshot_files(str(tmp_path / "pieces"), max_chain=3)
        then = TensorStore(N, D, WIDTHS, name="t", seed=3)
        then.load(store.full_weights(), store.full_states())
        kept.append((chain, then))
        writer = threading.Thread(target=pending) if pending is not None and concurrent else None
        if writer is not None:
            writer.start()
        write(8)  # meanwhile
        if writer is not None:
            writer.join()
        elif pending is not None:
            pending()
        assert store._snapshot is None  # the piece let go of the rows
    assert [len(c) for c, _ in kept] == [1, 2, 3, 1, 2, 3]
    fresh = TensorStore(N, D, WIDTHS, name="t", seed=3)
    for chain, then in kept:
        fresh.load_files(chain)
        assert _same(fresh, then)


def test_pieces_are_refused_when_missing_foreign_or_partial_and_a_full_disk_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = TensorStore(N, D, WIDTHS, name="t", seed=3)
    with pytest.raises(ConfigError, match="call keep_files"):
        store.save_files(str(tmp_path))
    store.keep_files()
    store.scatter(torch.tensor([1, 2]), torch.ones(2, D), {"momentum1": torch.ones(2, 1)})
    chain = store.save_files(str(tmp_path / "p"), max_chain=2)
    other = TensorStore(N, D, WIDTHS, name="t", seed=4)
    with pytest.raises(ConfigError, match="seed: piece 3, store 4"):
        other.load_files(chain)
    os.unlink(chain[0] + ".npz")
    with pytest.raises(ConfigError, match="is partial"):
        store.load_files(chain)
    os.unlink(chain[0])
    with pytest.raises(ConfigError, match=f"piece '{chain[0]}' is missing"):
        store.load_files(chain)

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(StoreError, match="No space left on device; it needs .* bytes"):
        store.save_files(str(tmp_path / "full"), max_chain=2)
    assert list((tmp_path / "full").iterdir()) == []


def test_too_little_room_is_refused_before_writing_naming_the_needed_and_free_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchrec_lookahead.store import DiskStore, _disk_chain

    disk = DiskStore(
        tmp_path / "t.rows", N, D, WIDTHS, name="t", seed=3, host_budget_bytes=4096, preallocate=False
    )
    ram = TensorStore(N, D, WIDTHS, name="t", seed=3)
    ram.keep_files()
    monkeypatch.setattr(_disk_chain, "free_bytes", lambda path: 1000)
    for store in (disk, ram):
        store.scatter(torch.tensor([1, 2]), torch.ones(2, D), {"momentum1": torch.ones(2, 1)})
        with pytest.raises(StoreError, match="needs [0-9,]+ bytes, 1,000 are free"):
            store.save_files(str(tmp_path / "p"))
    assert not (tmp_path / "p").exists() or list((tmp_path / "p").iterdir()) == []
    assert disk.gather(torch.tensor([1]))[0].tolist() == [[1.0] * D]
    disk.close()
