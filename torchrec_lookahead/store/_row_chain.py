"""Checkpoint pieces of an in-memory store (:class:`~torchrec_lookahead.store.TensorStore`,
:class:`~torchrec_lookahead.store.MmapStore`): the chain rules of :mod:`~torchrec_lookahead.store._disk_chain`
over rows instead of log units.

A piece is one file of records, and beside it ``<piece>.npz`` (its kind and bytes, written last: a piece
without it is partial)::

    page 0        magic, then the layout as JSON (table, rows, dim, state layout, seed, shard, kind, count)
    then          count int64 local rows, sorted
    then          count records [weight | states], float32

A *full* piece holds every row of the initialised chunks (the rest hold their computed initial values), as they
were when it was taken, though it is written while the store is (:class:`RowsSnapshot`); a *delta* piece holds
the rows written since the previous piece of its chain (tracked as they are written). A
chain is read back oldest first: a row holds the value of the newest piece holding it, else its initial value.
"""

from __future__ import annotations

import json
import os
import threading
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from torchrec_lookahead._arrays import sorted_unique
from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.store._disk_chain import (
    LIST_SUFFIX,
    Chain,
    Writer,
    failed_piece,
    finish_piece,
    room_for,
)
from torchrec_lookahead.store._disk_io import PAGE
from torchrec_lookahead.store.types import PendingPiece

if TYPE_CHECKING:
    from torchrec_lookahead.store._row_store import _RowStore

__all__: List[str] = []

MAGIC = b"TRLROWS\x00"
_BLOCK_ROWS = 1 << 16  # records copied at a time


def _layout(store: _RowStore) -> Dict[str, Any]:
    return {
        **store._shape.fields(),
        "seed": store.seed,
        "row_offset": store.row_offset,
        "table_rows": store.table_rows,
    }


class RowsSnapshot:
    """The rows ``ids`` (sorted) of ``rows`` as they are when taken, copied out a block at a time while the store
    goes on being written (copy on write: :meth:`keep` saves the old value of a row not yet copied before it is
    written; memory: the rows written meanwhile)."""

    def __init__(self, rows: torch.Tensor, ids: np.ndarray) -> None:
        self._rows = rows
        self._ids = ids
        self._lock = threading.Lock()
        self._done = 0  # the rows below this one are copied (or not in the snapshot)
        self._kept = np.zeros(rows.shape[0], dtype=bool)
        self._saved: Dict[int, List[Tuple[np.ndarray, torch.Tensor]]] = {}  # block -> (positions, old values)

    def keep(self, written: np.ndarray) -> None:
        """Before the rows ``written`` are written: save the old values of those still to be copied."""
        with self._lock:
            rows = written[(written >= self._done) & ~self._kept[written]]
            pos = np.searchsorted(self._ids, rows)
            inside = pos < self._ids.size
            inside[inside] = self._ids[pos[inside]] == rows[inside]
            rows, pos = rows[inside], pos[inside]
            if not rows.size:
                return
            self._kept[rows] = True
            values = self._rows.index_select(0, torch.from_numpy(rows))
            blocks = pos // _BLOCK_ROWS
            for b in sorted_unique(blocks).tolist():
                at = blocks == b
                self._saved.setdefault(b, []).append((pos[at], values[torch.from_numpy(at)]))

    def blocks(self) -> Iterator[torch.Tensor]:
        """The snapshot's rows, a block of :data:`_BLOCK_ROWS` at a time, in ``ids`` order."""
        for b, a in enumerate(range(0, self._ids.size, _BLOCK_ROWS)):
            z = min(a + _BLOCK_ROWS, self._ids.size)
            lo, hi = int(self._ids[a]), int(self._ids[z - 1]) + 1
            with self._lock:
                if hi - lo == z - a:  # consecutive rows (whole chunks): a slice
                    block = self._rows[lo:hi].clone()
                else:
                    block = self._rows.index_select(0, torch.from_numpy(self._ids[a:z]))
                for pos, values in self._saved.pop(b, []):
                    block[torch.from_numpy(pos - a)] = values
                self._done = int(self._ids[z]) if z < self._ids.size else self._rows.shape[0]
            yield block


def prepare_rows_piece(
    store: _RowStore, dst: str, base: Optional[Chain], max_chain: int, written: np.ndarray
) -> Tuple[Chain, Writer]:
    """The piece ``dst`` of ``store``: a delta of the rows ``written`` (a bool per row) over ``base`` where the
    chain may grow (:meth:`Chain.extends`), else a full piece. Of a delta, the rows are copied here; of a full
    piece, the store's rows are held as they are now (:class:`RowsSnapshot`, through ``store._snapshot``); the
    returned writer writes the piece, on any thread, durably, whole or not at all.

    Returns:
        The chain the store stands at now (``base`` itself where nothing was written since it), and the writer.

    Raises:
        StoreError: the piece cannot be written (a full disk: the free and needed bytes are named); nothing of
            it is left. The writer raises it too.
    """
    if base is not None and not written.any() and len(base.pieces) <= max_chain and base.there(dst):
        return base, None
    delta = base is not None and base.extends(dst, max_chain)
    rows = store._rows()
    if delta:
        ids = np.flatnonzero(written).astype(np.int64)
    else:
        flags = store._chunk_flags().numpy()
        parts = [np.arange(*store._chunk_range(int(c)), dtype=np.int64) for c in np.flatnonzero(flags)]
        ids = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    nbytes = PAGE + ids.size * (8 + store.row_width * 4)
    kind = "delta" if delta else "full"
    head = json.dumps({**_layout(store), "kind": kind, "count": int(ids.size)}).encode()
    page = bytearray(PAGE)
    page[: len(MAGIC) + 4 + len(head)] = MAGIC + len(head).to_bytes(4, "little") + head
    what = f"table '{store.name}'"
    room_for(dst, nbytes, what)
    snapshot: Optional[RowsSnapshot] = None
    if delta:  # the rows copied now
        blocks = range(0, ids.size, _BLOCK_ROWS)
        copies: Iterable[torch.Tensor] = [
            rows.index_select(0, torch.from_numpy(ids[a : a + _BLOCK_ROWS])) for a in blocks
        ]
    else:  # the rows read while the piece is written, those written meanwhile saved first
        snapshot = store._snapshot = RowsSnapshot(rows, ids)
        copies = snapshot.blocks()

    def write() -> None:
        try:
            with open(dst + ".partial", "wb") as f:
                f.write(page)
                f.write(ids.tobytes())
                for block in copies:
                    f.write(block.numpy().data)
                f.flush()
                os.fsync(f.fileno())
            finish_piece(dst, {"kind": kind, "bytes": nbytes})
        except OSError as e:
            raise failed_piece(dst, what, e, nbytes) from None

    def drop() -> None:
        if snapshot is not None and store._snapshot is snapshot:
            store._snapshot = None

    written[:] = False
    if delta:
        assert base is not None
        return Chain((*base.pieces, dst), 0, base.full_bytes, base.delta_bytes + nbytes), PendingPiece(
            write, drop
        )
    return Chain((dst,), 0, nbytes, 0), PendingPiece(write, drop)


def rows_header(page: bytes) -> Dict[str, Any]:
    """The header of an in-memory store's checkpoint piece from its first page.

    Raises:
        ValueError: the page holds no such header (or is damaged).
    """
    if not page.startswith(MAGIC):
        raise ValueError("no header")
    length = int.from_bytes(page[len(MAGIC) : len(MAGIC) + 4], "little")
    head: Dict[str, Any] = json.loads(page[len(MAGIC) + 4 : len(MAGIC) + 4 + length].decode())
    return head


def _read_head(store: _RowStore, path: str) -> Dict[str, Any]:
    try:
        with open(path, "rb") as f:
            page = f.read(PAGE)
        if len(page) < PAGE:
            raise ValueError("no header")
        head = rows_header(page)
    except FileNotFoundError:
        missing = f"the checkpoint piece '{path}' is missing: the chain of table '{store.name}' is incomplete"
        raise ConfigError(missing) from None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"'{path}' is not a checkpoint piece of an in-memory store ({e})") from None
    if not os.path.exists(path + LIST_SUFFIX):
        raise ConfigError(f"the checkpoint piece '{path + LIST_SUFFIX}' is missing: '{path}' is partial")
    diffs = [
        f"{k}: piece {head.get(k)!r}, store {v!r}" for k, v in _layout(store).items() if head.get(k) != v
    ]
    count = int(head.get("count", -1))
    if not diffs and os.path.getsize(path) != PAGE + count * (8 + store.row_width * 4):
        diffs = [f"size: piece {os.path.getsize(path):,} bytes for {count:,} rows"]
    if diffs:
        raise ConfigError(
            f"'{path}' is not a checkpoint piece of table '{store.name}' ({'; '.join(diffs)}): it was written for "
            "another table, shard, layout or seed, or is truncated"
        )
    return head


def read_rows_chain(store: _RowStore, pieces: Sequence[str]) -> Chain:
    """Make ``store`` hold what the chain ``pieces`` (oldest first, a full piece first) stands for.

    Raises:
        ConfigError: a piece is missing, partial, damaged, of another table, shard, layout or seed, or the chain
            is not one full piece then deltas (named); nothing is written then.
    """
    if not pieces:
        raise ConfigError(f"an empty chain of checkpoint pieces for table '{store.name}'")
    heads = [_read_head(store, p) for p in pieces]
    kinds = [h.get("kind") for h in heads]
    if kinds[0] != "full" or any(k != "delta" for k in kinds[1:]):
        raise ConfigError(f"a chain of checkpoint pieces must be one full piece then deltas; got {kinds}")
    rows = store._rows()
    store._chunk_flags().zero_()
    store._all_init = False
    width = store.row_width
    for path, head in zip(pieces, heads):
        count = int(head["count"])
        with open(path, "rb") as f:
            f.seek(PAGE)
            ids = np.frombuffer(f.read(count * 8), dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= store.num_embeddings):
                raise ConfigError(f"the checkpoint piece '{path}' is damaged (rows out of range)")
            for a in range(0, count, _BLOCK_ROWS):
                block = torch.from_numpy(ids[a : a + _BLOCK_ROWS].copy())
                data = np.frombuffer(f.read(block.numel() * width * 4), dtype=np.float32)
                store._ensure_init(block)
                rows.index_copy_(0, block, torch.from_numpy(data.reshape(-1, width).copy()))
    sizes = [os.path.getsize(p) for p in pieces]
    return Chain(tuple(pieces), 0, sizes[0], sum(sizes[1:]))
