"""The file of a :class:`~torchrec_lookahead.store.DiskStore`: a log of records, its index, aligned positional I/O.

One file per table (or row shard), in 4 KiB pages::

    page 0                  header: magic, then the layout as JSON (table, rows, dim, state layout, seed, version,
                            unit size, log size)
    page 1                  the log's head and tail (two int64 unit counters)
    pages 2 .. I            the index: per row a uint32, 0 while the row is not on disk, else its log slot + 1
    pages I+1 ..            the log: ``log_units`` units of ``unit_bytes``, ``rows_per_unit`` record slots each

A *unit* is the smallest piece read or written: one page holding ``rows_per_unit`` whole records (a record is
one row ``[weight | states]``, float32), or, for records over a page, the pages of one record. Records never
straddle units, so a row is read with the one unit that holds it.

Rows are written by appending: a batch of rows goes, packed, to the units at the log's head, written in
sequential runs with no read first, and the index points each row at its new slot (its old copy is dead). The
log is a ring: when the units between the tail and the head would not leave room for an append, the cleaner
reads units at the tail, appends the rows still live there (the index still points at them) to the head and
advances the tail past them. The log holds the table's rows and an eighth more (at least 64 units), so a
cleaned unit frees on average at least 1/9 of its slots even with every row of the table on disk, and far more
while few are (the rows trained so far). A row never written is not on disk: its value is its initial value,
computed (``init_rows_at``). Reads and writes go through aligned buffers, with ``O_DIRECT`` where the filesystem
takes it (else buffered, with ``posix_fadvise(DONTNEED)`` after each call so that the page cache does not hold
the table), issued in parallel runs of consecutive units from a small thread pool.

The index is written (:meth:`DiskFile.write_index`) at a flush, after the rows it points at are durable. Between
flushes the file on disk is not consistent (the cleaner reuses units the last written index may point at): a run
resumes from a checkpoint's copy of the file, made after a flush.
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

from torchrec_lookahead._arrays import sorted_unique
from torchrec_lookahead.errors import ConfigError, SetupError, StoreError
from torchrec_lookahead.store._disk_io import (
    FORMAT,
    MAGIC,
    MAX_RUN_BYTES,
    PAGE,
    aligned_buffer,
    each,
    free_bytes,
    pread_all,
    pwrite_all,
    runs,
)

__all__: List[str] = []

log = logging.getLogger(__name__)

VERSION = 3  # 1: one flag per block, blocks written whole; 2: one flag per row, rows written in place
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_CLEAN_UNITS = 256  # units the cleaner reads at once from the tail
_MIN_SPARE_UNITS = 64  # the log holds the table's units and an eighth more, at least this many more
_LIVE_BLOCK_ROWS = 1 << 22  # rows of the index read at a time by live_units


class DiskFile:
    """The records of one table in a log file, addressed by local row through the index (``loc``: 0 while a row
    is not on disk, else its slot + 1).

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
        self.record_floats = record_floats
        if self.record_bytes <= PAGE:
            self.rows_per_unit, self.unit_bytes = PAGE // self.record_bytes, PAGE
        else:
            self.rows_per_unit, self.unit_bytes = 1, -(-self.record_bytes // PAGE) * PAGE
        table_units = -(-num_rows // self.rows_per_unit)
        spare = max(_MIN_SPARE_UNITS, table_units // 8)
        self.num_units = table_units + spare
        # the cleaner keeps this many units free (the live rows of the units it cleans go there, never over the
        # units being cleaned), and one append writes at most half the spare units at once
        self._reserve = max(1, min(_CLEAN_UNITS, spare // 4))
        self._append_units = max(1, min(spare // 2, 4096))  # and at most 16 MiB of 4 KiB units
        self.num_slots = self.num_units * self.rows_per_unit
        index_pages = 1 + -(-num_rows * 4 // PAGE)
        self.index_bytes = index_pages * PAGE
        self.data_offset = PAGE + self.index_bytes
        self.size = self.data_offset + self.num_units * self.unit_bytes
        self.meta = dict(
            meta, unit_bytes=self.unit_bytes, rows_per_unit=self.rows_per_unit, log_units=self.num_units
        )
        # zero-filled anonymous memory: the pages of rows never written cost nothing
        self._index_buf = aligned_buffer(self.index_bytes)
        self._ends = np.frombuffer(self._index_buf, dtype=np.int64, count=2)  # head, tail (unit counters)
        self.loc = np.frombuffer(self._index_buf, dtype=np.uint32, count=num_rows, offset=PAGE)
        self._row_buf = aligned_buffer(self.num_slots * 4)
        self._row_of = np.frombuffer(self._row_buf, dtype=np.uint32, count=self.num_slots)  # slot -> row + 1
        # rows whose values were written (appended, not moved by the cleaner) since the last checkpoint piece
        self.changed_rows = np.zeros(num_rows, dtype=bool)
        # a full checkpoint piece copied in the background holds the units it copies (hold()): no append writes
        # over the oldest not yet copied (its log counter: _held_low) until it is copied
        self._held = threading.Condition()
        self._held_low: Optional[int] = None
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
            self._read_exact(memoryview(self._index_buf), PAGE)
            self._check_index(path)
            self._index_rows()
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
            self._write_exact(memoryview(header), 0)  # the index is the file's zeros: no row on disk
            os.fsync(self._fd)
        except OSError as e:
            self.close()
            os.unlink(self.path)
            if e.errno in _NO_SPACE:
                free = free_bytes(self.path)
                raise StoreError(
                    f"no space for disk store '{self.path}': it needs {self.size:,} bytes, {free:,} are free; "
                    "free space or choose another store_dir",
                    path=self.path,
                ) from None
            raise SetupError(f"cannot create disk store '{self.path}' ({e.strerror})") from None

    # -- positional I/O --------------------------------------------------------------------------------------
    def _read_exact(self, view: memoryview, offset: int) -> None:
        pread_all(self._fd, view, offset, self.path)
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
        parts = runs(units, ub)
        try:
            if len(parts) == 1:
                i, n = parts[0]
                op(view[i * ub : (i + n) * ub], self._unit_offset(int(units[i])))
            else:  # one task per thread, each going through its share of the runs: io_threads requests in flight
                jobs = [(view[i * ub : (i + n) * ub], self._unit_offset(int(units[i]))) for i, n in parts]
                shares = [jobs[k :: self._threads] for k in range(min(self._threads, len(jobs)))]
                futures = [self._pool.submit(each, op, share) for share in shares]
                for f in futures:
                    f.result()
        except OSError as e:
            if write and e.errno in _NO_SPACE:
                raise StoreError(
                    f"the disk of store '{self.path}' is full ({e.strerror}) after {self.bytes_written:,} bytes "
                    f"written ({free_bytes(self.path):,} free); rows not yet written stay in host memory, the file is "
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

    def _check_index(self, path: str, buf: Optional[mmap.mmap] = None) -> None:
        """Refuse an index (this file's, or the one in ``buf``) that does not fit the log (a damaged file)."""
        buf = self._index_buf if buf is None else buf
        head, tail = (int(v) for v in np.frombuffer(buf, dtype=np.int64, count=2))
        loc = np.frombuffer(buf, dtype=np.uint32, count=self.num_rows, offset=PAGE)
        top = int(loc.max()) if self.num_rows else 0
        if not 0 <= tail <= head <= tail + self.num_units or top > self.num_slots:
            raise ConfigError(
                f"disk store '{path}' has a damaged index (head {head}, tail {tail}, highest slot {top} of "
                f"{self.num_slots}): delete the file to start afresh"
            )

    def _index_rows(self) -> None:
        """Rebuild slot -> row from the index."""
        self._row_buf.madvise(mmap.MADV_DONTNEED)  # zero again, without touching the pages
        rows = np.flatnonzero(self.loc)
        self._row_of[self.loc[rows].astype(np.int64) - 1] = (rows + 1).astype(np.uint32)

    # -- records ----------------------------------------------------------------------------------------------
    def on_disk(self, rows: np.ndarray) -> np.ndarray:
        """Whether each local row is on disk (written at least once)."""
        return self.loc[rows] != 0

    def rows_on_disk(self) -> int:
        """Rows on disk."""
        return int(np.count_nonzero(self.loc))

    def slots_of(self, rows: np.ndarray) -> np.ndarray:
        """The log slot of each local row, -1 where it is not on disk (one read of the index: a consistent
        snapshot for a reader without the store's lock)."""
        return self.loc[rows].astype(np.int64) - 1

    def units_of(self, slots: np.ndarray) -> np.ndarray:
        """The sorted distinct units holding ``slots``."""
        return sorted_unique(slots // self.rows_per_unit)

    def record_index(self, units: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """(n, record_floats) indices of the records at ``slots`` into the float32 view of a buffer holding the
        sorted ``units``."""
        unit, slot = np.divmod(slots, self.rows_per_unit)
        pos = np.searchsorted(units, unit) * (self.unit_bytes // 4) + slot * self.record_floats
        return pos[:, None] + np.arange(self.record_floats)[None, :]

    def read_units(self, units: np.ndarray) -> Tuple[mmap.mmap, np.ndarray]:
        """Read sorted distinct ``units``; returns the buffer and its float32 view (unit ``i`` at
        ``i * unit_bytes / 4``)."""
        buf = aligned_buffer(units.size * self.unit_bytes)
        self._io(units, buf, write=False)
        return buf, np.frombuffer(buf, dtype=np.float32)

    def read_rows(self, slots: np.ndarray) -> Tuple[np.ndarray, int]:
        """The records at ``slots`` (all >= 0) and the units read."""
        units = self.units_of(slots)
        if units.size == 0:
            return np.empty((0, self.record_floats), dtype=np.float32), 0
        _, flat = self.read_units(units)
        return flat[self.record_index(units, slots)], int(units.size)

    def append(self, rows: np.ndarray, records: np.ndarray) -> Tuple[int, int, np.ndarray]:
        """Write the ``records`` of distinct local ``rows`` at the log's head and point the index at them, making
        room first by cleaning the tail. Returns the units written, the units the cleaner read, and the rows it
        moved (their slots changed: a reader that located them before must drop what it read).

        Raises:
            StoreError: the I/O failed (a full disk: the free bytes are named); the index is unchanged for the
                rows not written.
        """
        written = read = 0
        moved: List[np.ndarray] = []
        rpu = self.rows_per_unit
        chunk = self._append_units * rpu
        for a in range(0, rows.size, chunk):
            r, rec = rows[a : a + chunk], records[a : a + chunk]
            units_read, units_moved, moved_rows = self._make_room(-(-r.size // rpu))
            read += units_read
            written += units_moved
            if moved_rows.size:
                moved.append(moved_rows)
            written += self._put(r, rec)
            self.changed_rows[r] = True
        return written, read, np.concatenate(moved) if moved else np.empty(0, dtype=np.int64)

    def _free_units(self) -> int:
        return self.num_units - int(self._ends[0] - self._ends[1])

    def _make_room(self, need: int) -> Tuple[int, int, np.ndarray]:
        """Clean the tail until ``need`` units are free past the reserve: read the tail's units, append their live
        rows at the head (into the reserve, never over the units read), then free the units. A failed write
        changes nothing. Returns the units read, the units written and the rows moved."""
        read = written = 0
        moved: List[np.ndarray] = []
        cleaned = 0
        rpu = self.rows_per_unit
        while self._free_units() < need + self._reserve:
            head, tail = int(self._ends[0]), int(self._ends[1])
            pos = tail % self.num_units
            k = min(self._reserve, head - tail, self.num_units - pos)
            if k <= 0 or cleaned > 2 * self.num_units:  # cannot happen while the log is larger than the table
                raise StoreError(
                    f"disk store '{self.path}': no room in its log for {need} units", path=self.path
                )
            units = np.arange(pos, pos + k, dtype=np.int64)
            live, rows = self.live_slots(units)
            if live.size:
                _, flat = self.read_units(units)
                read += k
                written += self._put(rows, flat[self.record_index(units, live)])
                moved.append(rows)
            self._row_of[pos * rpu : (pos + k) * rpu] = 0
            self._ends[1] = tail + k
            cleaned += k
        return read, written, np.concatenate(moved) if moved else np.empty(0, dtype=np.int64)

    def _put(self, rows: np.ndarray, records: np.ndarray) -> int:
        """Write ``records`` packed into the units at the head (room made), then point the index at them.
        Returns the units written."""
        rpu = self.rows_per_unit
        written = 0
        while rows.size:
            head = int(self._ends[0])
            pos = head % self.num_units
            # up to the end of the ring, the rest from its start
            n = min(rows.size, (self.num_units - pos) * rpu)
            units = pos + np.arange(-(-n // rpu), dtype=np.int64)
            self._wait_for_held(head + units.size)
            buf = aligned_buffer(units.size * self.unit_bytes)
            flat = np.frombuffer(buf, dtype=np.float32)
            slots = pos * rpu + np.arange(n, dtype=np.int64)
            flat[self.record_index(units, slots)] = records[:n]
            self._io(units, buf, write=True)
            old = self.loc[rows[:n]].astype(np.int64) - 1
            self._row_of[old[old >= 0]] = 0
            self.loc[rows[:n]] = (slots + 1).astype(np.uint32)
            self._row_of[slots] = (rows[:n] + 1).astype(np.uint32)
            self._ends[0] = head + units.size
            written += units.size
            rows, records = rows[n:], records[n:]
        return written

    def reset(self) -> None:
        """Forget every row (none on disk, an empty log); the index is written at the next :meth:`write_index`."""
        self._index_buf.madvise(mmap.MADV_DONTNEED)  # zero again, without touching the pages
        self._row_buf.madvise(mmap.MADV_DONTNEED)

    def live_slots(self, units: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """The slots of sorted distinct ``units`` that hold a row on disk (sorted), and those rows."""
        slots = (units[:, None] * self.rows_per_unit + np.arange(self.rows_per_unit)[None, :]).reshape(-1)
        owner = self._row_of[slots].astype(np.int64) - 1
        live = owner >= 0
        live[live] = self.loc[owner[live]].astype(np.int64) - 1 == slots[live]
        return slots[live], owner[live]

    def live_units(self, loc: Optional[np.ndarray] = None) -> np.ndarray:
        """The sorted distinct units holding a row on disk (marked in a flag per unit: no sort of the rows), by
        this file's index or by ``loc``, another index of it (a checkpoint piece's)."""
        loc = self.loc if loc is None else loc
        live = np.zeros(self.num_units, dtype=bool)
        for a in range(0, self.num_rows, _LIVE_BLOCK_ROWS):
            block = loc[a : a + _LIVE_BLOCK_ROWS]
            live[(block[block != 0].astype(np.int64) - 1) // self.rows_per_unit] = True
        return np.flatnonzero(live)

    def write_index(self) -> None:
        """Write the log's ends and the index (call after the rows it points at are durable)."""
        try:
            self._write_exact(memoryview(self._index_buf), PAGE)
        except OSError as e:
            raise StoreError(
                f"writing the index of '{self.path}' failed ({e.strerror})", path=self.path
            ) from None

    # -- copies (checkpoints: _disk_chain) ------------------------------------------------------------------
    def _copy_units(
        self,
        units: np.ndarray,
        src: int,
        dst: int,
        src_path: str,
        copied: Optional[Callable[[int], None]] = None,
    ) -> None:
        """Copy ``units`` from the file ``src`` to ``dst`` (file descriptors), runs of consecutive units at once,
        calling ``copied`` with the count of ``units`` copied so far after each run."""
        buf = aligned_buffer(MAX_RUN_BYTES if self.unit_bytes <= MAX_RUN_BYTES else self.unit_bytes)
        view = memoryview(buf)
        try:
            for i, n in runs(units, self.unit_bytes):
                offset = self.data_offset + int(units[i]) * self.unit_bytes
                nbytes = n * self.unit_bytes
                pread_all(src, view[:nbytes], offset, src_path)
                pwrite_all(dst, view[:nbytes], offset)
                for fd in (src, dst):
                    os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
                if copied is not None:
                    copied(i + n)
        finally:
            view.release()

    def hold(self, units: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Hold the live ``units`` for a copy made while the log goes on (a checkpoint's full piece written in the
        background): until :meth:`release_held` passes a unit, no append writes over it (one that would waits).
        Returns the units in log order, oldest first (the order to copy them in), and their log counters."""
        tail = int(self._ends[1])
        order = np.argsort((units - tail) % self.num_units, kind="stable")
        counters = tail + (units[order] - tail) % self.num_units
        self.release_held(int(counters[0]) if counters.size else None)
        return units[order], counters

    def release_held(self, counter: Optional[int]) -> None:
        """Hold the units from log counter ``counter`` on only (``None``: none)."""
        with self._held:
            self._held_low = counter
            self._held.notify_all()

    def _wait_for_held(self, head: int) -> None:
        """Wait until the log may grow to counter ``head`` without writing over a held unit."""
        with self._held:
            while self._held_low is not None and head > self._held_low + self.num_units:
                self._held.wait()

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
