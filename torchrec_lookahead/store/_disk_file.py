"""The file of a :class:`~torchrec_lookahead.store.DiskStore`: layout, header, aligned positional I/O.

One file per table (or row shard), in 4 KiB pages::

    page 0                  header: magic, then the layout as JSON (table, rows, dim, state layout, seed, version)
    pages 1 .. F            one byte per row: 1 once the row is on disk (written at least once)
    pages F+1 ..            the blocks of INIT_BLOCK_ROWS rows, each ``units_per_block`` units of ``unit_bytes``

A *unit* is the smallest piece read or written: one page holding ``rows_per_unit`` whole records (a record is
one row ``[weight | states]``, float32), or, for records over a page, the pages of one record. Records never
straddle units and blocks never share units, so a row is read with the one unit that holds it. A row never
written is not on disk: its value is its initial value, computed (``init_rows_at``), and the slots of such rows
in a unit hold nothing meaningful. So a write reads its unit first only when the unit holds another row on disk,
and the file stays sparse where no row was written (unless preallocated). Reads and writes go through aligned
buffers, with ``O_DIRECT`` where the filesystem takes it (else buffered, with ``posix_fadvise(DONTNEED)`` after
each call so that the page cache does not hold the table), issued in parallel runs of consecutive units from a
small thread pool.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import logging
import mmap
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from torchrec_lookahead.errors import ConfigError, SetupError, StoreError
from torchrec_lookahead.store.init import INIT_BLOCK_ROWS

__all__: List[str] = []

log = logging.getLogger(__name__)

PAGE = 4096
MAGIC = b"TRLDISK\x00"
FORMAT = "torchrec_lookahead.disk_store"
VERSION = 2  # 1: one flag per block, blocks written whole with their initial values
_MAX_RUN_BYTES = 1 << 20  # one request reads at most this many consecutive bytes
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory of at least ``nbytes`` (O_DIRECT needs aligned buffers)."""
    return mmap.mmap(-1, max(PAGE, -(-nbytes // PAGE) * PAGE))


def _runs(units: np.ndarray, unit_bytes: int) -> List[Tuple[int, int]]:
    """(first index into ``units``, count) of the runs of consecutive units, each at most _MAX_RUN_BYTES."""
    if units.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(units) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [units.size]))
    longest = max(1, _MAX_RUN_BYTES // unit_bytes)
    out: List[Tuple[int, int]] = []
    for a, b in zip(starts.tolist(), stops.tolist()):
        for lo in range(a, b, longest):
            out.append((lo, min(longest, b - lo)))
    return out


def _each(op: Callable[[memoryview, int], None], jobs: List[Tuple[memoryview, int]]) -> None:
    for view, offset in jobs:
        op(view, offset)


class DiskFile:
    """The records of one table in a file, addressed by local row, with their row flags (1: the row is on disk).

    Creates the file when it does not exist, else checks its header against ``meta`` and refuses another
    table's, size's, layout's or seed's file.
    """

    def __init__(
        self,
        path: str,
        meta: Dict[str, Any],
        num_rows: int,
        record_floats: int,
        direct_io: Optional[bool],
        io_threads: int,
        preallocate: bool,
    ) -> None:
        self.path = path
        self.num_rows = num_rows
        self.record_bytes = record_floats * 4
        if self.record_bytes <= PAGE:
            self.rows_per_unit, self.unit_bytes = PAGE // self.record_bytes, PAGE
        else:
            self.rows_per_unit, self.unit_bytes = 1, -(-self.record_bytes // PAGE) * PAGE
        self.block_rows = INIT_BLOCK_ROWS
        self.units_per_block = -(-self.block_rows // self.rows_per_unit)
        self.num_blocks = -(-num_rows // self.block_rows)
        flag_pages = -(-num_rows // PAGE)
        self.data_offset = PAGE * (1 + flag_pages)
        self.size = self.data_offset + self.num_blocks * self.units_per_block * self.unit_bytes
        self.meta = dict(
            meta, unit_bytes=self.unit_bytes, rows_per_unit=self.rows_per_unit, block_rows=self.block_rows
        )
        self._flags_buf = aligned_buffer(flag_pages * PAGE)
        self.flags = np.frombuffer(self._flags_buf, dtype=np.uint8)[:num_rows]
        self._threads = max(1, io_threads)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max(1, io_threads), thread_name_prefix="disk-store-io"
        )
        self._fd = -1
        self.direct = False
        exists = os.path.exists(path)
        if exists:
            self._check_header()
        else:
            self._create_dir()
        self._open(direct_io)
        if exists:
            self._read_exact(memoryview(self._flags_buf), PAGE)
        else:
            self._init_file(preallocate)
        self.bytes_read = 0
        self.bytes_written = 0
        self._count_lock = threading.Lock()

    # -- opening -------------------------------------------------------------------------------------------
    def _create_dir(self) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        try:
            os.makedirs(directory, exist_ok=True)
            probe = os.path.join(directory, f".probe-{os.getpid()}-{threading.get_ident()}")
            os.close(os.open(probe, os.O_CREAT | os.O_WRONLY, 0o600))
            os.unlink(probe)
        except OSError as e:
            raise SetupError(
                f"disk store directory '{directory}' is not writable ({e.strerror}); choose a writable store_dir"
            ) from None

    def _check_header(self) -> None:
        try:
            with open(self.path, "rb") as f:
                head = f.read(PAGE)
        except OSError as e:
            raise SetupError(f"cannot read disk store '{self.path}' ({e.strerror})") from None
        if len(head) < PAGE or not head.startswith(MAGIC):
            raise ConfigError(
                f"'{self.path}' is not a disk store file (no {FORMAT} header); delete it or choose another store_dir"
            )
        length = int.from_bytes(head[len(MAGIC) : len(MAGIC) + 4], "little")
        found = json.loads(head[len(MAGIC) + 4 : len(MAGIC) + 4 + length].decode())
        if found.get("format") != FORMAT or found.get("version") != VERSION:
            raise ConfigError(
                f"disk store '{self.path}' has format {found.get('format')!r} version {found.get('version')!r}; "
                f"this version reads {FORMAT!r} version {VERSION}: delete the file to start afresh"
            )
        diffs = [
            f"{k}: file {found.get(k)!r}, asked {v!r}" for k, v in self.meta.items() if found.get(k) != v
        ]
        if diffs:
            raise ConfigError(
                f"disk store '{self.path}' was written for another table or layout ({'; '.join(diffs)}); open it "
                "with the arguments it was created with (DiskStore.open), or delete it to start afresh"
            )
        actual = os.path.getsize(self.path)
        if actual != self.size:
            raise ConfigError(
                f"disk store '{self.path}' has {actual} bytes but its header implies {self.size}; the file is "
                "truncated or foreign: delete it to start afresh"
            )

    def _open(self, direct_io: Optional[bool]) -> None:
        flags = os.O_RDWR | os.O_CREAT
        if direct_io is not False and hasattr(os, "O_DIRECT"):
            try:
                self._fd = os.open(self.path, flags | os.O_DIRECT, 0o600)
                probe = aligned_buffer(PAGE)
                os.preadv(self._fd, [probe], 0)  # some filesystems take the flag and refuse the I/O
                self.direct = True
                return
            except OSError as e:
                if self._fd >= 0:
                    os.close(self._fd)
                    self._fd = -1
                if e.errno != errno.EINVAL:
                    raise SetupError(f"cannot open disk store '{self.path}' ({e.strerror})") from None
                if direct_io:
                    raise SetupError(
                        f"the filesystem of '{self.path}' refuses direct I/O (O_DIRECT) and direct_io=True was "
                        "asked; put store_dir on a filesystem that takes it, or pass direct_io=None to fall back"
                    ) from None
                log.warning(
                    "the filesystem of %s refuses direct I/O (O_DIRECT): falling back to buffered I/O with "
                    "posix_fadvise(DONTNEED) after each read and write",
                    self.path,
                )
        elif direct_io is None:
            log.warning("no O_DIRECT on this platform: disk store %s uses buffered I/O", self.path)
        try:
            self._fd = os.open(self.path, flags, 0o600)
        except OSError as e:
            raise SetupError(f"cannot open disk store '{self.path}' ({e.strerror})") from None

    def _init_file(self, preallocate: bool) -> None:
        body = json.dumps(self.meta, sort_keys=True).encode()
        header = aligned_buffer(PAGE)
        header[: len(MAGIC) + 4 + len(body)] = MAGIC + len(body).to_bytes(4, "little") + body
        try:
            os.ftruncate(self._fd, self.size)
            if preallocate and hasattr(os, "posix_fallocate"):
                try:
                    os.posix_fallocate(self._fd, 0, self.size)
                except OSError as e:
                    if e.errno in _NO_SPACE:
                        raise
                    # a filesystem without fallocate: the file stays sparse
            self._write_exact(memoryview(header), 0)
            self.write_flags()
            os.fsync(self._fd)
        except OSError as e:
            self.close()
            os.unlink(self.path)
            if e.errno in _NO_SPACE:
                free = _free_bytes(self.path)
                raise StoreError(
                    f"no space for disk store '{self.path}': it needs {self.size:,} bytes, {free:,} are free; "
                    "free space or choose another store_dir",
                    path=self.path,
                ) from None
            raise SetupError(f"cannot create disk store '{self.path}' ({e.strerror})") from None

    # -- positional I/O --------------------------------------------------------------------------------------
    def _read_exact(self, view: memoryview, offset: int) -> None:
        _pread_all(self._fd, view, offset, self.path)
        if not self.direct:
            os.posix_fadvise(self._fd, offset, len(view), os.POSIX_FADV_DONTNEED)

    def _write_exact(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            done += os.pwritev(self._fd, [view[done:]], offset + done)
        if not self.direct:
            os.posix_fadvise(self._fd, offset, len(view), os.POSIX_FADV_DONTNEED)

    def _unit_offset(self, unit: int) -> int:
        return self.data_offset + unit * self.unit_bytes

    def _io(self, units: np.ndarray, buf: mmap.mmap, write: bool) -> None:
        """Read or write ``units`` (sorted, distinct) from or to ``buf`` (unit ``units[i]`` at ``i * unit_bytes``),
        in parallel runs."""
        view = memoryview(buf)
        ub = self.unit_bytes
        op = self._write_exact if write else self._read_exact
        runs = _runs(units, ub)
        try:
            if len(runs) == 1:
                i, n = runs[0]
                op(view[i * ub : (i + n) * ub], self._unit_offset(int(units[i])))
            else:  # one task per thread, each going through its share of the runs: io_threads requests in flight
                jobs = [(view[i * ub : (i + n) * ub], self._unit_offset(int(units[i]))) for i, n in runs]
                shares = [jobs[k :: self._threads] for k in range(min(self._threads, len(jobs)))]
                futures = [self._pool.submit(_each, op, share) for share in shares]
                for f in futures:
                    f.result()
        except OSError as e:
            if write and e.errno in _NO_SPACE:
                raise StoreError(
                    f"the disk of store '{self.path}' is full ({e.strerror}) after {self.bytes_written:,} bytes "
                    f"written ({_free_bytes(self.path):,} free); rows not yet written stay in host memory, the file is "
                    "consistent up to the last flush: free space, then checkpoint or resume from the last one",
                    path=self.path,
                ) from None
            raise StoreError(
                f"{'writing' if write else 'reading'} disk store '{self.path}' failed ({e.strerror})",
                path=self.path,
            ) from None
        finally:
            view.release()
        with self._count_lock:
            if write:
                self.bytes_written += units.size * ub
            else:
                self.bytes_read += units.size * ub

    # -- records ----------------------------------------------------------------------------------------------
    def locate(self, rows: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Unit of every local row and the row's float offset inside its unit."""
        block, within = np.divmod(rows, self.block_rows)
        unit_in_block, slot = np.divmod(within, self.rows_per_unit)
        return block * self.units_per_block + unit_in_block, slot * (self.record_bytes // 4)

    def others_on_disk(self, units: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """For sorted distinct ``units``: whether each holds a row on disk other than the sorted distinct
        ``rows`` (whose units are ``units``), i.e. whether writing ``rows`` must read the unit first."""
        block, within = np.divmod(units, self.units_per_block)
        first = block * self.block_rows + within * self.rows_per_unit
        stop = np.minimum((block + 1) * self.block_rows, self.num_rows)
        grid = first[:, None] + np.arange(self.rows_per_unit)[None, :]
        valid = grid < stop[:, None]
        on = np.zeros(grid.shape, dtype=bool)
        on[valid] = self.flags[grid[valid]] != 0
        at = np.searchsorted(units, self.locate(rows)[0])
        on[at, rows - first[at]] = False
        return np.asarray(on.any(axis=1))

    def blocks_on_disk(self) -> np.ndarray:
        """Indices of the blocks holding at least one row on disk."""
        starts = np.arange(0, self.num_rows, self.block_rows)
        return np.flatnonzero(np.maximum.reduceat(self.flags, starts) != 0)

    def read_units(self, units: np.ndarray) -> Tuple[mmap.mmap, np.ndarray]:
        """Read sorted distinct ``units``; returns the buffer and its float32 view (unit ``i`` at
        ``i * unit_bytes / 4``)."""
        buf = aligned_buffer(units.size * self.unit_bytes)
        self._io(units, buf, write=False)
        return buf, np.frombuffer(buf, dtype=np.float32)

    def write_units(self, units: np.ndarray, buf: mmap.mmap) -> None:
        """Write sorted distinct ``units`` from ``buf`` (as returned by :meth:`read_units`)."""
        self._io(units, buf, write=True)

    def record_index(self, units: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """(n, record_floats) indices of ``rows`` into the float32 view of a buffer holding ``units``."""
        unit, off = self.locate(rows)
        pos = np.searchsorted(units, unit) * (self.unit_bytes // 4) + off
        return pos[:, None] + np.arange(self.record_bytes // 4)[None, :]

    def write_block(self, block: int, records: np.ndarray) -> None:
        """Write a whole block of ``records`` ((rows of the block, record_floats) float32); the caller flags
        its rows."""
        lo = block * self.block_rows
        units = np.arange(block * self.units_per_block, (block + 1) * self.units_per_block, dtype=np.int64)
        buf = aligned_buffer(units.size * self.unit_bytes)
        flat = np.frombuffer(buf, dtype=np.float32)
        flat[self.record_index(units, np.arange(lo, lo + records.shape[0], dtype=np.int64))] = records
        self.write_units(units, buf)

    def write_flags(self) -> None:
        """Write the row flags (call after the rows they describe are durable)."""
        try:
            self._write_exact(memoryview(self._flags_buf), PAGE)
        except OSError as e:
            raise StoreError(
                f"writing the row flags of '{self.path}' failed ({e.strerror})", path=self.path
            ) from None

    # -- copies (checkpoints) ----------------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """Bytes of one block on disk."""
        return self.units_per_block * self.unit_bytes

    def snapshot(self, dst: str) -> None:
        """Copy this file to ``dst``, durably: the header, the row flags and the blocks holding rows on disk (the
        others stay holes), one block at a time (the caller has written the host tier's dirty rows). Written under
        a temporary name and renamed, so ``dst`` is whole or absent.

        Raises:
            StoreError: ``dst`` cannot be written (the disk is full: the free bytes are named).
        """
        tmp = dst + ".partial"
        buf = aligned_buffer(max(self.data_offset, self.block_bytes))
        view = memoryview(buf)
        out = -1
        try:
            os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.ftruncate(out, self.size)
            self._read_exact(view[:PAGE], 0)  # the header
            _pwrite_all(out, view[:PAGE], 0)
            _pwrite_all(out, memoryview(self._flags_buf), PAGE)  # the flags of the blocks copied below
            for block in self.blocks_on_disk().tolist():
                offset = self.data_offset + block * self.block_bytes
                self._read_exact(view[: self.block_bytes], offset)
                _pwrite_all(out, view[: self.block_bytes], offset)
                os.posix_fadvise(out, offset, self.block_bytes, os.POSIX_FADV_DONTNEED)
            os.fsync(out)
            os.close(out)
            out = -1
            os.replace(tmp, dst)
            _fsync_dir(os.path.dirname(os.path.abspath(dst)))
        except OSError as e:
            if out >= 0:
                os.close(out)
            if os.path.exists(tmp):
                os.unlink(tmp)
            free = _free_bytes(dst)
            raise StoreError(
                f"copying disk store '{self.path}' to '{dst}' failed ({e.strerror}; {free:,} bytes free there): the "
                "store itself is unchanged",
                path=dst,
            ) from None
        finally:
            view.release()

    def restore(self, src: str) -> None:
        """Make this file hold what the copy ``src`` (:meth:`snapshot` of a file of this table, size, layout and
        seed) holds: its rows on disk and their flags (a row not on disk in ``src`` holds its initial value here),
        durably.

        Raises:
            ConfigError: ``src`` is not such a copy (the fields that differ are named); nothing is written then.
            StoreError: reading ``src`` or writing this file failed.
        """
        found = read_header(src)
        diffs = [
            f"{k}: copy {found.get(k)!r}, store {v!r}" for k, v in self.meta.items() if found.get(k) != v
        ]
        if not diffs and os.path.getsize(src) != self.size:
            diffs = [f"size: copy {os.path.getsize(src):,} bytes, store {self.size:,}"]
        if diffs:
            raise ConfigError(
                f"'{src}' is not a copy of disk store '{self.path}' ({'; '.join(diffs)}): it was written for another "
                "table, shard, layout or seed, or is truncated"
            )
        buf = aligned_buffer(max(len(self._flags_buf), self.block_bytes))
        view = memoryview(buf)
        fd = -1
        try:
            fd = os.open(src, os.O_RDONLY)
            _pread_all(fd, view[: len(self._flags_buf)], PAGE, src)
            self.flags[:] = np.frombuffer(buf, dtype=np.uint8, count=self.num_rows)
            for block in self.blocks_on_disk().tolist():
                offset = self.data_offset + block * self.block_bytes
                _pread_all(fd, view[: self.block_bytes], offset, src)
                self._write_exact(view[: self.block_bytes], offset)
                os.posix_fadvise(fd, offset, self.block_bytes, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise StoreError(
                f"restoring disk store '{self.path}' from '{src}' failed ({e.strerror})", path=self.path
            ) from None
        finally:
            view.release()
            if fd >= 0:
                os.close(fd)
        self.sync()
        self.write_flags()
        self.sync()

    def sync(self) -> None:
        """Make every write so far durable (fsync)."""
        try:
            os.fsync(self._fd)
        except OSError as e:
            raise StoreError(
                f"fsync of disk store '{self.path}' failed ({e.strerror})", path=self.path
            ) from None

    def close(self) -> None:
        """Stop the I/O threads and close the file (idempotent)."""
        self._pool.shutdown(wait=True)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._fd < 0


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _pread_all(fd: int, view: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise StoreError(f"disk store '{path}' ended at byte {offset + done}", path=path)
        done += n


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _free_bytes(path: str) -> int:
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
        return int(st.f_bavail * st.f_frsize)
    except OSError:
        return -1


def read_header(path: str) -> Dict[str, Any]:
    """The layout a disk store file records in its header.

    Raises:
        ConfigError: no file, or not a disk store's.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(PAGE)
    except OSError as e:
        raise ConfigError(f"no disk store at '{path}' ({e.strerror})") from None
    if not head.startswith(MAGIC):
        raise ConfigError(f"'{path}' is not a disk store file (no {FORMAT} header)")
    length = int.from_bytes(head[len(MAGIC) : len(MAGIC) + 4], "little")
    meta: Dict[str, Any] = json.loads(head[len(MAGIC) + 4 : len(MAGIC) + 4 + length].decode())
    return meta
