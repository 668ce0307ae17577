"""The runtime's contracts with what plugs into it: rows pinned in the caches (FAE's hot rows,
:class:`PinnedPart`) and the DataModule that pins them (:class:`PinnedRowsSource`, FAE's
:class:`~torchrec_lookahead.fae.HotColdDataModule`), with what it is told of the lookahead loader
(:class:`PinnedLoaderOptions`, a :data:`LookaheadFactory`).

The strategy and :class:`~torchrec_lookahead.data.LookaheadDataModule` know a plug-in only through these: they
ask ``isinstance(datamodule, PinnedRowsSource)`` and delegate, and import nothing of the plug-in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    Mapping,
    Optional,
    Protocol,
    Tuple,
    runtime_checkable,
)

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.oracle import LookaheadSettings, Policy
from torchrec_lookahead.oracle.types import BatchPlan
from torchrec_lookahead.runtime.adapter import BatchAdapter
from torchrec_lookahead.runtime.capacity import CapacityCheck

if TYPE_CHECKING:
    from torchrec_lookahead.runtime._threads import LoaderStats
    from torchrec_lookahead.runtime.batch import LookaheadBatch
    from torchrec_lookahead.runtime.loader import LookaheadLoader
    from torchrec_lookahead.runtime.session import CacheSession

__all__ = [
    "PinnedPart",
    "PinnedRowsSource",
    "PinnedLoaderOptions",
    "LookaheadFactory",
    "CachedTrainingLoader",
]


@runtime_checkable
class PinnedPart(Protocol):
    """Rows pinned in the first slots of the caches' slot spaces for a whole plan stream (FAE's hot rows, implemented by
    :class:`~torchrec_lookahead.fae.PinnedRows`): the oracle plans the rest of each cache, over the part of
    each batch that reads no pinned row, and its plans are lifted to the whole cache."""

    @property
    def pinned_rows(self) -> Dict[str, int]:
        """Pinned rows per cached table."""
        ...

    @property
    def pinned_slots(self) -> Dict[str, Tuple[int, int]]:
        """Per cached table, the slots of its pinned rows as (first slot, rows): the first slots of its slot
        space, member after member."""
        ...

    @property
    def hot_ids(self) -> Dict[str, torch.Tensor]:
        """The pinned rows' sorted ids per cached table (:meth:`cold_part` leaves them out; the others keep their
        ids)."""
        ...

    def dynamic_capacity(self) -> Dict[str, int]:
        """Cache slots per table left to the oracle."""
        ...

    def cold_part(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``kjt`` without its pinned ids: what the oracle plans."""
        ...

    def lift(self, plan: BatchPlan, kjt: KeyedJaggedTensor) -> BatchPlan:
        """``plan`` (over the dynamic slots, for ``cold_part(kjt)``) as a plan of the whole cache for ``kjt``."""
        ...


#: Builds the :class:`~torchrec_lookahead.runtime.LookaheadLoader` of a loader on a session, with rows pinned
#: (the :class:`~torchrec_lookahead.data.LookaheadDataModule` passes its horizon, depth, policy and options).
LookaheadFactory = Callable[[Any, "CacheSession", PinnedPart], "LookaheadLoader"]


@dataclass(frozen=True)
class PinnedLoaderOptions:
    """What a :class:`PinnedRowsSource` is told of the lookahead loader it is asked for (the
    :class:`~torchrec_lookahead.data.LookaheadDataModule`'s settings).

    Attributes:
        policy: the oracle's policy.
        prefetch_depth: steps ahead the fetched rows are gathered (the capacity check's window).
        capacity_check: whether the epoch is checked against the caches before training.
        batch_adapter: how the wrapped DataModule's batches are read, if they are not TorchRec ``Batch`` es.
        trainer: where set-up reports go (text on rank 0 and TensorBoard; ``None``: logging only).
        capacity_check_batches: the pre-scan's bound in batches (``None``: none).
        capacity_check_seconds: the pre-scan's bound in seconds (``None``: none).
        settings: the oracle's settings (the pre-scan plans the cold batches with them under ``ttl``).
    """

    policy: Policy
    prefetch_depth: int
    capacity_check: CapacityCheck
    batch_adapter: Optional[BatchAdapter] = None
    trainer: Optional[Any] = None
    capacity_check_batches: Optional[int] = None
    capacity_check_seconds: Optional[float] = None
    settings: Optional[LookaheadSettings] = None


@runtime_checkable
class CachedTrainingLoader(Protocol):
    """The training loader a :class:`~torchrec_lookahead.data.LookaheadDataModule` serves, plain
    (:class:`~torchrec_lookahead.runtime.LookaheadLoader`) or with pinned rows (FAE's
    :class:`~torchrec_lookahead.fae.HotColdLookaheadLoader`): an epoch of planned batches, its length, its
    counters, its mid-epoch state, and a way to stop its threads."""

    def __iter__(self) -> Iterator[LookaheadBatch]:
        """An epoch of planned batches."""
        ...

    def __len__(self) -> int:
        """Batches per epoch."""
        ...

    def stats(self) -> LoaderStats:
        """The counters of the loader's threads."""
        ...

    def state_dict(self) -> Dict[str, int]:
        """The position in the current epoch."""
        ...

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume at ``state_dict``'s position at the next iteration."""
        ...

    def close(self) -> None:
        """Stop the background threads of the current iteration."""
        ...


@runtime_checkable
class PinnedRowsSource(Protocol):
    """A DataModule whose training batches read rows pinned in the caches (FAE's hot rows, implemented by
    :class:`~torchrec_lookahead.fae.HotColdDataModule`).

    The strategy sizes the caches from it while sharding (:meth:`pinned_hot_ids`, :meth:`cold_batches`);
    :class:`~torchrec_lookahead.data.LookaheadDataModule` asks it for the training loader
    (:meth:`pinned_loader`) when it wraps one.
    """

    def pinned_hot_ids(self) -> Dict[str, torch.Tensor]:
        """Table -> sorted ids to pin, after calibrating or loading what decides them if not done yet (kept for
        training): what the budget planner takes off the device budget."""
        ...

    def cold_batches(self) -> Iterable[Any]:
        """The epoch's training batches that the dynamic (not pinned) part of the caches serves, in order, read
        from a new training loader: what the budget planner sizes the dynamic caches from."""
        ...

    def pinned_loader(
        self, inner: Any, session: CacheSession, lookahead: LookaheadFactory, options: PinnedLoaderOptions
    ) -> CachedTrainingLoader:
        """The training loader over ``inner`` (this DataModule's training loader) with its rows pinned in the
        caches of ``session``; its plan streams are :class:`~torchrec_lookahead.runtime.LookaheadLoader` s built
        by ``lookahead``.

        Refuses the ``options`` it cannot serve, reports the pinned rows and, with ``capacity_check="epoch"``,
        checks the epoch's batches against the dynamic caches before training.

        Raises:
            ConfigError: ``options`` (or the session's target) that pinned rows do not support.
            CapacityError: the pinned rows, or a window of the epoch, do not fit the caches.
        """
        ...
