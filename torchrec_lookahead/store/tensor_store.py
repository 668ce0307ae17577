"""In-RAM embedding store."""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from torchrec_lookahead.store._row_store import _RowStore
from torchrec_lookahead.store.init import INIT_BLOCK_ROWS

__all__ = ["TensorStore"]


class TensorStore(_RowStore):
    """A table and its per-row optimizer state in one host tensor.

    Rows are initialised on first touch, a block of
    :data:`~torchrec_lookahead.store.init.INIT_BLOCK_ROWS` (8,192) rows at a time with
    :func:`~torchrec_lookahead.store.init_rows`' values (those a :class:`~torchrec_lookahead.store.DiskStore` computes
    for its rows never written), so
    creating a large store is cheap and a step initialises the blocks its ids touch; the memory itself is
    allocated up front (uninitialised, ``torch.empty``: a page takes memory once a block on it is written).

    Args:
        num_embeddings: rows of the table.
        embedding_dim: width of a row.
        state_widths: optimizer state name -> columns per row (``{"momentum1": 1}`` for row-wise Adagrad).
        name: table name (seeds the initial values; appears in errors).
        seed: global seed of the initial values.
        chunk_rows: rows initialised at a time; a multiple of
            :data:`~torchrec_lookahead.store.init.INIT_BLOCK_ROWS` (default: one such block). The initial values
            do not depend on it.
        pin_memory: allocate in pinned memory (faster host-to-device copies; needs CUDA).
        row_offset: for a row shard of a larger table (see
            :class:`~torchrec_lookahead.store.RowShardedStore`): the table row held by local row 0. Ids stay local
            (``0 <= id < num_embeddings``); only the initial values follow the whole table's rows, and the blocks
            initialised at a time are the whole table's.
        table_rows: rows of the whole table when the store is a shard (default ``num_embeddings``).

    Raises:
        ConfigError: a size is not positive, or the shard does not fit in ``table_rows``.

    Example:
        >>> import torch
        >>> store = TensorStore(100, 4, {"momentum1": 1}, name="t0", seed=0)
        >>> w, s = store.gather(torch.tensor([3, 7]))
        >>> w.shape, s["momentum1"].shape, float(s["momentum1"].sum())
        (torch.Size([2, 4]), torch.Size([2, 1]), 0.0)
        >>> store.scatter(torch.tensor([3]), torch.ones(1, 4), {"momentum1": torch.full((1, 1), 2.0)})
        >>> store.gather(torch.tensor([3]))[0].tolist(), store.nbytes
        ([[1.0, 1.0, 1.0, 1.0]], 2000)
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        state_widths: Optional[Mapping[str, int]] = None,
        *,
        name: str = "table",
        seed: int = 0,
        chunk_rows: int = INIT_BLOCK_ROWS,
        pin_memory: bool = False,
        row_offset: int = 0,
        table_rows: Optional[int] = None,
    ) -> None:
        super().__init__(
            name,
            num_embeddings,
            embedding_dim,
            state_widths,
            seed,
            chunk_rows,
            row_offset,
            table_rows,
            aligned=True,
        )
        self._data = torch.empty(
            self.num_embeddings, self.row_width, dtype=torch.float32, pin_memory=pin_memory
        )
        self._flags = torch.zeros(self._num_chunks, dtype=torch.uint8)

    def _rows(self) -> torch.Tensor:
        return self._data

    def _chunk_flags(self) -> torch.Tensor:
        return self._flags

    def flush(self) -> None:
        """Nothing to do: RAM is the store."""
