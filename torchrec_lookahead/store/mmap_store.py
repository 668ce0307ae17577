"""Embedding store backed by a memory-mapped file, for tables larger than host RAM.

Three files per table, next to each other:

* ``<path>``: the raw rows, float32, ``num_embeddings x (D + sum(state_widths))``, row-major; created sparse,
  so untouched chunks take no disk;
* ``<path>.meta.json``: sizes, state layout, seed and chunking, checked on reopen;
* ``<path>.init``: one byte per chunk of ``chunk_rows`` rows, 1 once the chunk holds its initial (or trained)
  values. Chunks are initialised on first touch, so the table is never materialised in RAM.

:meth:`MmapStore.flush` writes the rows before the chunk flags, so a flag on disk always describes rows on
disk. Writes after the last flush may be lost on a crash (the page cache keeps them across a normal exit).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Literal, Mapping, Optional, Union

import numpy as np
import torch

from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.store._row_store import _RowStore

__all__ = ["MmapStore"]

_FORMAT = "torchrec_lookahead.mmap_store"
_VERSION = 2  # 1: initial values drawn per block of INIT_BLOCK_ROWS rows (torch.Generator)

PathLike = Union[str, "os.PathLike[str]"]


class MmapStore(_RowStore):
    """A table and its per-row optimizer state in a memory-mapped file.

    Creates the file when it does not exist, reopens it (checking that sizes and layout match) when it does.

    Args:
        path: data file path (``.meta.json`` and ``.init`` files are created next to it).
        num_embeddings: rows of the table.
        embedding_dim: width of a row.
        state_widths: optimizer state name -> columns per row.
        name: table name (seeds the initial values; appears in errors).
        seed: global seed of the initial values.
        chunk_rows: rows initialised at a time; a multiple of
            :data:`~torchrec_lookahead.store.init.INIT_BLOCK_ROWS`.
        row_offset: for a row shard of a larger table (see
            :class:`~torchrec_lookahead.store.RowShardedStore`): the table row held by local row 0 (ids stay
            local; the initial values are the whole table's).
        table_rows: rows of the whole table when the store is a shard (default ``num_embeddings``).

    Raises:
        ConfigError: a size is not positive, the shard does not fit in ``table_rows``, or an existing file was
            created with other sizes, layout, name or seed.

    Example:
        >>> import tempfile, os, torch
        >>> d = tempfile.mkdtemp()
        >>> store = MmapStore(os.path.join(d, "t0.bin"), 1000, 4, {"momentum1": 1}, name="t0")
        >>> store.scatter(torch.tensor([5]), torch.ones(1, 4), {"momentum1": torch.ones(1, 1)})
        >>> store.close()
        >>> again = MmapStore.open(os.path.join(d, "t0.bin"))
        >>> again.gather(torch.tensor([5]))[0].tolist(), again.num_embeddings
        ([[1.0, 1.0, 1.0, 1.0]], 1000)
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
        chunk_rows: int = 65536,
        row_offset: int = 0,
        table_rows: Optional[int] = None,
    ) -> None:
        super().__init__(
            name, num_embeddings, embedding_dim, state_widths, seed, chunk_rows, row_offset, table_rows
        )
        self._path = os.fspath(path)
        meta = self._meta()
        meta_path = self._path + ".meta.json"
        exists = os.path.exists(meta_path) and os.path.exists(self._path)
        if exists:
            with open(meta_path) as f:
                found = json.load(f)
            if found != meta:
                raise ConfigError(
                    f"memory-mapped store '{self._path}' was created with {found} but is opened with {meta}; "
                    "pass the same arguments (or use MmapStore.open), or delete the files to start afresh"
                )
            expected = self._shape.nbytes
            if os.path.getsize(self._path) != expected:
                raise ConfigError(
                    f"memory-mapped store '{self._path}' has {os.path.getsize(self._path)} bytes but its metadata "
                    f"implies {expected}; the file is truncated or foreign: delete it to start afresh"
                )
        mode: Literal["r+", "w+"] = "r+" if exists else "w+"
        self._mm: Optional[np.memmap] = np.memmap(
            self._path, dtype=np.float32, mode=mode, shape=(self.num_embeddings, self.row_width)
        )
        self._mm_flags: Optional[np.memmap] = np.memmap(
            self._path + ".init", dtype=np.uint8, mode=mode, shape=(self._num_chunks,)
        )
        self._data = torch.from_numpy(self._mm)
        self._flags = torch.from_numpy(self._mm_flags)
        if not exists:
            self._mm.flush()
            self._mm_flags.flush()
            with open(meta_path, "w") as f:
                json.dump(meta, f)

    @classmethod
    def open(cls, path: PathLike) -> MmapStore:
        """Reopen an existing store with the sizes recorded in its metadata.

        Args:
            path: data file path given when the store was created.

        Returns:
            The reopened store.

        Raises:
            ConfigError: the metadata file is missing or not a store's.
        """
        meta_path = os.fspath(path) + ".meta.json"
        if not os.path.exists(meta_path):
            raise ConfigError(f"no memory-mapped store at '{os.fspath(path)}' (missing {meta_path})")
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("format") != _FORMAT or meta.get("version") != _VERSION:
            raise ConfigError(f"'{meta_path}' is not a {_FORMAT} version {_VERSION} file")
        return cls(
            path,
            meta["num_embeddings"],
            meta["embedding_dim"],
            meta["state_widths"],
            name=meta["name"],
            seed=meta["seed"],
            chunk_rows=meta["chunk_rows"],
            row_offset=meta.get("row_offset", 0),
            table_rows=meta.get("table_rows"),
        )

    def _meta(self) -> Dict[str, Any]:
        meta: Dict[str, Any] = {
            "format": _FORMAT,
            "version": _VERSION,
            **self._shape.fields(),
            "seed": self._seed,
            "chunk_rows": self._chunk_rows,
            "dtype": "float32",
        }
        if (
            self._row_offset != 0 or self._table_rows != self.num_embeddings
        ):  # a row shard (absent: a whole table)
            meta.update(row_offset=self._row_offset, table_rows=self._table_rows)
        return meta

    @property
    def path(self) -> str:
        """Data file path."""
        return self._path

    def _rows(self) -> torch.Tensor:
        if self._mm is None:
            raise ConfigError(f"memory-mapped store '{self._path}' is closed; reopen it with MmapStore.open")
        return self._data

    def _chunk_flags(self) -> torch.Tensor:
        if self._mm is None:
            raise ConfigError(f"memory-mapped store '{self._path}' is closed; reopen it with MmapStore.open")
        return self._flags

    def flush(self) -> None:
        """Write dirty pages of the rows, then of the chunk flags, to disk."""
        if self._mm is not None and self._mm_flags is not None:
            self._mm.flush()
            self._mm_flags.flush()

    def close(self) -> None:
        """Flush and unmap; the store cannot be used afterwards."""
        self.flush()
        self._mm = None
        self._mm_flags = None
        self._data = torch.empty(0)
        self._flags = torch.empty(0, dtype=torch.uint8)

    def __enter__(self) -> MmapStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
