"""Reading a chain of checkpoint pieces back without the run that wrote it (``export``): the store the pieces
describe, made from the layout the first piece records (:mod:`~torchrec_lookahead.store._disk_chain` for disk
stores, :mod:`~torchrec_lookahead.store._row_chain` for in-memory ones)."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence, Union

from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.store._disk_io import MAGIC, PAGE, read_header
from torchrec_lookahead.store._row_chain import MAGIC as ROWS_MAGIC
from torchrec_lookahead.store._row_chain import rows_header
from torchrec_lookahead.store.disk_store import DiskStore
from torchrec_lookahead.store.tensor_store import TensorStore

__all__: List[str] = ["open_pieces"]


def open_pieces(pieces: Sequence[str], scratch: str) -> Union[DiskStore, TensorStore]:
    """A store holding what the chain ``pieces`` (oldest first) stands for: a :class:`DiskStore` over a scratch
    file in the directory ``scratch`` for disk stores' pieces (close it), a :class:`TensorStore` for in-memory
    stores' pieces.

    Raises:
        ConfigError: a piece is missing, damaged, or the chain is not one table's (the piece is named).
        StoreError: reading a piece or writing the scratch file failed.
    """
    if not pieces:
        raise ConfigError("an empty chain of checkpoint pieces")
    try:
        with open(pieces[0], "rb") as f:
            page = f.read(PAGE)
    except OSError as e:
        raise ConfigError(f"the checkpoint piece '{pieces[0]}' cannot be read ({e.strerror})") from None
    store: Union[DiskStore, TensorStore]
    if page.startswith(ROWS_MAGIC):
        store = TensorStore(**_layout(rows_header(page)))
        store.keep_files()
    elif page.startswith(MAGIC):
        path = os.path.join(scratch, "scratch.rows")
        store = DiskStore(
            path, **_layout(read_header(pieces[0])), host_budget_bytes=1 << 20, preallocate=False
        )
    else:
        raise ConfigError(f"'{pieces[0]}' is not a checkpoint piece (no header)")
    try:
        store.load_files(pieces)
    except BaseException:
        if isinstance(store, DiskStore):
            store.close()
        raise
    return store


def _layout(header: Dict[str, Any]) -> Dict[str, Any]:
    """The store arguments a piece's header records (the table's shape, name, seed and shard)."""
    keys = ("num_embeddings", "embedding_dim", "state_widths", "name", "seed", "row_offset", "table_rows")
    return {k: header[k] for k in keys}
