"""Embedding store on disk under a bounded host-memory tier, for tables larger than host RAM.

Rows and their optimizer state live in one file per table (layout in :mod:`torchrec_lookahead.store._disk_file`),
read and written with direct I/O (no page cache: the process's memory is what ``host_budget_bytes`` says), in
parallel from a small thread pool. Between the file and the device cache, a host tier of at most
``host_budget_bytes`` keeps rows; the dirty rows evicted from it together are appended to the file's log, packed
and written sequentially, with no read first (the old copies die; a cleaner moves the live rows off the log's
tail when it needs room).

Which rows the host tier keeps is its ``host_policy``:

* ``"lru"``: the rows used most recently; rows are read from the file when a gather misses them.
* ``"lookahead"``: the rows the plans of the coming steps read soonest (Belady over the known steps). The
  lookahead loader's planner tells the store, with :meth:`DiskStore.plan_reads`, which rows each planned step
  will gather, and the stager says with :meth:`DiskStore.at_step` which step it gathers now. A background
  thread reads the rows of steps up to ``disk_prefetch_depth`` ahead of the gathered one into the host tier (one
  batched, parallel read per step), evicting for them only rows next needed later than that step or not known
  to be needed. A gather evicts the rows next needed furthest away (those known to be needed by no planned step
  first, least recently used first among them) and never the rows it serves. The hints decide only where rows
  are: a gather reads what the host tier lacks from the file, so values are the latest written whatever the
  hints (wrong, missing or extra ones included).

Nothing initialises the table, at set-up or later: a row never written is not on disk, and reading it computes
its initial value (:func:`~torchrec_lookahead.store.init_rows_at`, bit for bit a
:class:`~torchrec_lookahead.store.TensorStore`'s) without any I/O. The file's index says which rows are on disk
(and where), so only rows trained at least once are ever read from the disk.

:meth:`DiskStore.flush` writes every dirty row, fsyncs, then writes and fsyncs the index, so the file holds
every write before the flush (a checkpoint calls it, then copies the file). Writes after it may reach the file
before a crash and the cleaner may reuse units the index on disk points at: a run resumes from its checkpoint,
which holds a copy of the file.
"""

from __future__ import annotations

import os
import threading
import uuid
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.store._disk_chain import Chain, Writer, prepare_piece, read_chain
from torchrec_lookahead.store._disk_file import DiskFile
from torchrec_lookahead.store._disk_io import read_header
from torchrec_lookahead.store._disk_lookahead import LookaheadReads
from torchrec_lookahead.store._host_tier import HostTier
from torchrec_lookahead.store._row_store import _RowStore
from torchrec_lookahead.store.init import INIT_BLOCK_ROWS, init_rows_at
from torchrec_lookahead.store.types import HostWindow, check_load

__all__ = ["DiskStore", "DEFAULT_HOST_BUDGET_BYTES", "HOST_POLICIES", "check_host_policy"]

PathLike = Union[str, "os.PathLike[str]"]

DEFAULT_HOST_BUDGET_BYTES: int = 64 << 20
"""Host tier size when none is given (64 MiB)."""

_EVICT_FRACTION = (
    8  # LRU: when full, evict at least 1/8 of the tier at once (one scan of the tier per eviction)
)

_FLUSH_ROWS = 1 << 18  # a flush writes the host tier's dirty rows this many at a time

HOST_POLICIES = ("lru", "lookahead")
"""What the host tier keeps: the rows used most recently, or those the coming steps read soonest."""


def check_host_policy(host_policy: str, disk_prefetch_depth: int) -> None:
    """Refuse a host policy not in :data:`HOST_POLICIES` or a disk prefetch depth below 0.

    Raises:
        ConfigError: the policy or the depth (the message names the accepted values).

    Example:
        >>> check_host_policy("lookahead", 16)
    """
    if host_policy not in HOST_POLICIES:
        raise ConfigError(f"host_policy must be one of {list(HOST_POLICIES)} but got {host_policy!r}")
    if (
        isinstance(disk_prefetch_depth, bool)
        or not isinstance(disk_prefetch_depth, int)
        or disk_prefetch_depth < 0
    ):
        raise ConfigError(f"disk_prefetch_depth must be an int >= 0 but got {disk_prefetch_depth!r}")


class DiskStore(LookaheadReads, _RowStore):
    """A table and its per-row optimizer state in a file on disk, under a bounded host-memory tier.

    Creates the file when it does not exist, reopens it (refusing another table's, size's, layout's or seed's
    file) when it does.

    Args:
        path: file path (its directory is created if needed).
        num_embeddings: rows of the table (or of the shard).
        embedding_dim: width of a row.
        state_widths: optimizer state name -> columns per row.
        name: table name (seeds the initial values; recorded in the header).
        seed: global seed of the initial values.
        host_budget_bytes: bytes of rows (with their optimizer state) the host tier holds at most; at least one
            row. The host tier's row -> slot index adds 4 bytes per table row, the file's index 4 more and its
            slot -> row map 4.5, each touched only where rows are used or written.
        row_offset: for a row shard of a larger table: the table row held by local row 0.
        table_rows: rows of the whole table when the store is a shard (default ``num_embeddings``).
        direct_io: ``None`` (default): direct I/O (``O_DIRECT``) where the filesystem takes it, else buffered I/O
            with ``posix_fadvise(DONTNEED)`` and a logged warning; ``True``: require it; ``False``: buffered.
        io_threads: threads issuing reads and writes in parallel.
        preallocate: reserve the file's blocks at creation (``posix_fallocate``), so that a full disk is found
            at set-up rather than mid-run.
        host_policy: ``"lru"`` (default) or ``"lookahead"``: which rows the host tier keeps (module docstring).
        disk_prefetch_depth: with ``host_policy="lookahead"``, how many steps ahead of the gathered step the
            background thread reads the planned rows into the host tier (0: no background reads; the hints
            still rank the evictions).
        budget_split: how one int ``host_budget_bytes`` was split (messages only; see ``HostWindow``).

    Raises:
        ConfigError: a size is not positive, the budget holds no row, an unknown host policy or a negative
            prefetch depth, or an existing file was created for another table, size, layout or seed (the
            message names the fields).
        SetupError: the directory is not writable, or ``direct_io=True`` and the filesystem refuses it.
        StoreError: the disk has no room for the file.

    Example:
        >>> import tempfile, os, torch
        >>> d = tempfile.mkdtemp()
        >>> store = DiskStore(os.path.join(d, "t0.rows"), 100_000, 4, {"momentum1": 1}, name="t0",
        ...                   host_budget_bytes=1000 * 20)
        >>> store.scatter(torch.tensor([5]), torch.ones(1, 4), {"momentum1": torch.ones(1, 1)})
        >>> store.close()
        >>> again = DiskStore.open(os.path.join(d, "t0.rows"), host_budget_bytes=1000 * 20)
        >>> again.gather(torch.tensor([5]))[0].tolist(), again.num_embeddings
        ([[1.0, 1.0, 1.0, 1.0]], 100000)
        >>> again.close()
    """

    def __init__(
        self,
        path: PathLike,
        num_embeddings: int,
        embedding_dim: int,
        state_widths: Optional[Mapping[str, int]] = None,
        *,
        name: str = "table",
        seed: int = 0,
        host_budget_bytes: int = DEFAULT_HOST_BUDGET_BYTES,
        row_offset: int = 0,
        table_rows: Optional[int] = None,
        direct_io: Optional[bool] = None,
        io_threads: int = 8,
        preallocate: bool = True,
        host_policy: str = "lru",
        disk_prefetch_depth: int = 0,
        budget_split: Tuple[int, int] = (0, 0),
    ) -> None:
        super().__init__(
            name, num_embeddings, embedding_dim, state_widths, seed, INIT_BLOCK_ROWS, row_offset, table_rows
        )
        row_bytes = self._shape.row_bytes
        if int(host_budget_bytes) < row_bytes:
            raise ConfigError(
                f"host_budget_bytes for table '{self.name}' must hold at least one row ({row_bytes} bytes) but "
                f"got {host_budget_bytes}; raise it"
            )
        if int(io_threads) < 1:
            raise ConfigError(f"io_threads must be >= 1 but got {io_threads}")
        check_host_policy(host_policy, disk_prefetch_depth)
        self._path = os.fspath(path)
        self._budget = int(host_budget_bytes)
        self._budget_split = (int(budget_split[0]), int(budget_split[1]))
        self._file = DiskFile(
            self._path,
            self._meta(),
            self.num_embeddings,
            self.row_width,
            direct_io,
            int(io_threads),
            preallocate,
        )
        self._tier = HostTier(
            min(self._budget // row_bytes, self.num_embeddings),
            self.row_width,
            self.num_embeddings,
            count_fetches=host_policy == "lookahead",
        )
        self._lock = threading.Lock()  # the host tier and the file, one call at a time
        self._all_init = True  # no chunk is initialised: rows not on disk are computed when read
        self._counts = dict.fromkeys(
            (
                "host_hits",
                "rows_read",
                "rows_first_read",
                "rows_initialised",
                "rows_written",
                "unit_reads",
                "unit_writes",
                "rows_moved",
                "rows_prefetched",
                "prefetch_discarded",
                "rows_written_through",
            ),
            0,
        )
        self._policy = host_policy
        self._depth = int(disk_prefetch_depth)
        # lookahead: the rows each planned step gathers (sorted distinct ids), from the gathered step on
        self._hints: Dict[int, np.ndarray] = {}
        # lookahead: the rows each step's batch looks up, as far ahead as the planner has read
        self._uses: Dict[int, np.ndarray] = {}
        self._first = None  # lookahead: the hints merged per id (built once per gathered step, when asked)
        self._step = -1  # the step gathered last (at_step)
        self._read_upto = -1  # the background thread has read every hinted step up to this one
        self._written: Optional[List[np.ndarray]] = None  # ids written to the file while a prefetch reads
        self._reset = False  # the tier was cleared (load) while a prefetch read
        self._chain: Optional[Chain] = None  # the checkpoint pieces the file was last saved as or loaded from
        self._inflight: Optional[np.ndarray] = None  # the rows a background read is reading now
        self._wake = threading.Condition(self._lock)
        self._closing = False
        self._reader: Optional[threading.Thread] = None
        if self._policy == "lookahead" and self._depth > 0:
            self._reader = threading.Thread(
                target=self._prefetch_loop, name=f"disk-prefetch-{name}", daemon=True
            )
            self._reader.start()

    @classmethod
    def open(cls, path: PathLike, **kwargs: Any) -> DiskStore:
        """Reopen an existing store with the sizes and layout its header records.

        Args:
            path: file path given when the store was created.
            kwargs: the host-tier and I/O arguments (``host_budget_bytes``, ``direct_io``, ``io_threads``).

        Raises:
            ConfigError: no file, or not a disk store's.
        """
        meta = read_header(os.fspath(path))
        return cls(
            path,
            meta["num_embeddings"],
            meta["embedding_dim"],
            meta["state_widths"],
            name=meta["name"],
            seed=meta["seed"],
            row_offset=meta["row_offset"],
            table_rows=meta["table_rows"],
            **kwargs,
        )

    def _meta(self) -> Dict[str, Any]:
        from torchrec_lookahead.store._disk_file import FORMAT, VERSION

        return {
            "format": FORMAT,
            "version": VERSION,
            **self._shape.fields(),
            "seed": self._seed,
            "row_offset": self._row_offset,
            "table_rows": self._table_rows,
            "dtype": "float32",
        }

    # -- properties ------------------------------------------------------------------------------------------
    @property
    def path(self) -> str:
        """File path."""
        return self._path

    @property
    def host_budget_bytes(self) -> int:
        """The host tier's budget in bytes."""
        return self._budget

    @property
    def host_capacity(self) -> int:
        """Rows the host tier holds at most."""
        return self._tier.capacity

    @property
    def host_policy(self) -> str:
        """Which rows the host tier keeps: ``"lru"`` or ``"lookahead"``."""
        return self._policy

    @property
    def uses_hints(self) -> bool:
        """Whether the planner's :meth:`plan_uses` hints rank the host tier's rows (the lookahead policy)."""
        return self._policy == "lookahead"

    @property
    def disk_prefetch_depth(self) -> int:
        """Steps ahead of the gathered one the planned rows are read into the host tier (lookahead policy)."""
        return self._depth

    @property
    def host_window(self) -> HostWindow:
        """What one window of steps must fit in: one step's rows under ``"lru"``, the gathered step's and the next
        ``disk_prefetch_depth`` steps' under ``"lookahead"`` (see
        :class:`~torchrec_lookahead.store.types.HostWindow`)."""
        depth = self._depth if self._policy == "lookahead" else 0
        what = (self._policy, self._shape.row_bytes, self._budget_split)
        return HostWindow(depth, (0, self.num_embeddings), (self._tier.capacity,), *what)

    @property
    def direct_io(self) -> bool:
        """Whether the file is read and written with ``O_DIRECT`` (else buffered with ``posix_fadvise``)."""
        return self._file.direct

    def stats(self) -> Dict[str, int]:
        """Counters: ``host_hits`` (rows served by the host tier), ``rows_initialised`` (rows missed by the host
        tier that were never written: their initial values computed, no I/O), ``rows_read`` / ``rows_written``
        (rows moved between the host and the disk, the background reads included), ``rows_read`` split into
        ``rows_first_read`` (reads of rows the host tier never held nor read before) and ``rows_reread`` (the
        rest), ``rows_written_through`` (rows written to the file without entering the host tier: a call larger
        than the tier, or under the lookahead policy a write-back ranked below every row the tier holds),
        ``rows_prefetched`` (rows the background thread read into the host tier), ``prefetch_discarded`` (rows
        it read but did not keep: written meanwhile, or no room left), ``unit_reads`` / ``unit_writes`` (disk
        units, the log cleaner's included), ``rows_moved`` (live rows the cleaner moved from the log's tail to its
        head), ``bytes_read`` / ``bytes_written``, ``rows_on_disk`` (rows written at least once),
        ``host_rows`` (rows in the host tier now) and ``host_capacity``."""
        return dict(
            self._counts,
            rows_reread=self._counts["rows_read"] - self._counts["rows_first_read"],
            bytes_read=self._file.bytes_read,
            bytes_written=self._file.bytes_written,
            rows_on_disk=self._file.rows_on_disk(),
            host_rows=self._tier.capacity - self._tier.num_free,
            host_capacity=self._tier.capacity,
        )

    # -- initial values: computed, never stored --------------------------------------------------------------
    def _rows(self) -> torch.Tensor:
        raise NotImplementedError("a DiskStore has no backing tensor")

    def _initial_records(self, rows: np.ndarray) -> np.ndarray:
        """Records of local ``rows`` at their initial values (weights from ``init_rows_at``, zero states)."""
        records = np.zeros((rows.size, self.row_width), dtype=np.float32)
        records[:, : self.embedding_dim] = init_rows_at(
            self._seed, self.name, rows + self._row_offset, self.embedding_dim, self._table_rows
        )
        return records

    def _check_open(self) -> None:
        if self._file.closed:
            raise ConfigError(f"disk store '{self._path}' is closed; reopen it with DiskStore.open")

    # -- disk rows ------------------------------------------------------------------------------------------
    def _read_rows(self, ids: np.ndarray) -> np.ndarray:
        """Records of sorted distinct ``ids``: read from the file where on disk, computed elsewhere."""
        records, units, on_disk = self._read_uncounted(ids)
        read = int(on_disk.sum())
        self._counts["rows_read"] += read
        self._counts["rows_initialised"] += ids.size - read
        self._counts["rows_first_read"] += self._tier.mark_held(ids[on_disk])
        self._tier.mark_held(ids[~on_disk])
        self._counts["unit_reads"] += units
        return records

    def _read_uncounted(self, ids: np.ndarray) -> Tuple[np.ndarray, int, np.ndarray]:
        """Records of sorted distinct ``ids`` (from the file for the rows on disk, computed for the others), the
        units read and which ids were on disk (no lock needed: the file's calls are thread-safe, the index is
        read once, and a row written or moved meanwhile is the caller's to drop)."""
        slots = self._file.slots_of(ids)
        on_disk = slots >= 0
        records = np.empty((ids.size, self.row_width), dtype=np.float32)
        if not on_disk.all():
            records[~on_disk] = self._initial_records(ids[~on_disk])
        stored, units = self._file.read_rows(slots[on_disk])
        records[on_disk] = stored
        return records, units, on_disk

    def _write_rows(self, ids: np.ndarray, records: np.ndarray) -> None:
        """Append records of distinct ``ids`` to the file's log (sequential units, no read first; the cleaner
        may read and move live rows off the log's tail first)."""
        if ids.size == 0:
            return
        written, read, moved = self._file.append(ids, records)
        if self._written is not None:
            self._written.append(ids.copy())
            if moved.size:
                self._written.append(moved)
        self._counts["rows_written"] += ids.size
        self._counts["rows_moved"] += moved.size
        self._counts["unit_reads"] += read
        self._counts["unit_writes"] += written

    def _make_room(self, count: int, kept: int) -> None:
        """LRU: free ``count`` slots, evicting the least recently used rows (at least 1/8 of the tier) but never
        the ``kept`` rows the current call touched (the most recent), writing the dirty ones back first: if the
        write fails, nothing is evicted."""
        tier = self._tier
        if tier.num_free >= count:
            return
        want = max(count - tier.num_free, tier.capacity // _EVICT_FRACTION)
        self._evict(tier.victims(min(want, tier.capacity - tier.num_free - kept)))

    def _evict(self, victims: np.ndarray) -> None:
        """Write back the dirty rows of ``victims``, then free their slots (nothing freed if the write fails)."""
        tier = self._tier
        dirty = victims[tier.dirty[victims]]
        if dirty.size:
            ids = tier.id_of[dirty]
            order = np.argsort(ids)
            self._write_rows(ids[order], tier.rows.numpy()[dirty[order]])
        tier.drop(victims)

    # -- EmbeddingStore --------------------------------------------------------------------------------------
    def gather(self, ids: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        ids = self._check_ids(ids, unique=False)
        with self._lock:
            self._check_open()
            if ids.numel() == 0:
                return self._split(torch.empty(0, self.row_width))
            tier = self._tier
            uniq, inverse = np.unique(ids.numpy(), return_inverse=True)
            while self._inflight is not None and np.isin(uniq, self._inflight, assume_unique=True).any():
                self._wake.wait()  # the background read of some of these rows lands first: no second read
            slots = tier.find(uniq)
            hit = slots >= 0
            nhit = int(hit.sum())
            tier.touch(slots[hit])
            self._counts["host_hits"] += nhit
            lookahead = self._policy == "lookahead"
            if lookahead:
                tier.count_fetches(uniq)
            miss = np.flatnonzero(~hit)
            records = self._read_rows(uniq[miss]) if miss.size else np.empty((0, self.row_width), np.float32)
            if miss.size and miss.size <= tier.capacity - nhit:
                if lookahead:  # kept only where rows the device cache holds make room
                    room = self._room_for_gathered(miss.size, slots[hit])
                else:
                    self._make_room(miss.size, kept=nhit)
                    room = miss.size
                if room:
                    new = tier.put(uniq[miss[:room]], dirty=False)
                    tier.rows[torch.from_numpy(new)] = torch.from_numpy(records[:room])
                    tier.touch(new)
                    slots[miss[:room]] = new
            held = slots >= 0
            if held.all():
                out = tier.rows.index_select(0, torch.from_numpy(slots[inverse]))
            else:  # rows read and not kept (more than the tier holds, or no room): served from the read
                rows = np.empty((uniq.size, self.row_width), dtype=np.float32)
                rows[held] = tier.rows.numpy()[slots[held]]
                rows[miss] = records
                out = torch.from_numpy(rows[inverse])
            if lookahead:  # the device cache holds these rows until it writes them back
                tier.dead[slots[held]] = True
                tier.mark_gathered(uniq[~held])
            return self._split(out)

    def _write(self, ids: torch.Tensor, packed: torch.Tensor) -> None:
        if ids.numel() == 0:
            return
        with self._lock:
            self._check_open()
            tier = self._tier
            arr = ids.numpy()
            slots = tier.find(arr)
            hit = slots >= 0
            nhit = int(hit.sum())
            records = packed.numpy()
            if nhit:
                tier.rows.numpy()[slots[hit]] = records[hit]
                tier.dirty[slots[hit]] = True
                tier.dead[slots[hit]] = False
                tier.touch(slots[hit])
            miss = np.flatnonzero(~hit)
            if miss.size == 0:
                return
            keep = np.zeros(miss.size, dtype=bool)
            if miss.size <= tier.capacity - nhit:
                if self._policy == "lookahead":
                    keep = self._room_for_written(arr[miss], slots[hit])
                else:
                    self._make_room(miss.size, kept=nhit)
                    keep[:] = True
                new = tier.put(arr[miss[keep]], dirty=True)
                tier.rows.numpy()[new] = records[miss[keep]]
                tier.touch(new)
            through = miss[~keep]  # more rows than the tier holds, or ranked below every row it holds
            if through.size:
                order = np.argsort(arr[through])
                self._write_rows(arr[through][order], records[through][order])
                tier.mark_written(arr[through])  # held before: a later read is a re-read
                self._counts["rows_written_through"] += through.size

    def _full_columns(self, lo: int, hi: int) -> torch.Tensor:
        """Columns ``[lo, hi)`` of every record: the host tier's rows, else the file's rows on disk, else the
        initial values."""
        with self._lock:
            self._check_open()
            out = torch.empty(self.num_embeddings, hi - lo, dtype=torch.float32)
            arr = out.numpy()
            for a in range(0, self.num_embeddings, INIT_BLOCK_ROWS):
                rows = np.arange(a, min(a + INIT_BLOCK_ROWS, self.num_embeddings), dtype=np.int64)
                arr[rows] = self._read_uncounted(rows)[0][:, lo:hi]
            occ = self._tier.occupied
            arr[self._tier.id_of[occ]] = self._tier.rows.numpy()[occ, lo:hi]
            return out

    def full_weights(self) -> torch.Tensor:
        """The whole table as a new (N, D) tensor (a copy read from the file and the host tier: writes to it do
        not reach the store)."""
        return self._full_columns(0, self.embedding_dim)

    def full_states(self) -> Dict[str, torch.Tensor]:
        """Per state name the whole (N, w) state as a new tensor (a copy, as :meth:`full_weights`)."""
        return {k: self._full_columns(a, b) for k, (a, b) in self._shape.columns.items()}

    def load(self, weights: torch.Tensor, states: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        states = check_load(self._shape, weights, states)
        with self._lock, torch.no_grad():
            self._check_open()
            self._tier.clear()
            self._reset = True
            self._file.reset()
            self._chain = None
            for a in range(0, self.num_embeddings, INIT_BLOCK_ROWS):
                b = min(a + INIT_BLOCK_ROWS, self.num_embeddings)
                records = np.zeros((b - a, self.row_width), dtype=np.float32)
                records[:, : self.embedding_dim] = weights[a:b].to(device="cpu", dtype=torch.float32).numpy()
                for key, (c0, c1) in self._shape.columns.items():
                    if key in states:
                        records[:, c0:c1] = (
                            states[key][a:b].reshape(b - a, c1 - c0).to("cpu", torch.float32).numpy()
                        )
                self._file.append(np.arange(a, b, dtype=np.int64), records)

    def flush(self) -> None:
        """Write every dirty row of the host tier to the file, fsync it, then write and fsync the index."""
        with self._lock:
            if self._file.closed:
                return
            tier = self._tier
            dirty = np.flatnonzero(tier.dirty)
            for a in range(0, dirty.size, _FLUSH_ROWS):  # a bounded copy of the rows at a time
                part = dirty[a : a + _FLUSH_ROWS]
                self._write_rows(tier.id_of[part], tier.rows.numpy()[part])
                tier.dirty[part] = False
            self._file.sync()
            self._file.write_index()
            self._file.sync()

    @property
    def keeps_files(self) -> bool:
        """A checkpoint keeps a disk store as a copy of its file (:meth:`save_files`)."""
        return True

    def file_name(self) -> str:
        """The start of the names of this store's checkpoint pieces (:meth:`save_files`)."""
        return f"{self.name}.{self._row_offset}"

    def snapshot_files(self, directory: str, max_chain: int = 1) -> Tuple[List[str], Writer]:
        """Write the host tier's dirty rows, then a checkpoint piece of the file into ``directory``: a delta over
        the chain last saved or loaded while it has fewer than ``max_chain`` pieces (its rows read here, written
        by the returned writer), else a full piece, written here (:mod:`~torchrec_lookahead.store._disk_chain`).

        Raises:
            StoreError: the piece cannot be written (a full disk: free and needed bytes named); the store is unchanged.
        """
        self.flush()
        with self._lock:
            self._check_open()
            dst = os.path.join(directory, f"{self.file_name()}.{uuid.uuid4().hex[:16]}.rows")
            self._chain, write = prepare_piece(self._file, dst, self._chain, max(1, int(max_chain)))
            return list(self._chain.pieces), write

    def load_files(self, pieces: Sequence[str]) -> None:
        """Make the store hold what the chain ``pieces`` (:meth:`save_files`) stands for, with an empty host tier.

        Raises:
            ConfigError: a piece is missing, damaged or of another table, shard, layout or seed (named); nothing
                is written.
            StoreError: reading a piece or writing the file failed.
        """
        with self._lock:
            self._check_open()
            self._chain = read_chain(self._file, pieces)
            self._tier.clear()
            self._reset = True

    def close(self) -> None:
        """Stop the background reads, flush and close the file; the store cannot be used afterwards
        (idempotent)."""
        with self._lock:
            self._closing = True
            self._wake.notify_all()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join()
        self.flush()
        with self._lock:
            self._file.close()

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
