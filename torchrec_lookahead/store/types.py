"""Abstract contract of a host-side embedding store.

A store holds the full rows of one embedding table and, next to every row, that row's optimizer state, so
that a row evicted from the device cache and fetched again later continues its optimizer trajectory exactly.
The device cache (:mod:`torchrec_lookahead.modules`) moves rows between the store and its slots with
:meth:`EmbeddingStore.gather` and :meth:`EmbeddingStore.scatter`.

Layout of one stored row (``D = embedding_dim``, the state columns in ``state_widths`` order)::

    | weight[0:D] | state_0[0:w_0] | state_1[0:w_1] | ...

Contracts every implementation keeps:

* ids are validated (integer, 1-D, ``0 <= id < num_embeddings``) before anything is written, and a failing
  call leaves the store unchanged;
* ``gather`` and ``scatter`` are vectorised and may run concurrently from different threads on disjoint ids;
* initial weights come from :func:`torchrec_lookahead.store.init_rows` (deterministic in the seed, the table
  name and the row index, whatever the chunking), initial optimizer state is zero.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from torchrec_lookahead._arrays import sorted_unique
from torchrec_lookahead.errors import ConfigError, DataError, InvalidIdError

#: the ids :meth:`StoreShape.check_ids` returns with an error (none)
_NO_IDS = torch.zeros(0, dtype=torch.int64)

__all__ = ["EmbeddingStore", "HostWindow", "PendingPiece", "StoreShape", "ShapedStore", "check_load"]


@dataclasses.dataclass(frozen=True)
class HostWindow:
    """What the bounded host tier of a store (a :class:`~torchrec_lookahead.store.DiskStore`, or the shards of a
    row-sharded one) must hold at once: the rows of one window of steps, a batch and the next ``depth``.

    Every row a step fetches into the device cache passes through the host tier, and the first window of a plan
    stream (an empty device cache) fetches every distinct id it reads; under the lookahead host policy the rows
    of the gathered step and of the ``disk_prefetch_depth`` steps after it are read into the tier together. So a
    shard whose host tier holds fewer rows than a window's distinct ids on that shard reads its rows from disk
    on the step's critical path (a gather larger than the tier bypasses it; the background reads skip the
    window). The capacity checks (:func:`~torchrec_lookahead.runtime.capacity.check_stream` before training, the
    planner thread as it reads batches ahead) refuse such a window with a
    :class:`~torchrec_lookahead.errors.CapacityError` naming the host tier.

    Attributes:
        depth: a window is a batch and the next ``depth`` (0 under ``host_policy="lru"``: one step's rows;
            ``disk_prefetch_depth`` under ``"lookahead"``).
        bounds: ``S + 1`` increasing shard boundaries in the table's ids, from 0 to the table's rows (``(0, N)``
            for a store of one shard).
        rows: the host tier's rows of each shard (a shard without a bounded tier: its own row count, which no
            window exceeds).
        policy: the host policy (``"lru"`` or ``"lookahead"``), for messages.
        row_bytes: bytes of one row in the host tier (with its optimizer state), for messages (0: unknown).
        budget_split: where one int ``host_budget_bytes`` is split over the tables by size, ``(total, share)``:
            the tier gets ``int * share // total`` bytes; for messages (``(0, 0)``: given per table, or unknown).

    Example:
        >>> import numpy as np
        >>> w = HostWindow(depth=2, bounds=(0, 50, 100), rows=(10, 12), policy="lookahead")
        >>> w.shard_of(np.array([3, 49, 50, 99])).tolist()
        [0, 0, 1, 1]
    """

    depth: int
    bounds: Tuple[int, ...]
    rows: Tuple[int, ...]
    policy: str = "lru"
    row_bytes: int = 0
    budget_split: Tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        b = self.bounds
        if (
            self.depth < 0
            or len(b) < 2
            or b[0] != 0
            or any(x > y for x, y in zip(b, b[1:]))
            or len(self.rows) != len(b) - 1
            or any(r < 0 for r in self.rows)
        ):
            raise ConfigError(
                f"a host window needs depth >= 0, increasing bounds from 0 and one row count >= 0 per shard but "
                f"got depth={self.depth}, bounds={b}, rows={self.rows}"
            )

    @property
    def num_rows(self) -> int:
        """Rows of the table (the last bound)."""
        return self.bounds[-1]

    def shard_of(self, ids: np.ndarray) -> np.ndarray:
        """The shard of each id (ids in ``[0, num_rows)``)."""
        if len(self.bounds) == 2:
            return np.zeros(ids.shape, dtype=np.int64)
        return np.searchsorted(np.asarray(self.bounds[1:-1], dtype=np.int64), ids, side="right")


class PendingPiece:
    """A checkpoint piece still to be written (:meth:`EmbeddingStore.snapshot_files`): call it to write it, on any
    thread, once, or :meth:`drop` it unwritten; either lets go of what the piece holds of its store (the rows it
    saves from later writes, the log units it keeps from reuse)."""

    def __init__(self, write: Callable[[], None], drop: Callable[[], None]) -> None:
        self._write = write
        self.drop = drop

    def __call__(self) -> None:
        try:
            self._write()
        finally:
            self.drop()


class EmbeddingStore(abc.ABC):
    """Host-side backing store of one embedding table and its per-row optimizer state."""

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """Table name, used in error messages and to seed the initial values."""

    @property
    @abc.abstractmethod
    def num_embeddings(self) -> int:
        """Number of rows of the table."""

    @property
    @abc.abstractmethod
    def embedding_dim(self) -> int:
        """Width ``D`` of one embedding row."""

    @property
    @abc.abstractmethod
    def state_widths(self) -> Dict[str, int]:
        """Optimizer state name -> number of float32 columns per row (``{}`` for SGD)."""

    @property
    def collective(self) -> bool:
        """Whether every data call (gather, scatter, write_back, load, full_*) is a collective of all ranks,
        which every rank must make in the same order (a row-sharded store); ``False`` for local stores."""
        return False

    @property
    def disk_prefetch_depth(self) -> int:
        """Steps ahead of the gathered one this store reads the rows :meth:`plan_reads` announced (a disk
        store under the lookahead host policy); the planner runs at least that far ahead. 0: it reads none
        ahead."""
        return 0

    @property
    def host_window(self) -> Optional[HostWindow]:
        """What one window of steps must fit in, for a store whose rows pass through a bounded host tier (a
        :class:`~torchrec_lookahead.store.DiskStore`, or a row-sharded store over them); ``None`` (this default):
        no bounded tier."""
        return None

    def stage_group(self) -> Optional[dist.ProcessGroup]:
        """For a :attr:`collective` store, the process group its gathers for the stager run on (``None``: the
        default group); ``None`` for a local store."""
        return None

    @abc.abstractmethod
    def gather(self, ids: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """Read rows and their optimizer state.

        Args:
            ids: (n,) integer ids, each in ``[0, num_embeddings)``; duplicates allowed.

        Returns:
            ``(weights, states)``: weights (n, D) float32 and, per state name, an (n, w) float32 tensor. The
            tensors are new memory (never views of the store).

        Raises:
            InvalidIdError: an id is negative or not below ``num_embeddings``, or ``ids`` is not a 1-D integer
                tensor.
        """

    @abc.abstractmethod
    def scatter(
        self,
        ids: torch.Tensor,
        weights: torch.Tensor,
        states: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> None:
        """Write rows and their optimizer state.

        Args:
            ids: (n,) distinct integer ids in ``[0, num_embeddings)``.
            weights: (n, D) new weights.
            states: per state name of ``state_widths``, an (n, w) tensor ((n,) accepted when ``w == 1``); may be
                omitted only when ``state_widths`` is empty.

        Raises:
            InvalidIdError: an id is out of range or repeated; nothing is written.
            DataError: a shape or a state name does not match; nothing is written.
        """

    def write_back(
        self,
        ids: torch.Tensor,
        weights: torch.Tensor,
        states: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> None:
        """:meth:`scatter` for a caller that guarantees its arguments: distinct ids in range, each row and state
        of the right shape, as when a cache writes back the rows it gathered from this store. A store may skip
        its checks here; this default calls :meth:`scatter`.

        Args:
            ids: (n,) distinct integer ids in ``[0, num_embeddings)``.
            weights: (n, D) new weights.
            states: per state name of ``state_widths``, an (n, w) tensor.
        """
        self.scatter(ids, weights, states)

    def plan_reads(self, step: int, ids: torch.Tensor) -> None:
        """A hint from the planner: step ``step`` will gather ``ids`` (table ids). A store with a slower tier
        behind a faster one (a :class:`~torchrec_lookahead.store.DiskStore` under the lookahead policy) reads
        them ahead and keeps them; a hint never changes a value. This default ignores it."""
        return None

    @property
    def uses_hints(self) -> bool:
        """Whether the store ranks its rows by :meth:`plan_uses` (the planner extracts those hints only for such a
        store); ``False`` here."""
        return False

    def plan_uses(self, step: int, ids: torch.Tensor) -> None:
        """A hint from the planner as it reads a batch, the oracle's horizon before the batch's plan: step
        ``step`` looks up ``ids`` (table ids, whether the cache holds them or not). A store with a slower tier
        behind a faster one (a :class:`~torchrec_lookahead.store.DiskStore` under the lookahead policy) keeps the
        rows needed sooner; a hint never changes a value. This default ignores it."""
        return None

    def at_step(self, step: int) -> None:
        """The stager gathers step ``step`` now (see :meth:`plan_reads`). This default ignores it."""
        return None

    @abc.abstractmethod
    def full_weights(self) -> torch.Tensor:
        """The whole table as an (N, D) tensor view of the store (no copy; writes go to the store)."""

    @abc.abstractmethod
    def full_states(self) -> Dict[str, torch.Tensor]:
        """Per state name the whole (N, w) state as a tensor view of the store."""

    @abc.abstractmethod
    def load(self, weights: torch.Tensor, states: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        """Overwrite the whole table (for checkpoint restore), chunk by chunk.

        Args:
            weights: (N, D) weights.
            states: per state name an (N, w) tensor; states omitted are reset to zero.

        Raises:
            DataError: a shape or a state name does not match; nothing is written.
        """

    @abc.abstractmethod
    def flush(self) -> None:
        """Make every write durable (a no-op for in-memory stores)."""

    @property
    def keeps_files(self) -> bool:
        """Whether a checkpoint keeps this table as copies of its store files (:meth:`save_files`) instead of
        its full tensors: a table on disk may be larger than memory. ``False`` here."""
        return False

    def keep_files(self) -> None:
        """From now on, have checkpoints keep this table as pieces (:meth:`save_files`) instead of full tensors:
        the in-memory stores then track the rows written since the previous piece. A no-op where
        :attr:`keeps_files` already holds.

        Raises:
            ConfigError: this store cannot (a store shared by several processes, or one without rows of its own).
        """
        if not self.keeps_files:
            raise ConfigError(
                f"{type(self).__name__} of table '{self.name}' cannot keep its rows in checkpoint pieces"
            )

    def save_files(self, directory: str, max_chain: int = 1) -> List[str]:
        """Write a checkpoint piece of this rank's part of the table into ``directory``, durably, holding at most
        a block of it in memory (the host tier's unwritten rows are written first): a delta over the chain of
        pieces last saved or loaded while it has fewer than ``max_chain`` pieces, else a full piece. Only where
        :attr:`keeps_files`.

        Returns:
            The chain (piece paths, the full one first) that holds this rank's part now (none: no rows).
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no files to copy")

    def snapshot_files(self, directory: str, max_chain: int = 1) -> Tuple[List[str], Optional[PendingPiece]]:
        """:meth:`save_files`, leaving to the returned writer what may be written while training goes on (the
        piece, what it holds taken here): the chain, and the writer (``None``: everything is written)."""
        return self.save_files(directory, max_chain), None

    def load_files(self, pieces: Sequence[str]) -> None:
        """Make this rank's part of the table what the chain ``pieces`` (:meth:`save_files`) stands for.

        Raises:
            ConfigError: a piece is missing, damaged, or of another table, shard, layout or seed; nothing is
                written then.
        """
        raise NotImplementedError(f"{type(self).__name__} keeps no files to load")

    @property
    def row_width(self) -> int:
        """Number of float32 columns of one stored row: ``D + sum(state_widths)``."""
        return self.embedding_dim + sum(self.state_widths.values())

    @property
    def nbytes(self) -> int:
        """Bytes the table and its optimizer state occupy in the store."""
        return self.num_embeddings * self.row_width * 4


@dataclasses.dataclass(frozen=True)
class StoreShape:
    """The shape of one stored table: its name, rows, row width and optimizer state columns (a value: the
    stores hold one and answer :class:`EmbeddingStore`'s shape properties from it). It checks nothing: each
    store checks its sizes where it reports them.

    Example:
        >>> shape = StoreShape("t", 10, 4, {"momentum1": 1, "momentum2": 4})
        >>> shape.row_width, shape.nbytes, shape.columns
        (9, 360, {'momentum1': (4, 5), 'momentum2': (5, 9)})
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    state_widths: Dict[str, int]  #: optimizer state name -> columns, in row order (never mutated)

    @property
    def row_width(self) -> int:
        """Number of float32 columns of one stored row: ``D + sum(state_widths)``."""
        return self.embedding_dim + sum(self.state_widths.values())

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored row (float32)."""
        return self.row_width * 4

    @property
    def nbytes(self) -> int:
        """Bytes of the table and its optimizer state."""
        return self.num_embeddings * self.row_bytes

    @functools.cached_property
    def columns(self) -> Dict[str, Tuple[int, int]]:
        """Per state name its columns ``[a, b)`` in a stored row (after the ``D`` weight columns)."""
        cols: Dict[str, Tuple[int, int]] = {}
        col = self.embedding_dim
        for key, width in self.state_widths.items():
            cols[key] = (col, col + width)
            col += width
        return cols

    def split(self, rows: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """``(weights, states)``: views of the columns of stored ``rows`` (n, row_width)."""
        return rows[:, : self.embedding_dim], {k: rows[:, a:b] for k, (a, b) in self.columns.items()}

    def check_ids(self, ids: Any, unique: bool) -> Tuple[Optional[InvalidIdError], torch.Tensor]:
        """``(None, ids)`` as a contiguous CPU int64 tensor when ``ids`` is a 1-D integer tensor of ids in
        ``[0, num_embeddings)`` (distinct, if ``unique``); else ``(error, no ids)``, for the store to raise
        (a collective store raises it on every rank)."""
        empty = _NO_IDS
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point() or ids.is_complex():
            desc = (
                f"tensor of shape {tuple(ids.shape)} and dtype {ids.dtype}"
                if isinstance(ids, torch.Tensor)
                else type(ids).__name__
            )
            return InvalidIdError(
                f"ids for table '{self.name}' must be a 1-D integer tensor but got {desc}", table=self.name
            ), empty
        if not (ids.dtype is torch.int64 and ids.is_cpu and ids.is_contiguous()):
            ids = ids.to(device="cpu", dtype=torch.int64).contiguous()
        if ids.numel() == 0:
            return None, ids
        arr = ids.numpy()  # NumPy's reductions: no intra-op threads for a few hundred ids
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.num_embeddings:
            bad = lo if lo < 0 else hi
            return InvalidIdError(
                f"id {bad} of table '{self.name}' is out of range [0, {self.num_embeddings}); "
                "remap or hash ids into the table before training",
                table=self.name,
                id=bad,
                num_rows=self.num_embeddings,
            ), empty
        if unique and sorted_unique(arr).size != arr.size:
            return InvalidIdError(
                f"scatter into table '{self.name}' got repeated ids; pass each id at most once",
                table=self.name,
            ), empty
        return None, ids

    def fields(self) -> Dict[str, Any]:
        """The shape as the plain values a store's file header records."""
        return {
            "name": self.name,
            "num_embeddings": self.num_embeddings,
            "embedding_dim": self.embedding_dim,
            "state_widths": dict(self.state_widths),
        }


class ShapedStore(EmbeddingStore):
    """An :class:`EmbeddingStore` whose shape properties come from one :class:`StoreShape`, ``_shape``, that
    the subclass sets in its constructor."""

    _shape: StoreShape

    @property
    def name(self) -> str:
        return self._shape.name

    @property
    def num_embeddings(self) -> int:
        return self._shape.num_embeddings

    @property
    def embedding_dim(self) -> int:
        return self._shape.embedding_dim

    @property
    def state_widths(self) -> Dict[str, int]:
        return dict(self._shape.state_widths)

    @property
    def row_width(self) -> int:
        return self._shape.row_width

    @property
    def nbytes(self) -> int:
        return self._shape.nbytes


def check_load(
    shape: StoreShape, weights: torch.Tensor, states: Optional[Mapping[str, torch.Tensor]]
) -> Dict[str, torch.Tensor]:
    """The arguments of :meth:`EmbeddingStore.load` checked against a table's shape: the given states (a subset
    of ``state_widths``; a width-1 state may come as a vector).

    Raises:
        DataError: an unknown state, or a tensor of another shape, naming the table.
    """
    name, num_embeddings, embedding_dim = shape.name, shape.num_embeddings, shape.embedding_dim
    state_widths = shape.state_widths
    out = dict(states or {})
    unknown = set(out) - set(state_widths)
    if unknown:
        raise DataError(
            f"load into table '{name}' got unknown states {sorted(unknown)}; expected {sorted(state_widths)}"
        )
    if tuple(weights.shape) != (num_embeddings, embedding_dim):
        raise DataError(
            f"load into table '{name}' expects weights of shape ({num_embeddings}, {embedding_dim}) but got "
            f"{tuple(weights.shape)}"
        )
    for key, val in out.items():
        width, got = state_widths[key], tuple(val.shape)
        if got != (num_embeddings, width) and not (width == 1 and got == (num_embeddings,)):
            raise DataError(
                f"load into table '{name}' expects state '{key}' of shape ({num_embeddings}, {width}) but got {got}"
            )
    return out
