"""Shared implementation of stores that keep one float32 row ``[weight | states]`` per id."""

from __future__ import annotations

import os
import threading
import uuid
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from torchrec_lookahead._arrays import sorted_unique
from torchrec_lookahead.errors import ConfigError, DataError
from torchrec_lookahead.store._disk_chain import Chain, Writer
from torchrec_lookahead.store._row_chain import RowsSnapshot, prepare_rows_piece, read_rows_chain
from torchrec_lookahead.store.init import INIT_BLOCK_ROWS, init_rows
from torchrec_lookahead.store.types import ShapedStore, StoreShape, check_load

__all__: List[str] = []


def _check_sizes(name: str, num_embeddings: int, embedding_dim: int, state_widths: Mapping[str, int]) -> None:
    if int(num_embeddings) <= 0:
        raise ConfigError(f"num_embeddings for table '{name}' must be > 0 but got {num_embeddings}")
    if int(embedding_dim) <= 0:
        raise ConfigError(f"embedding_dim for table '{name}' must be > 0 but got {embedding_dim}")
    for key, width in state_widths.items():
        if not isinstance(key, str) or int(width) <= 0:
            raise ConfigError(
                f"state_widths for table '{name}' must map names to positive widths but got {key!r}: {width}"
            )


class _RowStore(ShapedStore):
    """Store over a (N, D + S) float32 tensor whose chunks of ``chunk_rows`` rows are initialised lazily.

    Subclasses provide the tensor (RAM or memory-mapped) and the per-chunk "initialised" flags. Chunks start at
    local row 0, or with ``aligned`` (a store whose flags are not kept in a file) at the whole table's multiples
    of ``chunk_rows``, so that the chunks of row shards line up with the whole table's (the values do not depend
    on the chunking).
    """

    def __init__(
        self,
        name: str,
        num_embeddings: int,
        embedding_dim: int,
        state_widths: Optional[Mapping[str, int]],
        seed: int,
        chunk_rows: int,
        row_offset: int = 0,
        table_rows: Optional[int] = None,
        aligned: bool = False,
    ) -> None:
        widths = dict(state_widths or {})
        _check_sizes(name, num_embeddings, embedding_dim, widths)
        total = int(num_embeddings) if table_rows is None else int(table_rows)
        if row_offset < 0 or int(row_offset) + int(num_embeddings) > total:
            raise ConfigError(
                f"a shard of table '{name}' with row_offset={row_offset} and {num_embeddings} rows does not fit in "
                f"table_rows={total}"
            )
        if chunk_rows <= 0 or chunk_rows % INIT_BLOCK_ROWS != 0:
            raise ConfigError(
                f"chunk_rows must be a positive multiple of {INIT_BLOCK_ROWS} but got {chunk_rows}"
            )
        self._shape = StoreShape(
            str(name), int(num_embeddings), int(embedding_dim), {k: int(v) for k, v in widths.items()}
        )
        self._seed = int(seed)
        self._row_offset = int(row_offset)
        self._table_rows = total
        self._chunk_rows = int(chunk_rows)
        self._phase = self._row_offset % self._chunk_rows if aligned else 0  # rows of chunk 0 before row 0
        self._num_chunks = -(-(self.num_embeddings + self._phase) // self._chunk_rows)
        self._init_lock = threading.Lock()
        self._all_init = False
        self._keeps_files = False
        self._since: Optional[np.ndarray] = None  # with keep_files(): the rows written since the last piece
        self._row_chain: Optional[Chain] = None  # the checkpoint pieces last saved or loaded
        self._snapshot: Optional[RowsSnapshot] = None  # a full piece being written: the rows it holds

    # -- to provide in subclasses -------------------------------------------------------------------------
    def _rows(self) -> torch.Tensor:
        """The (N, D + S) float32 backing tensor."""
        raise NotImplementedError

    def _chunk_flags(self) -> torch.Tensor:
        """(num_chunks,) uint8 tensor, 1 where the chunk holds initial (or later) values."""
        raise NotImplementedError

    # -- properties ----------------------------------------------------------------------------------------
    @property
    def seed(self) -> int:
        """Seed of the initial values."""
        return self._seed

    @property
    def row_offset(self) -> int:
        """Row of the whole table that local row 0 holds (0 unless the store is a row shard)."""
        return self._row_offset

    @property
    def table_rows(self) -> int:
        """Rows of the whole table (``num_embeddings`` unless the store is a row shard)."""
        return self._table_rows

    # -- lazy initialisation -------------------------------------------------------------------------------
    def _chunk_range(self, chunk: int) -> Tuple[int, int]:
        """Local rows ``[lo, hi)`` of ``chunk``."""
        lo = chunk * self._chunk_rows - self._phase
        return max(lo, 0), min(lo + self._chunk_rows, self.num_embeddings)

    def _init_chunk(self, chunk: int) -> None:
        lo, hi = self._chunk_range(chunk)
        rows = self._rows()
        off = self._row_offset
        rows[lo:hi, : self.embedding_dim] = init_rows(
            self._seed, self.name, off + lo, off + hi, self.embedding_dim, self._table_rows
        )
        rows[lo:hi, self.embedding_dim :] = 0.0

    def _ensure_init(self, ids: Optional[torch.Tensor]) -> None:
        """Initialise the chunks ``ids`` touch (every chunk when ``ids`` is None)."""
        if self._all_init:
            return
        flags = self._chunk_flags()
        if ids is None:
            chunks = torch.arange(self._num_chunks)
        else:
            chunk_of = (ids.numpy() + self._phase) // self._chunk_rows
            if flags.numpy()[chunk_of].all():  # the usual case, without a sort
                return
            chunks = torch.from_numpy(sorted_unique(chunk_of))
        missing = chunks[flags[chunks] == 0]
        if missing.numel() > 0:
            with self._init_lock:
                for chunk in missing.tolist():
                    if int(flags[chunk]) == 0:
                        self._init_chunk(chunk)
                        self._mark_init(chunk)
        if bool((flags != 0).all()):
            self._all_init = True

    def _mark_init(self, chunk: int) -> None:
        self._chunk_flags()[chunk] = 1

    # -- validation ----------------------------------------------------------------------------------------
    def _check_ids(self, ids: torch.Tensor, unique: bool) -> torch.Tensor:
        error, ids = self._shape.check_ids(ids, unique)
        if error is not None:
            raise error
        return ids

    def _pack(
        self, n: int, weights: torch.Tensor, states: Optional[Mapping[str, torch.Tensor]]
    ) -> torch.Tensor:
        states = dict(states or {})
        if set(states) != set(self._shape.state_widths):
            raise DataError(
                f"states for table '{self.name}' must have exactly the keys {sorted(self._shape.state_widths)} "
                f"but got {sorted(states)}"
            )
        if tuple(weights.shape) != (n, self.embedding_dim):
            raise DataError(
                f"weights for table '{self.name}' must have shape ({n}, {self.embedding_dim}) but got "
                f"{tuple(weights.shape)}"
            )
        parts = [_host_float(weights)]
        for key, width in self._shape.state_widths.items():
            val = states[key].detach()
            if width == 1 and val.dim() == 1:
                val = val.unsqueeze(1)
            if tuple(val.shape) != (n, width):
                raise DataError(
                    f"state '{key}' for table '{self.name}' must have shape ({n}, {width}) but got "
                    f"{tuple(states[key].shape)}"
                )
            parts.append(_host_float(val))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def _split(self, rows: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        return self._shape.split(rows)

    # -- EmbeddingStore --------------------------------------------------------------------------------------
    def gather(self, ids: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        ids = self._check_ids(ids, unique=False)
        self._ensure_init(ids)
        return self._split(self._rows().index_select(0, ids))

    def scatter(
        self,
        ids: torch.Tensor,
        weights: torch.Tensor,
        states: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> None:
        ids = self._check_ids(ids, unique=True)
        self._write(ids, self._pack(ids.numel(), weights, states))

    def write_back(
        self,
        ids: torch.Tensor,
        weights: torch.Tensor,
        states: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> None:
        """:meth:`scatter` without its id checks (distinct, in-range ids are the caller's guarantee); a
        subclass that overrides :meth:`scatter` keeps getting every write through it."""
        if type(self).scatter is not _RowStore.scatter:
            self.scatter(ids, weights, states)
            return
        if not (ids.dtype is torch.int64 and ids.is_cpu):
            ids = ids.to(device="cpu", dtype=torch.int64)
        self._write(ids, self._pack(ids.numel(), weights, states))

    def _write(self, ids: torch.Tensor, packed: torch.Tensor) -> None:
        if ids.numel() == 0:
            return
        self._ensure_init(ids)
        snapshot = self._snapshot
        if snapshot is not None:  # a full piece still to be written holds the rows' values before this write
            snapshot.keep(ids.numpy())
        self._rows().index_copy_(0, ids, packed)
        if self._since is not None:
            self._since[ids.numpy()] = True

    # -- checkpoint pieces (_row_chain) ----------------------------------------------------------------------
    def keep_files(self) -> None:
        """From now on, checkpoints keep this table as pieces of its rows (:meth:`save_files`): the rows
        written since the previous piece are tracked as they are written, and a checkpoint writes those (a
        delta) instead of the whole table."""
        if not self.keeps_files:
            self._keeps_files = True
            self._since = np.zeros(self.num_embeddings, dtype=bool)

    @property
    def keeps_files(self) -> bool:
        """Whether checkpoints keep this table as pieces of its rows (after :meth:`keep_files`)."""
        return self._keeps_files

    def snapshot_files(self, directory: str, max_chain: int = 1) -> Tuple[List[str], Writer]:
        """:meth:`save_files`, the writing of the piece left to the returned writer (a delta's rows are copied
        here; a full piece holds the rows as they are, those written before it is written saved first): the
        chain, and the writer (``None``: nothing left to write).

        Raises:
            ConfigError: :meth:`keep_files` was not called.
            StoreError: the piece cannot be written (a full disk: free and needed bytes named).
        """
        if self._since is None:
            raise ConfigError(f"table '{self.name}': call keep_files() before saving pieces of its rows")
        dst = os.path.join(directory, f"{self.name}.{self._row_offset}.{uuid.uuid4().hex[:16]}.rows")
        self._row_chain, write = prepare_rows_piece(
            self, dst, self._row_chain, max(1, int(max_chain)), self._since
        )
        return list(self._row_chain.pieces), write

    def save_files(self, directory: str, max_chain: int = 1) -> List[str]:
        """Write a checkpoint piece of the rows into ``directory``, durably: the rows written since the chain
        last saved or loaded while it has fewer than ``max_chain`` pieces, else every row of the initialised
        chunks (:mod:`~torchrec_lookahead.store._row_chain`; a disk store's, :mod:`~torchrec_lookahead.store.
        _disk_chain`). Returns the chain, the full piece first.

        Raises:
            ConfigError: :meth:`keep_files` was not called.
            StoreError: the piece cannot be written (a full disk: free and needed bytes named).
        """
        chain, write = self.snapshot_files(directory, max_chain)
        if write is not None:
            write()
        return chain

    def load_files(self, pieces: Sequence[str]) -> None:
        """Make the store hold what the chain ``pieces`` (:meth:`save_files`) stands for.

        Raises:
            ConfigError: a piece is missing, damaged, or of another table, shard, layout or seed (named).
        """
        self._row_chain = read_rows_chain(self, pieces)
        if self._since is not None:
            self._since[:] = False

    def full_weights(self) -> torch.Tensor:
        self._ensure_init(None)
        return self._split(self._rows())[0]

    def full_states(self) -> Dict[str, torch.Tensor]:
        self._ensure_init(None)
        return self._split(self._rows())[1]

    def load(self, weights: torch.Tensor, states: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        states = check_load(self._shape, weights, states)
        rows = self._rows()
        with torch.no_grad():
            for chunk in range(self._num_chunks):
                lo, hi = self._chunk_range(chunk)
                rows[lo:hi, : self.embedding_dim] = weights[lo:hi].to(device="cpu", dtype=torch.float32)
                for key, (a, b) in self._shape.columns.items():
                    if key in states:
                        rows[lo:hi, a:b] = states[key][lo:hi].reshape(hi - lo, b - a).to("cpu", torch.float32)
                    else:
                        rows[lo:hi, a:b] = 0.0
                self._mark_init(chunk)
        self._all_init = True
        self._row_chain = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, num_embeddings={self.num_embeddings}, "
            f"embedding_dim={self.embedding_dim}, state_widths={self._shape.state_widths})"
        )


def _host_float(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, as float32 in host memory (as is when it already is: the cache's rows on the CPU)."""
    t = t.detach()
    return t if t.dtype is torch.float32 and t.is_cpu else t.to(device="cpu", dtype=torch.float32)
