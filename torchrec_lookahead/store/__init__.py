"""Host-side backing stores of embedding tables and their per-row optimizer state.

* :class:`EmbeddingStore`: the abstract contract (gather / scatter rows with their optimizer state).
* :class:`TensorStore`: in RAM.
* :class:`MmapStore`: a memory-mapped file (the kernel's page cache decides what stays in memory).
* :class:`DiskStore`: a file read and written with direct I/O under a bounded host-memory tier
  (``host_budget_bytes``), for tables larger than host RAM.
* :class:`RowShardedStore`: a table sharded row-wise over the ranks (or hosts) of a job, reached with
  torch.distributed collectives.
* :func:`init_rows` / :func:`init_rows_at` / :func:`init_embedding_weights`: the deterministic initial values
  every store uses (each row computed on its own), also for initialising a resident TorchRec model identically.

The collective plumbing of :class:`RowShardedStore` (``STAGE_CHANNEL``, ``collective_channel``, ``current_wait``,
``CollectiveWait``) lives in :mod:`torchrec_lookahead.store.channels`, ``EmptyShardStore`` in
:mod:`torchrec_lookahead.store.sharded_store`, the shape value every store answers its shape properties from
(``StoreShape``) and what a bounded host tier must hold at once (``HostWindow``) in
:mod:`torchrec_lookahead.store.types`, and the lazy-initialisation block size
``INIT_BLOCK_ROWS`` in :mod:`torchrec_lookahead.store.init`.

Example:
    >>> import torch
    >>> from torchrec_lookahead.store import TensorStore
    >>> store = TensorStore(10, 4, {"momentum1": 1}, name="t", seed=0)
    >>> store.gather(torch.tensor([3]))[0].shape
    torch.Size([1, 4])
"""

from torchrec_lookahead.store.disk_store import DiskStore
from torchrec_lookahead.store.init import init_embedding_weights, init_rows, init_rows_at
from torchrec_lookahead.store.mmap_store import MmapStore
from torchrec_lookahead.store.sharded_store import RowShardedStore, row_bounds
from torchrec_lookahead.store.tensor_store import TensorStore
from torchrec_lookahead.store.types import EmbeddingStore

__all__ = [
    "EmbeddingStore",
    "TensorStore",
    "MmapStore",
    "DiskStore",
    "RowShardedStore",
    "row_bounds",
    "init_rows",
    "init_rows_at",
    "init_embedding_weights",
]
