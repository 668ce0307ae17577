"""Checkpoint copies of a disk store file (:mod:`torchrec_lookahead.store._disk_file`): full and incremental
pieces, and a chain of them read back.

A *piece* is a file with the store file's header, and beside it ``<piece>.npz``, its list (written last: a piece
without its list is partial)::

    full piece    the store file's size, its offsets: the index (with the log's ends) and every unit holding a
                  row on disk, the rest holes; its list names those units
    delta piece   the header page, then the records of the rows written since the previous piece of its chain
                  (tracked as they are appended; the rows the cleaner moved are not written again), packed; its
                  list names those rows

A *chain* is a full piece and the deltas written after it, oldest first. Read back, the full piece's index and
units are copied into the store file, then each delta's rows are appended to its log, oldest first: the file
then holds the values the chain stands for (its layout may differ from the file's that wrote the chain). Pieces
are copies: a chain never refers to the live store file, so the log's cleaner reuses units freely (a full piece
still being written holds the units it has yet to copy: ``DiskFile.hold``). A chain is closed (the next piece
is full) after ``max_chain`` pieces, or when its deltas hold as many bytes as its full piece (a full piece is
then cheaper to read back than the chain).
"""

from __future__ import annotations

import dataclasses
import io
import json
import mmap
import os
import zipfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from torchrec_lookahead.errors import ConfigError, StoreError
from torchrec_lookahead.store._disk_file import DiskFile
from torchrec_lookahead.store._disk_io import (
    PAGE,
    aligned_buffer,
    free_bytes,
    fsync_dir,
    pread_all,
    pwrite_all,
    read_header,
)
from torchrec_lookahead.store.types import PendingPiece

__all__: List[str] = []

#: the suffix of a piece's list of pages and units (beside the piece)
LIST_SUFFIX = ".npz"


@dataclasses.dataclass(frozen=True)
class Chain:
    """The pieces (paths, oldest first) a store file was last saved as or loaded from, and what a delta over
    them needs: the log's head when the newest was written, the bytes of the full piece and of the deltas."""

    pieces: Tuple[str, ...]
    head: int
    full_bytes: int
    delta_bytes: int

    def there(self, dst: str) -> bool:
        """Whether this chain's pieces are all in the directory of the piece ``dst``, and all still there."""
        here = os.path.dirname(os.path.abspath(dst))
        return all(
            os.path.dirname(os.path.abspath(p)) == here and os.path.exists(p + LIST_SUFFIX)
            for p in self.pieces
        )

    def extends(self, dst: str, max_chain: int) -> bool:
        """Whether the piece ``dst`` may be a delta over this chain: the chain is shorter than ``max_chain``, its
        deltas hold fewer bytes than its full piece, and it is :meth:`there`."""
        return len(self.pieces) < max_chain and self.delta_bytes < self.full_bytes and self.there(dst)


def _remove(*paths: str) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def room_for(dst: str, nbytes: int, what: str) -> None:
    """Make ``dst``'s directory and check it has ``nbytes`` free for the checkpoint piece ``dst`` of ``what``.

    Raises:
        StoreError: too few bytes free (the free and needed bytes are named).
    """
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    free = free_bytes(dst)
    if 0 <= free < nbytes:
        raise StoreError(
            f"no room for the checkpoint piece '{dst}' of {what}: it needs {nbytes:,} bytes, {free:,} are free; the "
            "store is unchanged: free space, or checkpoint elsewhere",
            path=dst,
        )


def finish_piece(dst: str, info: Dict[str, Any], **arrays: np.ndarray) -> None:
    """Write the list of the piece ``dst`` (``info`` and ``arrays``), then rename both into place, durably: the
    piece (written to ``dst.partial``) is whole once its list is there."""
    tmp_list = dst + LIST_SUFFIX + ".partial"
    with open(tmp_list, "wb") as f:
        np.savez(f, info=np.array(json.dumps(info)), **arrays)  # type: ignore[arg-type]
        f.flush()
        os.fsync(f.fileno())
    os.replace(dst + ".partial", dst)
    os.replace(tmp_list, dst + LIST_SUFFIX)
    fsync_dir(os.path.dirname(os.path.abspath(dst)))


def failed_piece(dst: str, what: str, e: OSError, nbytes: int) -> StoreError:
    """Remove what was written of the piece ``dst`` of ``what``; the error to raise."""
    _remove(dst + ".partial", dst + LIST_SUFFIX + ".partial", dst, dst + LIST_SUFFIX)
    return StoreError(
        f"writing the checkpoint piece '{dst}' of {what} failed ({e.strerror}; it needs {nbytes:,} bytes, "
        f"{free_bytes(dst):,} are free there): nothing of it is left, the store is unchanged",
        path=dst,
    )


_BLOCK_ROWS = 1 << 16  # records read or written at a time


def _write_full(
    file: DiskFile, dst: str, src: int, first: mmap.mmap, units: np.ndarray, counters: np.ndarray
) -> None:
    """Write ``dst.partial``: ``first`` (the header page and the index, as they were), then ``units`` (held, in
    log order, their log ``counters``) read through ``src``, at the store file's offsets (the rest holes),
    releasing each unit once copied."""
    out = os.open(
        dst + ".partial", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666
    )  # a checkpoint file: the umask's mode
    try:
        os.ftruncate(out, file.size)
        pwrite_all(out, memoryview(first), 0)

        def copied(k: int) -> None:
            file.release_held(int(counters[k]) if k < counters.size else None)

        file._copy_units(units, src, out, file.path, copied)
        os.fsync(out)
    finally:
        os.close(out)


#: what a piece still to be written needs done (``None``: nothing, it is written or no piece is needed)
Writer = Optional[PendingPiece]


def prepare_piece(file: DiskFile, dst: str, base: Optional[Chain], max_chain: int) -> Tuple[Chain, Writer]:
    """The piece ``dst`` of ``file`` (flushed: the index on disk points at rows on disk): a delta over ``base``
    where the chain may grow (:meth:`Chain.extends`), else a full piece. Of a delta, the records of its rows are
    read here (a snapshot, in memory); of a full piece, the index is copied here and the units it points at are
    held (:meth:`DiskFile.hold`: the log goes on around them). The returned writer writes the piece, on any
    thread, durably, whole or not at all.

    Returns:
        The chain the file stands at now (``dst`` last, or ``base`` itself where nothing was written since
        ``base``, it has at most ``max_chain`` pieces and they are there), and the writer.

    Raises:
        StoreError: the piece cannot be written (a full disk: the free and needed bytes are named); nothing of
            it is left, the store and ``base`` are unchanged. The writer raises it too.
    """
    head = int(file._ends[0])
    if base is not None and head == base.head and len(base.pieces) <= max_chain and base.there(dst):
        return base, None  # nothing written since (every write appends): the same chain holds the table
    delta = base is not None and base.extends(dst, max_chain)
    what = f"disk store '{file.path}'"
    if not delta:
        units = file.live_units()
        nbytes = PAGE + file.index_bytes + units.size * file.unit_bytes
        room_for(dst, nbytes, what)
        first = aligned_buffer(PAGE + file.index_bytes)  # the header page and the index as they are now
        file._read_exact(memoryview(first)[:PAGE], 0)
        memoryview(first)[PAGE:] = memoryview(file._index_buf)
        src = os.dup(file._fd)  # the units are read through it even if the store is closed meanwhile
        ordered, counters = file.hold(units)
        file.changed_rows[:] = False

        def write_full() -> None:
            try:
                _write_full(file, dst, src, first, ordered, counters)
                finish_piece(dst, {"kind": "full", "head": head, "bytes": nbytes}, units=units)
            except OSError as e:
                raise failed_piece(dst, what, e, nbytes) from None

        closed: List[int] = []

        def release() -> None:
            file.release_held(None)
            if not closed:
                closed.append(src)
                os.close(src)

        return Chain((dst,), head, nbytes, 0), PendingPiece(write_full, release)
    assert base is not None
    rows = np.flatnonzero(file.changed_rows)
    nbytes = PAGE + rows.size * (file.record_bytes + 8)
    room_for(dst, nbytes, what)
    head_page = aligned_buffer(PAGE)
    file._read_exact(memoryview(head_page), 0)
    records = [
        file.read_rows(file.slots_of(rows[a : a + _BLOCK_ROWS]))[0] for a in range(0, rows.size, _BLOCK_ROWS)
    ]
    file.changed_rows[:] = False

    def write() -> None:
        try:
            with open(dst + ".partial", "wb") as f:
                f.write(head_page)
                for block in records:
                    f.write(np.ascontiguousarray(block).tobytes())
                f.flush()
                os.fsync(f.fileno())
            finish_piece(dst, {"kind": "delta", "head": head, "bytes": nbytes}, rows=rows)
        except OSError as e:
            raise failed_piece(dst, what, e, nbytes) from None

    chain = Chain((*base.pieces, dst), head, base.full_bytes, base.delta_bytes + nbytes)
    return chain, PendingPiece(write, lambda: None)


def _legacy_copy(file: DiskFile, path: str) -> bool:
    """``path`` is a copy of the whole store file as checkpoints kept it before chains (``<table>.<row offset>.rows``,
    no list): a full piece whose units are those its index points at."""
    name = f"{file.meta.get('name')}.{file.meta.get('row_offset')}.rows"
    return os.path.basename(path) == name and not os.path.exists(path + LIST_SUFFIX)


def _piece_list(file: DiskFile, path: str) -> Dict[str, Any]:
    """The list of the piece ``path`` (``info``, and ``units`` of a full piece or ``rows`` of a delta), after
    checking it is a whole piece of ``file``.

    Raises:
        ConfigError: the piece or its list is missing, damaged, or of another table, shard, layout or seed.
    """
    legacy = _legacy_copy(file, path)
    if not os.path.exists(path) or not (legacy or os.path.exists(path + LIST_SUFFIX)):
        missing = path if not os.path.exists(path) else path + LIST_SUFFIX
        raise ConfigError(
            f"the checkpoint piece '{missing}' is missing: the chain of '{file.path}' is incomplete"
        )
    found = read_header(path)
    diffs = [f"{k}: piece {found.get(k)!r}, store {v!r}" for k, v in file.meta.items() if found.get(k) != v]
    if legacy:  # the units its index points at are its rows (checked against the index by read_chain)
        if not diffs and os.path.getsize(path) != file.size:
            diffs = [f"size: copy {os.path.getsize(path):,} bytes, expected {file.size:,}"]
        if diffs:
            raise ConfigError(
                f"'{path}' is not a copy of disk store '{file.path}' ({'; '.join(diffs)}): it was written for "
                "another table, shard, layout or seed, or is truncated"
            )
        return {"info": {"kind": "full", "legacy": True}, "units": None}
    try:
        with open(path + LIST_SUFFIX, "rb") as f:
            data = np.load(io.BytesIO(f.read()), allow_pickle=False)
            out: Dict[str, Any] = {k: data[k].astype(np.int64) for k in data.files if k != "info"}
            out["info"] = json.loads(str(data["info"]))
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise ConfigError(
            f"the list of the checkpoint piece '{path}' is damaged ({type(e).__name__})"
        ) from None
    delta = out["info"].get("kind") == "delta"
    size = PAGE + out["rows"].size * file.record_bytes if delta and "rows" in out else file.size
    if not diffs and os.path.getsize(path) != size:
        diffs = [f"size: piece {os.path.getsize(path):,} bytes, expected {size:,}"]
    if diffs:
        raise ConfigError(
            f"'{path}' is not a checkpoint piece of disk store '{file.path}' ({'; '.join(diffs)}): it was written "
            "for another table, shard, layout or seed, or is truncated"
        )
    key, top = ("rows", file.num_rows) if delta else ("units", file.num_units)
    v = out.get(key)
    if v is None or (v.size and (v.min() < 0 or v.max() >= top)):
        raise ConfigError(
            f"the list of the checkpoint piece '{path}' is damaged ({key} missing or out of range)"
        )
    return out


def read_chain(file: DiskFile, pieces: Sequence[str]) -> Chain:
    """Make ``file`` hold what the chain ``pieces`` (oldest first, a full piece first) stands for, durably: its
    index and the units of its rows on disk (a row not on disk in it holds its initial value).

    Raises:
        ConfigError: a piece is missing, damaged, of another table, shard, layout or seed, or the chain does not
            start with a full piece or lacks a unit its index points at (the piece is named); nothing is written.
        StoreError: reading a piece or writing the file failed.
    """
    if not pieces:
        raise ConfigError(f"an empty chain of checkpoint pieces for disk store '{file.path}'")
    lists = [_piece_list(file, p) for p in pieces]
    kinds = [lst["info"].get("kind") for lst in lists]
    if kinds[0] != "full" or any(k != "delta" for k in kinds[1:]):
        raise ConfigError(
            f"the chain of checkpoint pieces of '{file.path}' must be one full piece then deltas; got {kinds} for "
            f"{list(pieces)}"
        )
    index = aligned_buffer(file.index_bytes)
    fd = -1
    try:
        fd = os.open(pieces[0], os.O_RDONLY)
        pread_all(fd, memoryview(index), PAGE, pieces[0])
        file._check_index(pieces[0], index)
        loc = np.frombuffer(index, dtype=np.uint32, count=file.num_rows, offset=PAGE)
        live = file.live_units(loc)
        lacking = live[:0] if lists[0]["units"] is None else np.setdiff1d(live, lists[0]["units"])
        if lacking.size:
            raise ConfigError(
                f"the checkpoint piece '{pieces[0]}' lacks unit {int(lacking[0])} of its index ({lacking.size} units "
                "in all): it is damaged"
            )
        del loc
        file.reset()
        memoryview(file._index_buf)[:] = memoryview(index)
        file._index_rows()
        file._copy_units(live, fd, file._fd, pieces[0])
        for path, lst in zip(pieces[1:], lists[1:]):
            rows = lst["rows"]
            records = np.memmap(
                path, dtype=np.float32, mode="r", offset=PAGE, shape=(rows.size, file.record_floats)
            )
            for a in range(0, rows.size, _BLOCK_ROWS):
                file.append(rows[a : a + _BLOCK_ROWS], np.array(records[a : a + _BLOCK_ROWS]))
            del records
    except OSError as e:
        raise StoreError(
            f"restoring disk store '{file.path}' from the chain {list(pieces)} failed ({e.strerror})",
            path=file.path,
        ) from None
    finally:
        if fd >= 0:
            os.close(fd)
    file.sync()
    file.write_index()
    file.sync()
    file.changed_rows[:] = False
    infos = [lst["info"] for lst in lists]
    return Chain(
        tuple(pieces),
        int(file._ends[0]),
        int(infos[0].get("bytes", 0)),
        sum(int(i.get("bytes", 0)) for i in infos[1:]),
    )
