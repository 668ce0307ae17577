"""Checkpoints of cached tables: a run whose checkpoints cannot be held in memory is refused before training;
tables in disk stores are kept as copies of their files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List

import lightning.pytorch as pl
import pytest
import torch

from torchrec_lookahead.errors import CheckpointError
from torchrec_lookahead.store import TensorStore
from torchrec_lookahead.strategies import _checkpoint
from torchrec_lookahead.strategies._checkpoint import checkpoint_memory_shortfall

from ..helpers import fit_cached


def test_the_estimate_counts_every_table_the_largest_twice_and_every_rank_of_the_machine() -> None:
    stores = [TensorStore(n, 8, {"momentum1": 1}, name=f"t{n}") for n in (100, 300)]
    need = (100 + 300 + 300) * 9 * 4
    assert checkpoint_memory_shortfall(stores, available=need) is None
    assert checkpoint_memory_shortfall(stores, processes=2, available=2 * need) is None
    message = checkpoint_memory_shortfall(stores, processes=2, available=2 * need - 1)
    assert message is not None and message.startswith("checkpoints hold the cached tables in full")
    assert "t300" in message and "2 rank(s)" in message and "enable_checkpointing=false" in message
    assert checkpoint_memory_shortfall([], available=0) is None


class _Steps(pl.Callback):
    def __init__(self) -> None:
        self.started: List[int] = []

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        self.started.append(trainer.global_step)


def _fit(path: Path, steps: _Steps, store: str, **trainer_kw: Any) -> Any:
    sharder: Dict[str, Any] = {"store": store}
    if store == "disk":
        sharder.update(store_dir=str(path / "stores"), host_budget_bytes=64 * 1024)
    return fit_cached(path, 3, capacity={"t_cat_2": 140}, sharder_kw=sharder, callbacks=[steps], **trainer_kw)


def test_checkpoints_larger_than_memory_are_refused_before_the_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpoints on (Lightning's default) and too little memory for the tables in RAM stores: a short
    CheckpointError before any step, instead of running out of memory at the first checkpoint. Without
    checkpoints the same run trains; so does it with the tables in disk stores, whose checkpoints keep copies
    of their files instead (saved at the end of the run here)."""
    monkeypatch.setattr(_checkpoint, "memory_available", lambda: 1000)
    steps = _Steps()
    with pytest.raises(CheckpointError, match="checkpoints hold the cached tables in full") as info:
        _fit(tmp_path / "refused", steps, "ram")
    assert steps.started == [] and "t_cat_2" in str(info.value)
    steps = _Steps()
    trainer, _ = _fit(tmp_path / "trains", steps, "ram", enable_checkpointing=False)
    assert trainer.global_step == 3 and steps.started == [0, 1, 2]
    steps = _Steps()
    trainer, _ = _fit(tmp_path / "disk", steps, "disk")
    assert trainer.global_step == 3 and steps.started == [0, 1, 2]
    saved = list((tmp_path / "disk").glob("**/*.ckpt/stores/rank0/embedding_bags.t_cat_2/chain.json"))
    assert len(saved) == 1
    assert (
        len(list(saved[0].parents[4].glob(".store_pieces/rank0/embedding_bags.t_cat_2/t_cat_2.0.*.rows")))
        == 1
    )


def test_a_missing_or_foreign_copy_of_a_disk_store_is_a_checkpoint_error(tmp_path: Path) -> None:
    from torchrec_lookahead.modules.checkpoint_files import StoreFiles
    from torchrec_lookahead.store import DiskStore
    from torchrec_lookahead.strategies._checkpoint import load_store_files, save_store_files

    def store(seed: int) -> DiskStore:
        return DiskStore(tmp_path / f"s{seed}" / "t.rows", 100, 4, name="t", seed=seed, host_budget_bytes=160,
                         preallocate=False)  # fmt: skip

    files = StoreFiles()
    files.add("embedding_bags.t", store(0))
    with pytest.raises(
        CheckpointError, match="lacks .*chain.json: it holds no copy of table embedding_bags.t"
    ):
        load_store_files(files, tmp_path / "ckpt", 0)
    other = StoreFiles()
    other.add("embedding_bags.t", store(1))
    for write in save_store_files(other, tmp_path / "ckpt", 0, 1):  # the pieces, taken, then written
        write()
    with pytest.raises(CheckpointError, match="seed: piece 1, store 0"):
        load_store_files(files, tmp_path / "ckpt", 0)
    with pytest.raises(CheckpointError, match="two cached tables are named 'embedding_bags.t'"):
        files.add("embedding_bags.t", store(2))


@pytest.mark.parametrize("background", [False, True])
def test_chains_survive_retention_and_resume_bit_for_bit_from_an_older_delta(
    tmp_path: Path, background: bool
) -> None:
    """ModelCheckpoint deletes checkpoints through the strategy: every kept checkpoint's chain stays whole, the
    pieces no kept checkpoint names go. Resuming from a delta of an older chain equals the uninterrupted run;
    a chain with a missing piece is refused naming it. With the deltas written in the background
    (``async_checkpoints``), every checkpoint is whole when fit returns."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ..helpers import weights

    d = tmp_path / "ckpt"
    keep = ModelCheckpoint(dirpath=d, every_n_train_steps=2, save_top_k=-1, filename="kept-{step}")
    latest = ModelCheckpoint(dirpath=d, every_n_train_steps=1, save_top_k=1, save_last=True)
    disk = {"store": "disk", "host_budget_bytes": 64 * 1024}
    strategy_kw = {"full_checkpoint_every": 3, "async_checkpoints": background}
    kw: Dict[str, Any] = {"capacity": {"t_cat_2": 140}, "strategy_kw": strategy_kw}
    _, full = fit_cached(tmp_path / "a", 6, sharder_kw={**disk, "store_dir": str(tmp_path / "a_st")},
                         callbacks=[keep, latest], **kw)  # fmt: skip
    kept = sorted(p.name for p in d.iterdir() if p.name.endswith(".ckpt"))
    assert kept == [
        "epoch=0-step=6.ckpt",
        "kept-step=2.ckpt",
        "kept-step=4.ckpt",
        "kept-step=6.ckpt",
        "last.ckpt",
    ]
    chains = {n: _checkpoint.read_chain(d / n, 0, "embedding_bags.t_cat_2") for n in kept}
    assert all(_checkpoint.read_checkpoint_meta(d / n, 1) is not None for n in kept)
    # a tiny table: each delta is as large as a full piece, so a chain closes after one delta here
    older = next(n for n in ("kept-step=2.ckpt", "kept-step=4.ckpt") if len(chains[n]) == 2)
    named = {Path(p).name for c in chains.values() for p in c}
    pool = d / ".store_pieces" / "rank0" / "embedding_bags.t_cat_2"
    assert {p.name for p in pool.iterdir()} == named | {n + ".npz" for n in named}  # the deleted ones' went
    _, resumed = fit_cached(tmp_path / "b", 6, sharder_kw={**disk, "store_dir": str(tmp_path / "b_st")},
                            ckpt_path=str(d / older), **kw)  # fmt: skip
    a, b = weights(full), weights(resumed)
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    os.unlink(chains[older][0])
    with pytest.raises(CheckpointError, match=f"piece '{chains[older][0]}' is missing"):
        fit_cached(tmp_path / "c", 6, sharder_kw={**disk, "store_dir": str(tmp_path / "c_st")},
                   ckpt_path=str(d / older), **kw)  # fmt: skip


def test_in_memory_stores_checkpoint_deltas_and_resume_and_export_from_an_older_one_bit_for_bit(
    tmp_path: Path,
) -> None:
    """incremental_ram_stores: a RAM store's checkpoints are chains of the rows written between them; resuming
    from a delta of an older chain equals the uninterrupted run, and `export` reads a chain into whole tables."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from torchrec_lookahead.export import _load_whole

    from ..helpers import weights

    def fit(name: str, **extra: Any) -> Any:
        every = ModelCheckpoint(dirpath=tmp_path / f"{name}_ckpt", every_n_train_steps=1, save_top_k=-1)
        return fit_cached(tmp_path / name, 6, capacity={"t_cat_2": 140}, sharder_kw={"store": "ram"},
                          strategy_kw={"full_checkpoint_every": 3, "incremental_ram_stores": True},
                          callbacks=[every], **extra)[1]  # fmt: skip

    full = fit("a")
    d = tmp_path / "a_ckpt"
    lengths = [len(_checkpoint.read_chain(d / f"epoch=0-step={s}.ckpt", 0, "embedding_bags.t_cat_2")) for s in
               range(1, 7)]  # fmt: skip
    assert lengths == [1, 2, 3, 1, 2, 3], lengths
    resumed = fit("b", ckpt_path=str(d / "epoch=0-step=3.ckpt"))
    a, b = weights(full), weights(resumed)
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    ends = [_load_whole(tmp_path / f"{r}_ckpt" / "epoch=0-step=6.ckpt")["state_dict"] for r in "ab"]
    key = next(k for k in ends[0] if k.endswith("embedding_bags.t_cat_2.weight"))
    assert ends[0].keys() == ends[1].keys() and all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])
    assert ends[0][key].shape[0] > 140  # the whole table, not the cache


def test_a_checkpoint_that_fails_part_way_leaves_nothing_behind_and_the_earlier_one_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from torchrec_lookahead.errors import StoreError
    from torchrec_lookahead.store import DiskStore

    real = DiskStore.snapshot_files
    calls: List[int] = []

    def fails_second(self: DiskStore, directory: str, max_chain: int = 1) -> Any:
        calls.append(1)
        chain, write = real(self, directory, max_chain)
        if len(calls) == 2:  # a piece written, then the disk fills
            if write is not None:
                write()
            open(chain[-1] + ".stray", "w").close()
            raise StoreError("no room for the checkpoint piece (test)")
        return chain, write

    monkeypatch.setattr(DiskStore, "snapshot_files", fails_second)
    d = tmp_path / "ckpt"
    every = ModelCheckpoint(dirpath=d, every_n_train_steps=2, save_top_k=-1)
    disk = {"store": "disk", "store_dir": str(tmp_path / "stores"), "host_budget_bytes": 64 * 1024}
    with pytest.raises(StoreError, match="no room"):
        fit_cached(tmp_path / "run", 6, capacity={"t_cat_2": 140}, sharder_kw=disk, callbacks=[every])
    assert sorted(p.name for p in d.iterdir()) == [".store_pieces", "epoch=0-step=2.ckpt"]
    (chain,) = [_checkpoint.read_chain(d / "epoch=0-step=2.ckpt", 0, "embedding_bags.t_cat_2")]
    left = {p.name for p in (d / ".store_pieces" / "rank0" / "embedding_bags.t_cat_2").iterdir()}
    assert left == {Path(chain[0]).name, Path(chain[0]).name + ".npz"}
    assert _checkpoint.read_checkpoint_meta(d / "epoch=0-step=2.ckpt", 1)
    os.unlink(d / "epoch=0-step=2.ckpt" / "meta.pt")  # as a process killed before its last file
    with pytest.raises(CheckpointError, match="epoch=0-step=2.ckpt is incomplete: its meta.pt, written last"):
        _checkpoint.read_checkpoint_meta(d / "epoch=0-step=2.ckpt", 1)


def test_a_background_writer_runs_one_checkpoint_at_a_time_and_raises_its_failure_at_the_next_wait() -> None:
    import threading

    from torchrec_lookahead.errors import StoreError
    from torchrec_lookahead.strategies._checkpoint_writer import PiecesWriter

    writer, order, gate = PiecesWriter(), [], threading.Event()
    writer.start(lambda: (gate.wait(5), order.append(1)))
    gate.set()
    writer.start(lambda: order.append(2))  # waits for the first
    writer.wait()
    assert order == [1, 2]

    def fails() -> None:
        raise StoreError("no room for the checkpoint piece (test)")

    writer.start(fails)
    with pytest.raises(StoreError, match="no room"):
        writer.wait()
    writer.wait()  # raised once


def test_an_in_memory_store_the_ranks_of_a_host_share_cannot_keep_pieces(tmp_path: Path) -> None:
    from torchrec_lookahead.distributed._stores import HostSharedStore
    from torchrec_lookahead.errors import ConfigError

    shared = HostSharedStore(tmp_path / "t.bin", 100, 4, {"momentum1": 1}, name="t")
    with pytest.raises(ConfigError, match="ranks of this host share.*store_sharding: row_wise"):
        _checkpoint.keep_store_files([shared])


def test_a_checkpoint_of_an_earlier_release_still_loads(tmp_path: Path) -> None:
    """Before chains, a checkpoint kept a copy of each disk store's whole file in the table's directory
    (``stores/rank<r>/<key>/<table>.<row offset>.rows``, no chain file): it loads as a chain of that one copy."""
    import shutil

    from torchrec_lookahead.modules.checkpoint_files import StoreFiles
    from torchrec_lookahead.store import DiskStore
    from torchrec_lookahead.strategies._checkpoint import load_store_files

    def store(where: str) -> DiskStore:
        return DiskStore(tmp_path / where / "t.rows", 100, 4, name="t", seed=0, host_budget_bytes=160,
                         preallocate=False)  # fmt: skip

    old = store("old")
    old.load(torch.arange(400, dtype=torch.float32).view(100, 4))
    old.flush()
    table = tmp_path / "ckpt" / "stores" / "rank0" / "embedding_bags.t"
    table.mkdir(parents=True)
    shutil.copyfile(old.path, table / "t.0.rows")  # what the earlier release copied: the flushed file
    files = StoreFiles()
    new = store("new")
    files.add("embedding_bags.t", new)
    load_store_files(files, tmp_path / "ckpt", 0)
    assert torch.equal(new.full_weights(), old.full_weights())
    with open(table / "t.0.rows", "r+b") as f:  # a damaged copy is refused, named
        f.truncate(4096)
    with pytest.raises(CheckpointError, match="t.0.rows' is not a copy of disk store"):
        load_store_files(files, tmp_path / "ckpt", 0)
    old.close()
    new.close()


class _Killed(Exception):
    """A process killed while a checkpoint is being written (raised where the kill falls)."""


@pytest.mark.parametrize("background", [False, True])
def test_a_process_killed_while_last_ckpt_is_rewritten_leaves_the_previous_one_to_resume_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: bool
) -> None:
    """A checkpoint is written under another name and renamed once whole. Killed before step 6's last.ckpt is
    (its Lightning part not yet written), the run leaves step 4's last.ckpt whole, the partial one refused as
    incomplete; ``ckpt_path="last"`` resumes from step 4 to the uninterrupted run's weights, bit for bit, and
    its first checkpoint removes what the killed one left."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from torchrec_lookahead.strategies import _checkpoint_writer

    from ..helpers import weights

    disk = {"store": "disk", "host_budget_bytes": 64 * 1024}
    strategy_kw = {"full_checkpoint_every": 3, "async_checkpoints": background}
    d = tmp_path / "b_ckpt"

    def fit(name: str, ckpt_dir: Path, ckpt_path: Any = None) -> Any:
        every = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_last=True)
        return fit_cached(tmp_path / name, 6, capacity={"t_cat_2": 140}, strategy_kw=strategy_kw,
                          sharder_kw={**disk, "store_dir": str(tmp_path / f"{name}_st")}, callbacks=[every],
                          ckpt_path=ckpt_path)[1]  # fmt: skip

    full = fit("a", tmp_path / "a_ckpt")
    publish = _checkpoint_writer.publish

    def killed_at_step_6(writing: Path, final: Path) -> None:
        if (
            final.name == "last.ckpt"
            and torch.load(writing / "meta.pt", weights_only=False)["global_step"] == 6
        ):
            os.unlink(writing / "meta.pt")  # as if killed before its last file
            raise _Killed
        publish(writing, final)

    with monkeypatch.context() as m:
        m.setattr(_checkpoint_writer, "publish", killed_at_step_6)
        m.setattr(_checkpoint_writer, "_remove", lambda path, rank: None)  # a killed process cleans nothing
        with pytest.raises(_Killed):
            fit("b", d)
    (left,) = d.glob(".writing-*")
    with pytest.raises(CheckpointError, match="is incomplete: its meta.pt, written last, is missing"):
        _checkpoint.read_checkpoint_meta(left, 1)
    assert _checkpoint.read_checkpoint_meta(d / "last.ckpt", 1)["global_step"] == 4
    resumed = fit("b2", d, ckpt_path="last")
    a, b = weights(full), weights(resumed)
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    assert not list(d.glob(".writing-*"))
    assert _checkpoint.read_checkpoint_meta(d / "last.ckpt", 1)["global_step"] == 6


@pytest.mark.parametrize("exchange", [True, False], ids=["one-swap", "two-renames"])
def test_publish_replaces_a_checkpoint_whole_and_never_leaves_its_name_empty(tmp_path, monkeypatch, exchange):
    """With two renames a process killed between them left no ``last.ckpt`` (the previous one only under the
    writing name's ``.old``): a resume with ``ckpt_path=last`` started from step 0 and the next checkpoint removed
    that copy. Where the filesystem can, the two swap in one step; elsewhere the two renames remain."""
    final, writing = tmp_path / "last.ckpt", tmp_path / ".writing-0123"
    for path, step in ((final, "4"), (writing, "6")):
        path.mkdir()
        (path / "meta.pt").write_text(step)
    renames = []
    rename = os.rename
    monkeypatch.setattr(os, "rename", lambda a, b: (renames.append((a, b)), rename(a, b)))
    if not exchange:
        monkeypatch.setattr(_checkpoint, "_exchange", lambda a, b: False)
    _checkpoint.publish(writing, final)
    assert (final / "meta.pt").read_text() == "6" and sorted(p.name for p in tmp_path.iterdir()) == [
        "last.ckpt"
    ]
    probe = [tmp_path.parent / f"{tmp_path.name}-probe-{i}" for i in (0, 1)]
    for p in probe:
        p.mkdir()
    swaps = _checkpoint._exchange(*probe)  # whether this platform and filesystem can swap two paths
    if exchange and swaps:
        assert renames == []  # one atomic swap: no moment without last.ckpt
    else:
        assert [Path(b).name for _, b in renames] == [".writing-0123.old", "last.ckpt"]
    (tmp_path / ".writing-4567").mkdir()  # a first checkpoint of its name: one rename
    _checkpoint.publish(tmp_path / ".writing-4567", tmp_path / "epoch=0-step=8.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=0-step=8.ckpt", "last.ckpt"]
