"""Reading a training loader's global sparse features, in the ranks' lockstep (:func:`global_batches`), and the
capacity pre-scan before training of an epoch's first batches, or of a whole epoch (:func:`prescan`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Generator, Iterator, Optional, Protocol, Tuple, runtime_checkable

from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torchrec.datasets.utils import Batch

from torchrec_lookahead._rng import preserved_rng
from torchrec_lookahead.distributed.lockstep import IdGatherer
from torchrec_lookahead.errors import SetupError
from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig, UnknownFeatures
from torchrec_lookahead.oracle.ttl import Shortfall
from torchrec_lookahead.runtime.adapter import BatchAdapter, as_torchrec_batch
from torchrec_lookahead.runtime.capacity import scan_stream
from torchrec_lookahead.runtime.target import CacheTarget

__all__ = ["global_batches", "prescan", "PreScan", "LockstepLoader"]

log = logging.getLogger(__name__)


@runtime_checkable
class LockstepLoader(Protocol):
    """A loader whose own reading is a collective of every rank (the cold pass of a hot/cold stream): it makes
    its gathers through the planner's id gatherer, in the same lockstep and on the planner's thread."""

    def join_lockstep(self, gatherer: IdGatherer) -> None:
        """Gather through ``gatherer`` during the next iteration."""
        ...


def global_batches(
    loader: Any,
    gatherer: Optional[IdGatherer],
    stopped: Callable[[], bool] = lambda: False,
    adapter: Optional[BatchAdapter] = None,
    source: Optional[Iterator[Any]] = None,
) -> Iterator[Tuple[Batch, Any]]:
    """``(batch, global sparse features)`` for each batch of ``loader``: with a gatherer (several ranks), every
    rank's ids of the batch gathered in lockstep (dense features never leave the rank); without, the batch's
    own. Batches that are not TorchRec ``Batch`` es are read through ``adapter``
    (:func:`~torchrec_lookahead.runtime.adapter.as_torchrec_batch`). Ends with the loader (with a gatherer: when
    the gathers end) or once ``stopped()``. A loader whose own reading needs collectives (``join_lockstep``,
    e.g. the cold pass of a hot/cold stream) makes them through the gatherer, in the same lockstep. ``source``:
    the loader's iterator, already started (default: ``iter(loader)`` here)."""
    if gatherer is not None and isinstance(loader, LockstepLoader):
        loader.join_lockstep(gatherer)
    it = iter(loader) if source is None else source
    while not stopped():
        b = next(it, None)
        if b is not None:
            b = as_torchrec_batch(b, adapter)
        if stopped():
            return
        if gatherer is None:
            if b is None:
                return
            yield b, b.sparse_features
            continue
        global_kjt = gatherer.gather(None if b is None else b.sparse_features)
        if global_kjt is None or b is None:
            return
        yield b, global_kjt


@dataclass(frozen=True)
class PreScan:
    """What a capacity pre-scan (:func:`prescan`) read.

    Attributes:
        need: the largest window working set per cached table, over the batches read (under the ``ttl``
            policy, what its oracle held at most, which is more). A table of a shared slot space is bound by
            its space's need, not by its share of the space's rows.
        batches: batches read (with several ranks: global batches, the same on every rank).
        ended: the loader ended: the whole epoch was read (``False``: the scan stopped at its bound).
        seconds: the scan's wall time on this rank.
        space_need: per shared slot space (two tables or more), what its tables' windows need together (under
            ``ttl``, what the space held at most), against the sum of its members' capacities.
    """

    need: Dict[str, int]
    batches: int
    ended: bool
    seconds: float
    space_need: Dict[str, int] = field(default_factory=dict)


def prescan(
    inner: Any,
    target: CacheTarget,
    prefetch_depth: int,
    stop_timeout_s: float = 60.0,
    adapter: Optional[BatchAdapter] = None,
    on_batch: Optional[Callable[[], None]] = None,
    max_batches: Optional[int] = None,
    max_seconds: Optional[float] = None,
    signalled: Callable[[], bool] = lambda: False,
    oracle_fields: Optional[Dict[str, Any]] = None,
    pinned: Optional[Dict[str, int]] = None,
) -> PreScan:
    """Read the first batches of an epoch of ``inner`` (a loader of TorchRec batches, or of others read through
    ``adapter``) and check their windows and ids against the cache before training
    (:func:`~torchrec_lookahead.runtime.capacity.scan_stream`; with several ranks over the global batches,
    gathered in lockstep). Random states, the loader's generators included, are restored.

    The scan stops at the end of the epoch, or before reading batch ``max_batches``, or before reading the next
    batch once ``max_seconds`` have passed (``None``: no such bound); the windows it did not reach are left to
    the oracle, which checks each one as it plans it, ``horizon`` batches ahead of training. With several ranks
    the bounds are rank 0's, and so is the decision that the time is up (exchanged before each batch through
    the same lockstep gathers), so every rank stops at the same batch. ``on_batch`` is called after each batch
    is read (a progress bar's tick). ``signalled`` tells whether this rank received SIGTERM
    (:func:`~torchrec_lookahead.runtime.report.sigterm_pending`): with several ranks it is exchanged before each
    batch with the time decision, and once some rank has it every rank ends the scan before the same batch and
    raises Lightning's ``SIGTERMException`` (one process stops through ``on_batch`` instead).
    ``oracle_fields`` (the loader's :class:`~torchrec_lookahead.oracle.OracleConfig` arguments) runs the oracle
    itself over the batches read too: for a policy whose need is not a window's working set (``ttl`` keeps a row
    while its next use is within the horizon), its own refusal comes before training, and ``need`` is its most
    rows held; it measures (:meth:`LookaheadOracle.measure <torchrec_lookahead.oracle.LookaheadOracle.measure>`)
    rather than refusing at the first step that does not fit, so the refusal names the most rows the batches
    read need. ``pinned``: rows of each cache held by FAE's pinned hot rows, which the batches (their cold parts)
    do not read: their windows must fit in the rest (``need`` is theirs, without the pinned rows).

    Raises:
        CapacityError, InvalidIdError: see :func:`~torchrec_lookahead.runtime.capacity.scan_stream`.
        SetupError: another rank failed during its scan.
        SIGTERMException: some rank received SIGTERM during the scan (several ranks).
    """
    t0 = time.perf_counter()
    read = 0
    ended = False
    terminated = False

    def bounded(batches: Iterator[Tuple[Batch, Any]], gatherer: Optional[IdGatherer]) -> Iterator[Any]:
        nonlocal read, ended, terminated
        limit_batches, limit_seconds = max_batches, max_seconds
        if gatherer is not None:  # rank 0's bounds, so that every rank stops at the same batch
            agreed = gatherer.gather_object((max_batches, max_seconds))
            if agreed is None:
                return
            limit_batches, limit_seconds = agreed[0]
        while True:
            over = limit_batches is not None and read >= limit_batches
            if limit_seconds is not None:
                over = over or time.perf_counter() - t0 >= limit_seconds
            if gatherer is not None:  # the ranks' clocks differ: rank 0's decides for all; any rank's signal
                decided = gatherer.gather_object((over, signalled()))
                if decided is None:
                    return
                over = bool(decided[0][0])
                terminated = any(bool(d[1]) for d in decided)
            if over or terminated:
                return
            item = next(batches, None)
            if item is None:
                ended = True
                return
            read += 1
            yield item[1]

    def sparse() -> Generator[Any, None, None]:
        if target.num_ranks == 1:
            yield from bounded(global_batches(inner, None, adapter=adapter), None)
            return
        # Every rank plans the global batch: the same lockstep gathers as the planner thread's. A rank that
        # fails (its loader raises, a check fails) tells the others, which then fail too instead of waiting.
        failed = False
        gatherer = IdGatherer(target.num_ranks, target.group, lambda: failed, stop_timeout_s)
        try:
            yield from bounded(global_batches(inner, gatherer, adapter=adapter), gatherer)
        except BaseException:
            failed = True
            try:
                gatherer.stop()
            except SetupError as e:
                log.error("capacity check: %s", e)
            raise
        if gatherer.peer_stopped:
            raise SetupError(
                f"rank(s) {gatherer.peer_stopped} failed during the capacity check of the training data (see "
                "their error)"
            )

    oracle = None
    if oracle_fields is not None:
        config = OracleConfig(
            feature_to_table=dict(target.feature_to_table),
            unknown_features=UnknownFeatures.IGNORE,
            **oracle_fields,
        )
        oracle = LookaheadOracle(config)
        # grow instead of refusing at the first step that does not fit: the refusal, once the scan ends, names
        # the largest need of the batches read, so that one retry with that capacity suffices
        oracle.measure()

    def shortfalls() -> Dict[str, Shortfall]:
        if oracle is None or terminated:
            return {}
        if ended:
            oracle.finish()
        return oracle.shortfalls()

    def ticking() -> Generator[Any, None, None]:
        ids = sparse()
        try:
            for kjt in ids:
                if on_batch is not None:
                    on_batch()
                yield kjt
                if oracle is not None:  # after the window and id checks of the batch (their summary first)
                    oracle.feed(kjt)
        finally:
            ids.close()  # at once: with several ranks, the other ranks learn that this one stopped

    stream = ticking()
    try:
        with preserved_rng(inner):
            need, space_need = scan_stream(
                stream,
                target.capacity,
                target.feature_to_table,
                target.num_embeddings,
                prefetch_depth,
                target.host_windows,
                target.slot_spaces,
                target.resident_features,
                shortfalls,
                pinned,
            )
    finally:
        stream.close()
    if oracle is not None and not terminated:
        # a table of a shared slot space reports its space's peak (the space's need): the table's is the windows'
        pooled = {t for members in target.slot_spaces.values() if len(members) > 1 for t in members}
        stats = oracle.stats()
        peaks = {t: int(s.get("peak_rows", 0)) for t, s in stats.items() if t not in pooled}
        need = {t: max(n, peaks.get(t, 0)) for t, n in need.items()}
        # the space's peak is the space's
        space_need = {
            k: max(n, *(int(stats.get(t, {}).get("peak_rows", 0)) for t in target.slot_spaces[k]))
            for k, n in space_need.items()
        }
    if terminated:
        rank_zero_info(f"SIGTERM: every rank stops in the capacity pre-scan, before batch {read}")
        raise SIGTERMException()
    return PreScan(need, read, ended, time.perf_counter() - t0, space_need)
