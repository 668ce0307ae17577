"""DiskStore: equal to TensorStore on random gather/scatter sequences, lazy blocks, reopen, refusals, budget,
faults (unwritable directory, no direct I/O, a full disk)."""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from torchrec_lookahead.errors import ConfigError, DataError, InvalidIdError, SetupError, StoreError
from torchrec_lookahead.store import DiskStore, TensorStore, init_rows
from torchrec_lookahead.store.init import INIT_BLOCK_ROWS

N, D = 20000, 4  # three blocks of 8192 rows
WIDTHS = {"momentum1": D, "momentum2": 1}
ROW_BYTES = (D + D + 1) * 4


def _disk(path: Path, budget_rows: int = 300, **kwargs: Any) -> DiskStore:
    return DiskStore(
        path, N, D, WIDTHS, name="t", seed=5, host_budget_bytes=budget_rows * ROW_BYTES, **kwargs
    )


def _equal(a: DiskStore, b: TensorStore) -> None:
    assert torch.equal(a.full_weights(), b.full_weights())
    sa, sb = a.full_states(), b.full_states()
    assert set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sb)


@pytest.mark.parametrize("budget_rows", [1, 64, 300, N])
def test_random_sequence_equals_tensor_store(tmp_path: Path, budget_rows: int) -> None:
    disk = _disk(tmp_path / "t.rows", budget_rows)
    ref = TensorStore(N, D, WIDTHS, name="t", seed=5, chunk_rows=INIT_BLOCK_ROWS)
    gen = torch.Generator().manual_seed(0)
    for step in range(60):
        n = int(torch.randint(1, 400, (1,), generator=gen))
        hot = torch.randint(0, 500, (n,), generator=gen)  # a reused head and a long tail
        tail = torch.randint(0, N, (n,), generator=gen)
        ids = torch.where(torch.rand(n, generator=gen) < 0.6, hot, tail)
        w, s = disk.gather(ids)
        rw, rs = ref.gather(ids)
        assert torch.equal(w, rw) and all(torch.equal(s[k], rs[k]) for k in rs), step
        upd = torch.unique(ids)
        weights = torch.randn(upd.numel(), D, generator=gen)
        states = {
            "momentum1": torch.rand(upd.numel(), D, generator=gen),
            "momentum2": torch.rand(upd.numel()),
        }
        if step % 2:
            disk.scatter(upd, weights, states)
        else:
            disk.write_back(upd, weights, states)
        ref.scatter(upd, weights, states)
        assert disk.stats()["host_rows"] <= disk.host_capacity <= budget_rows
    _equal(disk, ref)
    disk.flush()
    disk.close()
    again = DiskStore.open(tmp_path / "t.rows", host_budget_bytes=10 * ROW_BYTES)
    _equal(again, ref)
    again.close()


def test_rows_never_written_are_computed_not_read(tmp_path: Path) -> None:
    """A row never written is its initial value, computed without I/O; the file takes only written rows, appended
    packed to its log (rows written together share units) and never read before a write."""
    disk = _disk(tmp_path / "t.rows")
    ids = torch.tensor([0, 19999, 8192, 8191, 0])
    w, s = disk.gather(ids)
    assert torch.equal(w, init_rows(5, "t", 0, N, D, N)[ids])
    assert all(float(v.abs().sum()) == 0.0 for v in s.values())
    st = disk.stats()
    assert st["rows_initialised"] == 4 and st["rows_read"] == 0 and st["bytes_read"] == 0
    assert st["rows_on_disk"] == 0
    rows = torch.tensor([1, 2, 8200])
    disk.scatter(rows, torch.full((3, D), 2.0), {k: torch.ones(3, v) for k, v in WIDTHS.items()})
    disk.flush()  # the host tier keeps the rows; flush appends them: one unit, not read first
    st = disk.stats()
    assert st["rows_on_disk"] == 3 and st["unit_reads"] == 0 and st["unit_writes"] == 1
    disk.close()
    disk = DiskStore.open(tmp_path / "t.rows", host_budget_bytes=10 * ROW_BYTES)
    w, _ = disk.gather(torch.tensor([0, 1, 2, 8200, 8201]))  # 1, 2 and 8200 written together: one unit
    assert torch.equal(w[[1, 2, 3]], torch.full((3, D), 2.0))
    assert torch.equal(w[[0, 4]], init_rows(5, "t", 0, N, D, N)[[0, 8201]])
    st = disk.stats()
    assert st["rows_read"] == 3 and st["rows_initialised"] == 2 and st["unit_reads"] == 1
    disk.scatter(torch.tensor([3]), torch.full((1, D), 3.0), {k: torch.ones(1, v) for k, v in WIDTHS.items()})
    disk.close()  # row 3 goes to a unit of its own: no read first
    assert disk.stats()["unit_reads"] == 1
    disk = DiskStore.open(tmp_path / "t.rows", host_budget_bytes=10 * ROW_BYTES)
    assert torch.equal(disk.gather(torch.tensor([1, 3]))[0], torch.tensor([[2.0] * D, [3.0] * D]))
    assert torch.equal(disk.full_weights()[[0, 4, 8201]], init_rows(5, "t", 0, N, D, N)[[0, 4, 8201]])
    disk.close()
    # a shard's rows never written are the whole table's initial rows
    shard = DiskStore(tmp_path / "s.rows", 1000, D, name="t", seed=5, row_offset=8000, table_rows=N,
                      host_budget_bytes=4096)  # fmt: skip
    assert torch.equal(shard.gather(torch.arange(1000))[0], init_rows(5, "t", 8000, 9000, D, N))
    assert torch.equal(shard.full_weights(), init_rows(5, "t", 8000, 9000, D, N))
    shard.close()
    # a shard's initial rows are the whole table's
    shard = DiskStore(tmp_path / "s.rows", 1000, D, name="t", seed=5, row_offset=8000, table_rows=N,
                      host_budget_bytes=4096)  # fmt: skip
    assert torch.equal(shard.gather(torch.arange(1000))[0], init_rows(5, "t", 8000, 9000, D, N))
    disk.close()
    shard.close()


def _set_header(path: Path, **fields: Any) -> None:
    """Rewrite fields of a disk store file's header (magic, length, JSON)."""
    with open(path, "r+b") as f:
        head = f.read(4096)
        n = int.from_bytes(head[8:12], "little")
        meta = {**json.loads(head[12 : 12 + n]), **fields}
        body = json.dumps(meta, sort_keys=True).encode()
        f.seek(0)
        f.write(head[:8] + len(body).to_bytes(4, "little") + body + b"\0" * (4096 - 12 - len(body)))


def test_reopen_keeps_rows_and_refuses_another_table(tmp_path: Path) -> None:
    path = tmp_path / "t.rows"
    disk = _disk(path)
    disk.scatter(
        torch.tensor([7, 12345]),
        torch.ones(2, D),
        {"momentum1": torch.ones(2, D), "momentum2": torch.ones(2)},
    )
    disk.close()
    with pytest.raises(ConfigError, match="seed: file 5, asked 6"):
        DiskStore(path, N, D, WIDTHS, name="t", seed=6)
    with pytest.raises(ConfigError, match="name: file 't', asked 'u'"):
        DiskStore(path, N, D, WIDTHS, name="u", seed=5)
    with pytest.raises(ConfigError, match="num_embeddings: file 20000, asked 20001"):
        DiskStore(path, N + 1, D, WIDTHS, name="t", seed=5)
    with pytest.raises(ConfigError, match="state_widths"):
        DiskStore(path, N, D, {"momentum1": D}, name="t", seed=5)
    again = _disk(path)
    assert again.gather(torch.tensor([12345]))[0].tolist() == [[1.0] * D]
    again.close()
    for old in (1, 2):  # files of the former formats (flags per block, then per row; rows in place): refused
        _set_header(path, version=old)
        with pytest.raises(
            ConfigError, match=f"version {old}; this version reads .* version 3: delete the file"
        ):
            _disk(path)
    _set_header(path, version=3)
    with open(path, "r+b") as f:  # truncated
        f.truncate(os.path.getsize(path) - 4096)
    with pytest.raises(ConfigError, match="truncated or foreign"):
        _disk(path)
    (tmp_path / "other.rows").write_bytes(b"x" * 8192)
    with pytest.raises(ConfigError, match="not a disk store file"):
        DiskStore.open(tmp_path / "other.rows")
    with open(path, "r+b") as f:  # cut inside its JSON header: a JSONDecodeError traceback before
        f.truncate(100)
    with pytest.raises(
        ConfigError, match="has a damaged .* header \\(JSONDecodeError\\): the file is truncated"
    ):
        DiskStore.open(path)
    with pytest.raises(ConfigError, match="no disk store"):
        DiskStore.open(tmp_path / "missing.rows")


def test_bad_input_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    disk = _disk(tmp_path / "t.rows")
    with pytest.raises(ConfigError, match="at least one row"):
        DiskStore(tmp_path / "u.rows", N, D, WIDTHS, name="u", host_budget_bytes=ROW_BYTES - 1)
    with pytest.raises(InvalidIdError, match="out of range"):
        disk.gather(torch.tensor([N]))
    with pytest.raises(InvalidIdError, match="repeated"):
        disk.scatter(torch.tensor([1, 1]), torch.ones(2, D), {k: torch.ones(2, w) for k, w in WIDTHS.items()})
    with pytest.raises(DataError, match="must have shape"):
        disk.scatter(
            torch.tensor([1]), torch.ones(1, D + 1), {k: torch.ones(1, w) for k, w in WIDTHS.items()}
        )
    with pytest.raises(DataError):
        disk.load(torch.zeros(N - 1, D))
    assert disk.stats()["rows_on_disk"] == 0
    disk.close()
    with pytest.raises(ConfigError, match="closed"):
        disk.gather(torch.tensor([1]))


def test_load_then_full_tables(tmp_path: Path) -> None:
    disk = _disk(tmp_path / "t.rows")
    w = torch.randn(N, D)
    disk.gather(torch.tensor([3]))  # a row in the host tier is replaced too
    disk.load(w, {"momentum1": torch.ones(N, D)})
    assert torch.equal(disk.full_weights(), w) and torch.equal(disk.gather(torch.tensor([3]))[0], w[3:4])
    assert float(disk.full_states()["momentum1"].sum()) == N * D
    assert float(disk.full_states()["momentum2"].abs().sum()) == 0.0
    disk.close()


def test_concurrent_gathers_and_writes_on_disjoint_ids(tmp_path: Path) -> None:
    disk = _disk(tmp_path / "t.rows", budget_rows=100)
    ref = TensorStore(N, D, WIDTHS, name="t", seed=5)
    errors = []

    def writer() -> None:
        try:
            for i in range(50):
                ids = torch.arange(10000 + i * 20, 10000 + i * 20 + 20)
                disk.write_back(
                    ids, torch.full((20, D), float(i)), {k: torch.ones(20, w) for k, w in WIDTHS.items()}
                )
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=writer)
    t.start()
    for i in range(50):
        ids = torch.arange(i * 100, i * 100 + 100)
        assert torch.equal(disk.gather(ids)[0], ref.gather(ids)[0])
    t.join()
    assert not errors
    assert torch.equal(disk.gather(torch.tensor([10999]))[0], torch.full((1, D), 49.0))
    disk.close()


def test_unwritable_directory_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SetupError, match="not writable"):
        DiskStore(blocker / "t.rows", N, D, name="t")


def test_no_direct_io_falls_back_with_a_warning_or_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = os.open

    def refuse_direct(path: str, flags: int, *args: object) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refuse_direct)
    with pytest.raises(SetupError, match="refuses direct I/O"):
        _disk(tmp_path / "a.rows", direct_io=True)
    with caplog.at_level(logging.WARNING):
        disk = _disk(tmp_path / "b.rows")
    assert not disk.direct_io and "falling back to buffered I/O" in caplog.text
    assert torch.equal(disk.gather(torch.tensor([4]))[0], init_rows(5, "t", 4, 5, D, N))
    disk.close()


def test_the_log_wraps_and_its_cleaner_keeps_every_row(tmp_path: Path) -> None:
    """Every row of a small table written over and over: the log fills, the cleaner moves the live rows off its
    tail and the ring wraps several times; the values equal a TensorStore's throughout, after a reopen, and after
    reading back any checkpoint of a chain of incremental pieces made along the way (full every fourth)."""
    n = 3000
    disk = DiskStore(tmp_path / "t.rows", n, D, WIDTHS, name="t", seed=5, host_budget_bytes=200 * ROW_BYTES,
                     preallocate=False)  # fmt: skip
    ref = TensorStore(n, D, WIDTHS, name="t", seed=5)
    kept: list = []  # (chain, the table then)
    g = torch.Generator().manual_seed(1)
    for step in range(60):
        ids = torch.randint(0, n // (4 if step % 10 < 5 else 1), (500,), generator=g)
        got, want = disk.gather(ids), ref.gather(ids)
        assert torch.equal(got[0], want[0]) and all(torch.equal(got[1][k], want[1][k]) for k in WIDTHS)
        rows = ids.unique()
        new = torch.randn(rows.numel(), D, generator=g)
        states = {
            "momentum1": torch.rand(rows.numel(), D, generator=g),
            "momentum2": torch.rand(rows.numel()),
        }
        disk.scatter(rows, new, states)
        ref.scatter(rows, new, states)
        if step % 5 == 4:
            then = TensorStore(n, D, WIDTHS, name="t", seed=5)
            then.load(ref.full_weights(), ref.full_states())
            kept.append((disk.save_files(str(tmp_path / "ckpt"), max_chain=4), then))
    st = disk.stats()
    log_units = disk._file.num_units
    assert st["rows_moved"] > 0 and st["unit_writes"] > 2 * log_units, (
        st,
        log_units,
    )  # wrapped twice or more
    _equal(disk, ref)
    disk.close()
    # a chain closes after 4 pieces, or once its deltas hold as many bytes as its full piece (most rows here)
    lengths = [len(c) for c, _ in kept]
    assert lengths[0] == 1 and max(lengths) in (2, 3, 4) and lengths.count(1) >= 3, lengths
    assert all(b in (1, a + 1) for a, b in zip(lengths, lengths[1:])), lengths
    again = DiskStore.open(tmp_path / "t.rows", host_budget_bytes=200 * ROW_BYTES)
    _equal(again, ref)
    for chain, then in kept[::-1]:  # newest first: each reads back over another state
        again.load_files(chain)
        _equal(again, then)
    again.close()


def test_a_delta_piece_holds_what_changed_and_a_chain_grows_from_a_loaded_one(tmp_path: Path) -> None:
    """A delta piece holds the units appended since the previous piece and the index pages changed (a few
    here, against a full piece of every row on disk); a run that loads an older chain goes on from it."""
    disk = _disk(tmp_path / "t.rows", budget_rows=50, preallocate=False)
    ref = TensorStore(N, D, WIDTHS, name="t", seed=5)
    for store in (disk, ref):
        store.gather(torch.arange(N))
        _write(store, torch.arange(N), 1.0)
    full = disk.save_files(str(tmp_path / "ckpt"), max_chain=8)
    for store in (disk, ref):
        _write(store, torch.tensor([3, 4, 19000]), 2.0)
    delta = disk.save_files(str(tmp_path / "ckpt"), max_chain=8)
    assert delta[:1] == full and len(delta) == 2
    full_blocks, delta_blocks = (os.stat(p).st_blocks for p in (full[0], delta[1]))
    assert delta_blocks * 20 < full_blocks, (delta_blocks, full_blocks)
    disk.load_files(full)  # back to the older checkpoint, then on
    _write(disk, torch.tensor([3, 4, 19000]), 2.0)
    again = disk.save_files(str(tmp_path / "ckpt"), max_chain=8)
    assert again[0] == full[0] and again[1] != delta[1]
    fresh = _disk(tmp_path / "fresh.rows", preallocate=False)
    for chain in (delta, again):
        fresh.load_files(chain)
        _equal(fresh, ref)
    assert len(disk.save_files(str(tmp_path / "other"), max_chain=8)) == 1  # another directory: a new chain
    disk.close()
    fresh.close()


def test_a_full_piece_written_while_the_store_goes_on_reads_back_the_store_as_it_was(tmp_path: Path) -> None:
    """A full piece taken (its index copied, its units held) and written on another thread, late, while the
    table is rewritten four times over: the log wraps past the units the piece has still to copy, so the
    appends wait for them, and the piece reads back the store as it was when taken."""
    disk = _disk(tmp_path / "t.rows", budget_rows=50, preallocate=False)
    ref = TensorStore(N, D, WIDTHS, name="t", seed=5)
    for store in (disk, ref):
        _write(store, torch.arange(N), 1.0)
    chain, pending = disk.snapshot_files(str(tmp_path / "ckpt"))
    assert pending is not None and not os.path.exists(chain[0])  # taken, not written
    late = threading.Timer(0.2, pending)
    late.start()
    for value in (2.0, 3.0, 4.0, 5.0):
        _write(disk, torch.arange(N), value)
    late.join()
    assert torch.equal(disk.gather(torch.arange(N))[0], torch.full((N, D), 5.0))
    fresh = _disk(tmp_path / "fresh.rows", preallocate=False)
    fresh.load_files(chain)
    _equal(fresh, ref)
    for store in (disk, fresh):
        store.close()


def test_a_damaged_index_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.rows"
    disk = _disk(path)
    _write(disk, torch.tensor([1, 2]), 3.0)
    disk.close()
    with open(path, "r+b") as f:  # the log's head before its tail
        f.seek(4096)
        f.write((5).to_bytes(8, "little") + (9).to_bytes(8, "little"))
    with pytest.raises(ConfigError, match="damaged index"):
        _disk(path)


def test_a_full_disk_is_a_store_error_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = _disk(tmp_path / "t.rows", budget_rows=50)
    ref = TensorStore(N, D, WIDTHS, name="t", seed=5)
    ids = torch.arange(40)
    disk.gather(ids)
    rows = {"momentum1": torch.ones(40, D), "momentum2": torch.ones(40)}
    disk.scatter(ids, torch.full((40, D), 3.0), rows)
    ref.scatter(ids, torch.full((40, D), 3.0), rows)
    real = os.pwritev

    def full(fd: int, buffers: object, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(StoreError, match="is full") as info:
        disk.gather(torch.arange(100, 140))  # evicts the 40 dirty rows: their write fails
    assert info.value.path == str(tmp_path / "t.rows")
    with pytest.raises(StoreError):
        disk.flush()
    monkeypatch.setattr(os, "pwritev", real)
    disk.flush()  # the dirty rows were kept
    disk.close()
    again = _disk(tmp_path / "t.rows")
    _equal(again, ref)
    again.close()


def test_no_room_for_the_file_at_creation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(StoreError, match="no space for disk store"):
        _disk(tmp_path / "t.rows")
    assert not (tmp_path / "t.rows").exists()


@pytest.mark.parametrize(
    "dim, widths", [(1100, {}), (3, {"momentum1": 1}), (128, {"exp_avg": 128, "exp_avg_sq": 128})]
)
def test_records_of_any_width(tmp_path: Path, dim: int, widths: dict) -> None:
    """Records smaller than a page share units; records over a page take units of several pages."""
    disk = DiskStore(tmp_path / "t.rows", 9000, dim, widths, name="t", seed=1, host_budget_bytes=1 << 16)
    ref = TensorStore(9000, dim, widths, name="t", seed=1)
    ids = torch.tensor([0, 1, 8191, 8192, 8999, 4000])
    new = torch.randn(ids.numel(), dim)
    st = {k: torch.rand(ids.numel(), w) for k, w in widths.items()}
    disk.scatter(ids, new, st)
    ref.scatter(ids, new, st)
    disk.flush()
    _equal(disk, ref)
    assert torch.equal(disk.gather(torch.arange(9000))[0], ref.gather(torch.arange(9000))[0])
    disk.close()


def _write(store: Any, ids: torch.Tensor, value: float) -> None:
    n = ids.numel()
    store.scatter(
        ids, torch.full((n, D), value), {"momentum1": torch.full((n, D), value), "momentum2": torch.ones(n)}
    )


def test_a_copy_of_the_files_restores_the_store_as_it_was(tmp_path: Path) -> None:
    """save_files writes the host tier's dirty rows and copies the index and the units holding rows on disk (a few
    here: the rest of the copy stays holes); load_files brings back exactly that state, rows not on disk in the
    copy at their initial values."""
    disk = _disk(tmp_path / "run" / "t.rows", budget_rows=50, preallocate=False)
    ref = TensorStore(N, D, WIDTHS, name="t", seed=5)
    ids = torch.arange(100, 180)  # block 0 only; more rows than the host tier: some written through
    for store in (disk, ref):
        store.gather(ids)
        _write(store, ids, 2.0)
    (copy,) = disk.save_files(str(tmp_path / "ckpt"))
    assert os.path.isfile(copy) and not any(
        p.name.endswith(".partial") for p in (tmp_path / "ckpt").iterdir()
    )
    assert (
        os.stat(copy).st_blocks * 512 < os.path.getsize(copy) // 2
    )  # a sparse copy: the unused log is holes
    _write(disk, torch.tensor([5, 9000, 19999]), 7.0)  # after the checkpoint: touches blocks 1 and 2 too
    disk.flush()
    disk.load_files([copy])
    _equal(disk, ref)
    assert disk.gather(torch.tensor([9000]))[0].tolist() == ref.gather(torch.tensor([9000]))[0].tolist()
    disk.close()


def test_a_copy_of_another_table_is_refused_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = _disk(tmp_path / "t.rows", preallocate=False)
    _write(disk, torch.tensor([1, 2]), 3.0)
    other = DiskStore(tmp_path / "u" / "t.rows", N, D, WIDTHS, name="t", seed=6, host_budget_bytes=ROW_BYTES,
                      preallocate=False)  # fmt: skip
    theirs = other.save_files(str(tmp_path / "other_ckpt"))
    other.close()
    with pytest.raises(ConfigError, match="seed: piece 6, store 5"):
        disk.load_files(theirs)
    with pytest.raises(ConfigError, match="piece '.*missing' is missing"):
        disk.load_files([str(tmp_path / "missing")])
    assert disk.gather(torch.tensor([1]))[0].tolist() == [[3.0] * D]
    (copy,) = disk.save_files(str(tmp_path / "ckpt"))
    _write(disk, torch.tensor([7]), 4.0)
    chain = disk.save_files(str(tmp_path / "ckpt"), max_chain=2)
    with open(chain[1] + ".npz", "r+b") as f:  # a damaged list
        f.truncate(10)
    with pytest.raises(ConfigError, match="list of the checkpoint piece .* is damaged"):
        disk.load_files(chain)
    os.unlink(chain[1])
    with pytest.raises(ConfigError, match=f"piece '{chain[1]}' is missing"):
        disk.load_files(chain)
    with pytest.raises(ConfigError, match="one full piece then deltas"):
        disk.load_files([copy, copy])
    with open(copy, "r+b") as f:  # truncated
        f.truncate(os.path.getsize(copy) - 4096)
    with pytest.raises(ConfigError, match="is truncated"):
        disk.load_files([copy])
    assert disk.gather(torch.tensor([7]))[0].tolist() == [[4.0] * D]

    def full(fd: int, data: object, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)  # the disk of the checkpoint fills up while copying
    with pytest.raises(StoreError, match="failed \\(No space left on device; it needs .* bytes, .* are free"):
        disk.save_files(str(tmp_path / "full"))
    assert list((tmp_path / "full").iterdir()) == []  # no partial copy left
    monkeypatch.undo()
    assert disk.gather(torch.tensor([1]))[0].tolist() == [[3.0] * D]
    disk.close()
