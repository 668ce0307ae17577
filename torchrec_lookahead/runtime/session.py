"""``CacheSession``: the one owner of a cached job's training step.

One session is built per fit, by the ``torchrec`` strategy (or by
:class:`~torchrec_lookahead.train_pipeline.LookaheadTrainPipeline` in a plain TorchRec loop), once the model is
sharded. It holds the model's cached collections, what the planner needs to know of them (the
:class:`~torchrec_lookahead.runtime.CacheTarget`, with the process group of the planner's id gathers), and the
planning loader (:class:`~torchrec_lookahead.runtime.LookaheadLoader`, which attaches itself). Step ``t`` reads
top-down; nothing below calls back up::

    planner thread   LookaheadLoader._plan: batch t + h read, gathered (W ranks), planned by the oracle,
                     ids remapped to slots, LRPP plan with each cache kernel's exchange index (which bags or
                     ids' gradients go where, the exchange batches' indices), stores told which rows step
                     t + h reads, each collection's moves of the plan (prepare: one per slot space, with the
                     step's counts, hits included)
    stager thread    LookaheadLoader._stage: rows of plan t gathered, each slot space's as one, once plan
                     t - depth - 1 is applied and the store writes of the rows evicted so far have landed
                     (one rank: the training thread leaves them here, land_write_backs)
    training thread  strategy.batch_to_device (or the pipeline's _wait_for_batch) -> CacheSession.apply(t):
                       1. pinned rows (FAE, first batch of a plan stream)     module.pin_rows
                       2. the apply gate opens step t                         gate.begin
                       3. step t's staged rows (wait, or gather them here)    loader.staged_rows
                       4. each cached collection applies plan t               module.apply_plan
                          (per slot space: its evicted rows copied out of the cache, then its fetched rows in;
                          W ranks: step t - 1's delayed rows land, the evicted rows this rank writes named
                          to the write (writes=), replicas refresh, the backward's plan armed)
                       5. the gate records plan t applied                     gate.applied
                     -> forward (the cache consumes its one-forward plan, AppliedPlan)
                     -> backward (the cache kernel's backward hook: the exact gradient exchange, which only
                        packs, all-gathers and places gradients by the plan's exchange index, the optimizer in
                        backward, rows no rank reads at t + 1 all-gathered in the background)
                     -> end of step (those delayed rows land at apply(t + 1) or at flush)

:meth:`new_stream` (flush, then empty the caches) starts every plan stream: the planning loader calls it when
an iteration starts, since its fresh oracle plans from an empty cache.

The state of one step, and who holds it::

    the plan                 LookaheadBatch (plan, staged rows, LRPP plan, each collection's PreparedPlan:
                             one move per slot space), an immutable value the planner thread built
    the apply gate           the session's gate (ApplyProgress): which plans' write-backs have landed; the
                             stager of its planning loader waits on it
    the plan applied         each cache's AppliedPlan, consumed by the next forward (one plan, one forward)
    the rows a rank writes   apply_plan's and flush's writes= (W ranks: LRPP's evict_writer / writer), an
                             argument of each store write, never state of the store
    W ranks                  each collection's StepState: the LRPP plan the backward reads, its pending
                             delayed exchanges, dirty, eval_flushed
    counters                 stats(): one CacheStats snapshot of every counter of the job: the loader
                             threads' LoaderStats, the hot batches and the training thread's time in cache
                             code (the session's), each cached table's (its cache counts them as it
                             applies and flushes), LRPP's synchronisation counters (W ranks); the
                             difference of two snapshots is the work between them (CacheMonitor logs it)
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import (
    TYPE_CHECKING,
    Any,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    runtime_checkable,
)

import torch
import torch.distributed as dist

from torchrec_lookahead.distributed.sharded_collection import ShardedLookaheadCollection
from torchrec_lookahead.modules import PreparedPlan
from torchrec_lookahead.oracle import BatchPlan
from torchrec_lookahead.runtime._threads import ApplyProgress, LoaderStats
from torchrec_lookahead.runtime.batch import LookaheadBatch, staged_result
from torchrec_lookahead.runtime.target import CacheTarget, cached_modules

if TYPE_CHECKING:
    from torchrec_lookahead.runtime.loader import LookaheadLoader

__all__ = ["CacheSession", "CacheHost", "CacheStats"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheStats:
    """Every counter of a cached job, one snapshot (:meth:`CacheSession.stats`); the difference of two
    snapshots is the work between them.

    Attributes:
        threads: the planning loader's threads: waits of the training thread, CPU time of the reader,
            planner and stager threads, batches each handled (zero without a planning loader).
        hot_batches: hot batches applied, which read only pinned rows (FAE's hot/cold loader).
        training_thread_s: seconds the training thread spent in cache code: applying plans (without the wait
            for staged rows), making FAE's hot batches (:meth:`CacheSession.cache_code`) and, with several
            ranks, the cache kernels' backward hooks (the exact gradient exchange and its update).
        tables: per cached table its counters (``steps``, ``lookups``, ``hits``, ``rows_fetched``,
            ``rows_written_back``, ``rows_flushed``, ``bytes_moved``; ``hits`` are lookups served by a row
            cached before the step's fetches).
        sync: several ranks: LRPP's synchronisation counters, summed over the cached collections
            (``rows_synced_critical``, ``rows_synced_delayed``, ``grad_floats_sent``, ...).

    Example:
        >>> before = CacheStats(tables={"t": {"lookups": 4, "hits": 1}}, sync={"rows_refreshed": 2})
        >>> after = CacheStats(LoaderStats(planned=3), 1, 0.5, {"t": {"lookups": 10, "hits": 5}}, {"rows_refreshed": 3})
        >>> d = after - before
        >>> d.threads.planned, d.hot_batches, d.tables["t"], d.sync, d.hit_rate
        (3, 1, {'lookups': 6, 'hits': 4}, {'rows_refreshed': 1}, 0.6666666666666666)
    """

    threads: LoaderStats = field(default_factory=LoaderStats)
    hot_batches: int = 0
    training_thread_s: float = 0.0
    tables: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    sync: Mapping[str, int] = field(default_factory=dict)

    def __sub__(self, other: CacheStats) -> CacheStats:
        def minus(a: Mapping[str, int], b: Mapping[str, int]) -> Dict[str, int]:
            return {k: v - b.get(k, 0) for k, v in a.items()}

        return CacheStats(
            self.threads - other.threads,
            self.hot_batches - other.hot_batches,
            self.training_thread_s - other.training_thread_s,
            {t: minus(c, other.tables.get(t, {})) for t, c in self.tables.items()},
            minus(self.sync, other.sync),
        )

    @property
    def hit_rate(self) -> float:
        """Hits over lookups, every cached table together (0.0 without lookups)."""
        lookups = sum(c.get("lookups", 0) for c in self.tables.values())
        return sum(c.get("hits", 0) for c in self.tables.values()) / lookups if lookups else 0.0


class CacheSession:
    """The cached step's owner (module docstring): applies each training batch's plan to the cached
    collections, starts plan streams, flushes.

    Args:
        target: the cached tables as the planner sees them.
        modules: the model's collections with cached tables (none: a session that only drives a planning
            loader's apply gate, for loaders tested on their own).

    Example:
        >>> from torchrec_lookahead.store import TensorStore
        >>> target = CacheTarget({"t": 8}, {"f": "t"}, {"t": 100}, {"t": TensorStore(100, 4, {}, name="t", seed=0)})
        >>> session = CacheSession(target)
        >>> session.loader is None, session.stats().threads.planned
        (True, 0)
    """

    def __init__(
        self, target: CacheTarget, modules: Sequence[ShardedLookaheadCollection[Any, Any]] = ()
    ) -> None:
        self.target = target
        self.modules: List[ShardedLookaheadCollection[Any, Any]] = list(modules)
        self._loader: Optional[LookaheadLoader] = None
        #: the apply gate: which plans' write-backs have landed (the planning loader's stager waits on it)
        self.gate = ApplyProgress(target.num_ranks)
        self._hot_batches = 0
        self._cache_s = 0.0  # the training thread's time in apply, without the wait for staged rows

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> Optional[CacheSession]:
        """The session of ``model`` (sharded, e.g. a ``DistributedModelParallel``), or ``None`` when it has no
        cached tables. With several ranks it creates the process group of the planner's id gathers (gloo, over
        the ranks of the cached collections' group): a collective, called at the same point on every rank.
        """
        modules = cached_modules(model)
        if not modules:
            return None
        first = modules[0]
        group = None
        if first.world_size > 1:
            pg = first.process_group
            ranks = dist.get_process_group_ranks(pg) if pg is not None else None
            group = dist.new_group(ranks=ranks, backend="gloo")
        return cls(CacheTarget.from_modules(modules, first.world_size, first.rank, group), modules)

    @property
    def pins_host_memory(self) -> bool:
        """Whether the step's host side goes through pinned memory: a cache on a CUDA device, to which the
        planning loader's staged rows, plan indices and batches are copied without the training thread waiting
        for the copies (the planner and stager threads pin them)."""
        return any(m.cache.device.type == "cuda" for m in self.modules)

    # ------------------------------------------------------------------------------------------ loaders
    @property
    def loader(self) -> Optional[LookaheadLoader]:
        """The planning loader whose batches this session applies (the last one attached)."""
        return self._loader

    def attach(self, loader: LookaheadLoader) -> None:
        """Make ``loader`` the planning loader: its wait counters are the ones :meth:`apply` drives, and its
        stager waits on this session's :attr:`gate` (a loader attaches itself when it is built on this
        session)."""
        self._loader = loader

    def stats(self) -> CacheStats:
        """Every counter of the job, a snapshot (see :class:`CacheStats`)."""
        sync: Dict[str, int] = {}
        tables: Dict[str, Mapping[str, int]] = {}
        for m in self.modules:
            tables.update(m.cache.stats())
            for k, v in m.sync_counters.items():
                sync[k] = sync.get(k, 0) + v
        return CacheStats(
            LoaderStats() if self._loader is None else self._loader.stats(),
            self._hot_batches,
            self._cache_s + sum(m.backward_hook_s for m in self.modules),
            tables,
            sync,
        )

    @contextlib.contextmanager
    def cache_code(self) -> Iterator[None]:
        """Count the block's time in :attr:`CacheStats.training_thread_s`: cache work the training thread does
        outside :meth:`apply` (a hot/cold loader making a hot batch: its plan, remapped ids and exchange index).

        Example:
            >>> from torchrec_lookahead.store import TensorStore
            >>> t = CacheTarget({"t": 8}, {"f": "t"}, {"t": 100}, {"t": TensorStore(100, 4, {}, name="t", seed=0)})
            >>> session = CacheSession(t)
            >>> with session.cache_code():
            ...     time.sleep(0.01)
            >>> session.stats().training_thread_s >= 0.01
            True
        """
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._cache_s += time.perf_counter() - t0

    def oracle_lead(self) -> int:
        """Batches planned but not yet applied."""
        return 0 if self._loader is None else self._loader.oracle_lead()

    def close(self) -> None:
        """Stop the planning loader's threads (a new iteration starts fresh ones)."""
        if self._loader is not None:
            self._loader.close()

    # --------------------------------------------------------------------------------------------- steps
    def new_stream(self) -> None:
        """Flush, then empty the caches: a new plan stream (its oracle starts from an empty cache)."""
        for m in self.modules:
            m.flush()
            m.invalidate()

    def apply(self, batch: LookaheadBatch) -> None:
        """Bring the caches to ``batch``'s plan (steps 1-5 of the module docstring); call right before the
        batch's training step, after the previous step's optimizer update, on the training thread.

        That order is the no-stale-read rule: the rows a plan evicts carry every update of the steps before
        it, and the rows it fetches were gathered only once every write-back they depend on had landed (the
        session's :attr:`gate`, a :class:`~torchrec_lookahead.runtime._threads.ApplyProgress`, tells the
        planning loader's stager when).
        Applying a plan anywhere else (earlier, on another thread, twice) would read or write stale rows.

        Raises:
            SetupError: the planning loader was stopped before the batch's rows were gathered.
        """
        t0 = time.perf_counter()
        waited = self._apply(batch)
        self._cache_s += time.perf_counter() - t0 - waited

    def _apply(self, batch: LookaheadBatch) -> float:
        """Steps 1-5 of :meth:`apply`; returns the seconds it waited for the staged rows."""
        waited = 0.0
        if batch.pin is not None:
            for m in self.modules:
                m.pin_rows(batch.pin)
        plan = batch.plan
        if plan is None:
            return waited
        staged = None
        if batch.staged is None:  # pinned rows only: nothing moves, no gate
            self._hot_batches += 1
        elif self._loader is None:
            staged = staged_result(plan, batch.staged)
        else:
            self.gate.begin(plan.step)
            t0 = time.perf_counter()
            staged = self._loader.staged_rows(plan, batch.staged)
            waited = time.perf_counter() - t0
        # the stager lands the evicted rows' store writes (one rank: none of them is a collective)
        defer = self._loader is not None and self.target.num_ranks == 1
        for i, m in enumerate(self.modules):
            # Plans from the planning loader's own oracle: the O(capacity) re-checks are skipped.
            prepared = None if batch.prepared is None else batch.prepared[i]
            m.apply_plan(plan, staged, batch.lrpp, True, prepared, defer)
        if batch.staged is not None and self._loader is not None:
            self.gate.applied(plan.step)
        return waited

    def prepare(self, plan: BatchPlan) -> Tuple[PreparedPlan, ...]:
        """Each cached collection's moves of ``plan`` (its ``prepare_plan``), for the planner thread."""
        return tuple(m.prepare_plan(plan) for m in self.modules)

    def land_write_backs(self) -> None:
        """Write the evicted rows that :meth:`apply` left to the stager to the stores (the stager calls it before
        it gathers, the training thread before it gathers itself)."""
        for m in self.modules:
            m.cache.land_write_backs()

    def abort(self) -> None:
        """After an error: stop the planning loader's threads, then flush without a barrier (other ranks may be
        inside a collective; nobody reads afterwards). After an error outside training (a bad validation batch)
        Lightning calls no DataModule teardown: the threads ran on, and the interpreter aborted at exit."""
        try:
            self.close()
        except Exception as e:  # noqa: BLE001 - the run already failed; the flush below still runs
            log.warning("could not stop the lookahead loader's threads: %s", e)
        self.flush(barrier=False)

    def flush(self, barrier: bool = True) -> None:
        """Write every cached row and its optimizer state back to the host stores (``barrier=False`` on an
        exception path, where another rank may be gone or inside a collective)."""
        for m in self.modules:
            m.flush(barrier=barrier)


@runtime_checkable
class CacheHost(Protocol):
    """What holds a cached job's session (the ``torchrec`` strategy): the DataModule wrapper and the callbacks
    find the session through it."""

    def cache_session(self) -> Optional[CacheSession]:
        """The session of the model being trained (``None`` before set-up or without cached tables)."""
        ...
