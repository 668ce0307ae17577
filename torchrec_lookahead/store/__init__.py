"""Host-side backing stores of embedding tables and their per-row optimizer state.

* :class:`EmbeddingStore`: the abstract contract (gather / scatter rows with their optimizer state).
* :class:`TensorStore`: in RAM.
* :class:`MmapStore`: a memory-mapped file, for tables larger than host RAM.
* :class:`RowShardedStore`: a table sharded row-wise over the ranks (or hosts) of a job, reached with
  torch.distributed collectives.
* :func:`init_rows` / :func:`init_embedding_weights`: the deterministic initial values every store uses, also
  for initialising a resident TorchRec model identically.
"""

from torchrec_lookahead.store.init import INIT_BLOCK_ROWS, init_embedding_weights, init_rows
from torchrec_lookahead.store.mmap_store import MmapStore
from torchrec_lookahead.store.sharded_store import (
    STAGE_CHANNEL,
    CollectiveWait,
    EmptyShardStore,
    RowShardedStore,
    collective_channel,
    current_wait,
    row_bounds,
)
from torchrec_lookahead.store.tensor_store import TensorStore
from torchrec_lookahead.store.types import EmbeddingStore

__all__ = [
    "EmbeddingStore",
    "TensorStore",
    "MmapStore",
    "RowShardedStore",
    "EmptyShardStore",
    "row_bounds",
    "collective_channel",
    "current_wait",
    "CollectiveWait",
    "STAGE_CHANNEL",
    "INIT_BLOCK_ROWS",
    "init_rows",
    "init_embedding_weights",
]
