"""Checkpoint copies of a disk store file (:mod:`torchrec_lookahead.store._disk_file`): full and incremental
pieces, and a chain of them read back.

A *piece* is a sparse file of the store file's size (the same offsets: unit ``u`` at the same byte in both)
holding the header, some pages of the index and some log units, with beside it ``<piece>.npz``, the list of
the pages and units it holds (written last: a piece without its list is partial)::

    full piece    the whole index (with the log's ends) and every unit holding a row on disk
    delta piece   the index pages changed since the previous piece of its chain (page 0, the log's ends,
                  always), and the units appended since then that still hold a row on disk

A *chain* is a full piece and the deltas written after it, oldest first. The state a chain stands for is its
index pages applied oldest first, and each unit holding a row on disk in it read from the newest piece holding
that unit: a unit still live was written once since it last changed, and the piece written after that write
holds it. Pieces are copies: a chain never refers to the live store file, so the log's cleaner reuses units
freely. A chain is closed (the next piece is full) after ``max_chain`` pieces, or when its deltas hold as many
bytes as its full piece (a full piece is then cheaper to read back than the chain).
"""

from __future__ import annotations

import dataclasses
import io
import json
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
    runs,
)

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


def write_piece(file: DiskFile, dst: str, base: Optional[Chain], max_chain: int) -> Chain:
    """Write the piece ``dst`` of ``file`` (flushed: the index on disk points at rows on disk): a delta over
    ``base`` where the chain may grow (:meth:`Chain.extends`), else a full piece. Durable, and whole or absent.

    Returns:
        The chain the file stands at now: ``dst`` last, or ``base`` itself (no piece written) where nothing was
        written since ``base`` and its pieces are there.

    Raises:
        StoreError: the piece cannot be written (a full disk: the free and needed bytes are named); nothing of
            it is left, the store and ``base`` are unchanged.
    """
    head = int(file._ends[0])
    live = file.live_units()
    if base is not None and head == base.head and not file.changed_pages.any() and base.there(dst):
        return base  # nothing written since: the same chain holds the table
    delta = base is not None and base.extends(dst, max_chain)
    if delta:
        assert base is not None
        if head - base.head < file.num_units:
            appended = np.unique(np.arange(base.head, head, dtype=np.int64) % file.num_units)
            units = np.intersect1d(live, appended, assume_unique=True)
        else:
            units = live
        pages = np.flatnonzero(file.changed_pages)
        pages = np.union1d(pages, [0]).astype(np.int64)
    else:
        units = live
        pages = np.arange(file.index_bytes // PAGE, dtype=np.int64)
    nbytes = (1 + pages.size) * PAGE + units.size * file.unit_bytes
    what = f"disk store '{file.path}'"
    room_for(dst, nbytes, what)
    out = -1
    try:
        out = os.open(dst + ".partial", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(out, file.size)
        head_page = aligned_buffer(PAGE)
        file._read_exact(memoryview(head_page), 0)
        pwrite_all(out, memoryview(head_page), 0)
        index = memoryview(file._index_buf)
        for i, n in runs(pages, PAGE):
            p = int(pages[i])
            pwrite_all(out, index[p * PAGE : (p + n) * PAGE], PAGE + p * PAGE)
        index.release()
        file._copy_units(units, file._fd, out, file.path)
        os.fsync(out)
        os.close(out)
        out = -1
        info = {"kind": "delta" if delta else "full", "head": head, "bytes": nbytes}
        finish_piece(dst, info, pages=pages, units=units)
    except OSError as e:
        if out >= 0:
            os.close(out)
        raise failed_piece(dst, what, e, nbytes) from None
    file.changed_pages[:] = False
    if delta:
        assert base is not None
        return Chain((*base.pieces, dst), head, base.full_bytes, base.delta_bytes + nbytes)
    return Chain((dst,), head, nbytes, 0)


def _piece_list(file: DiskFile, path: str) -> Tuple[np.ndarray, np.ndarray, Dict[str, Any]]:
    """The pages, units and info of the piece ``path``, after checking it is a whole piece of ``file``.

    Raises:
        ConfigError: the piece or its list is missing, damaged, or of another table, shard, layout or seed.
    """
    if not os.path.exists(path) or not os.path.exists(path + LIST_SUFFIX):
        missing = path if not os.path.exists(path) else path + LIST_SUFFIX
        raise ConfigError(
            f"the checkpoint piece '{missing}' is missing: the chain of '{file.path}' is incomplete"
        )
    found = read_header(path)
    diffs = [f"{k}: piece {found.get(k)!r}, store {v!r}" for k, v in file.meta.items() if found.get(k) != v]
    if not diffs and os.path.getsize(path) != file.size:
        diffs = [f"size: piece {os.path.getsize(path):,} bytes, store {file.size:,}"]
    if diffs:
        raise ConfigError(
            f"'{path}' is not a checkpoint piece of disk store '{file.path}' ({'; '.join(diffs)}): it was written "
            "for another table, shard, layout or seed, or is truncated"
        )
    try:
        with open(path + LIST_SUFFIX, "rb") as f:
            data = np.load(io.BytesIO(f.read()), allow_pickle=False)
            pages, units = data["pages"].astype(np.int64), data["units"].astype(np.int64)
            info: Dict[str, Any] = json.loads(str(data["info"]))
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise ConfigError(
            f"the list of the checkpoint piece '{path}' is damaged ({type(e).__name__})"
        ) from None
    index_pages = file.index_bytes // PAGE
    bad = pages.size and (pages.min() < 0 or pages.max() >= index_pages)
    if bad or (units.size and (units.min() < 0 or units.max() >= file.num_units)):
        raise ConfigError(
            f"the list of the checkpoint piece '{path}' is damaged (pages or units out of range)"
        )
    return pages, units, info


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
    if lists[0][2].get("kind") != "full" or any(info.get("kind") != "delta" for _, _, info in lists[1:]):
        raise ConfigError(
            f"the chain of checkpoint pieces of '{file.path}' must be one full piece then deltas; got "
            f"{[info.get('kind') for _, _, info in lists]} for {list(pieces)}"
        )
    index = aligned_buffer(file.index_bytes)
    view = memoryview(index)
    fds: List[int] = []
    try:
        for path in pieces:
            fds.append(os.open(path, os.O_RDONLY))
        for fd, path, (pages, _, _) in zip(fds, pieces, lists):
            for i, n in runs(pages, PAGE):
                p = int(pages[i])
                pread_all(fd, view[p * PAGE : (p + n) * PAGE], PAGE + p * PAGE, path)
        file._check_index(pieces[-1], index)
        loc = np.frombuffer(index, dtype=np.uint32, count=file.num_rows, offset=PAGE)
        rows = np.flatnonzero(loc)
        live = file.units_of(loc[rows].astype(np.int64) - 1)
        owner = np.full(file.num_units, -1, dtype=np.int64)
        for k, (_, units, _) in enumerate(lists):
            owner[units] = k
        lacking = live[owner[live] < 0]
        if lacking.size:
            raise ConfigError(
                f"the chain of checkpoint pieces {list(pieces)} lacks unit {int(lacking[0])} of its index "
                f"({lacking.size} units in all): a piece is damaged or from another chain"
            )
        del loc
        file.reset()
        memoryview(file._index_buf)[:] = view
        file._index_rows()
        for k, (fd, path) in enumerate(zip(fds, pieces)):
            file._copy_units(live[owner[live] == k], fd, file._fd, path)
    except OSError as e:
        raise StoreError(
            f"restoring disk store '{file.path}' from the chain {list(pieces)} failed ({e.strerror})",
            path=file.path,
        ) from None
    finally:
        view.release()
        for fd in fds:
            os.close(fd)
    file.sync()
    file.write_index()
    file.sync()
    file.changed_pages[:] = False
    infos = [info for _, _, info in lists]
    return Chain(
        tuple(pieces),
        int(file._ends[0]),
        int(infos[0].get("bytes", 0)),
        sum(int(i.get("bytes", 0)) for i in infos[1:]),
    )
