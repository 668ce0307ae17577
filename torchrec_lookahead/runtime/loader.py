"""``LookaheadLoader``: plans the cache ahead of training, for :class:`~torchrec_lookahead.data.LookaheadDataModule`.

A background thread reads the wrapped training loader ahead, a second one runs the
:class:`~torchrec_lookahead.oracle.LookaheadOracle` over the stream (``horizon`` batches ahead) and replaces
the ids of cached tables by cache slots; a third thread gathers the rows each plan fetches (with their
optimizer state) from the host stores, ``prefetch_depth`` steps ahead, but never before the write-backs
they depend on have landed: rows for step ``t`` are gathered only after plan ``t - prefetch_depth - 1`` has
been applied (the oracle never evicts an id needed within the prefetch window, so no later write-back can
touch them). The ``torchrec`` strategy applies each batch's plan right before its training step.

As it plans each batch, the planner tells every store which rows the step will gather
(:meth:`~torchrec_lookahead.store.EmbeddingStore.plan_reads`): a disk store under the lookahead host policy
reads them into its host tier ``disk_prefetch_depth`` steps ahead, so the planner runs at least that far ahead
(``queue_depth`` is raised to ``disk_prefetch_depth + 2``).

With several ranks, the planner threads all-gather every batch's ids in lockstep (an
:class:`~torchrec_lookahead.distributed.lockstep.IdGatherer`): all ranks stop gathering at the same batch, whether
the epoch ends, a rank's loader runs out early (a typed error on every rank) or a rank stops training. When
the stores are collectives (a row-sharded store), the stager threads keep their gathers in lockstep too (a
:class:`~torchrec_lookahead.distributed.lockstep.StageGathers`: a status exchanged before each plan's gathers).
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import queue
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, Deque, Dict, Iterator, List, Mapping, Optional, Tuple

import torch.distributed as dist
from torchrec.datasets.utils import Batch

from torchrec_lookahead.distributed.lockstep import GatherStatus, IdGatherer, StageGathers
from torchrec_lookahead.errors import CheckpointError, ConfigError, DataError, SetupError, peer_gone
from torchrec_lookahead.modules import stage_rows
from torchrec_lookahead.modules.types import StagedRows
from torchrec_lookahead.oracle import (
    BatchPlan,
    LookaheadSettings,
    OracleConfig,
)
from torchrec_lookahead.runtime._planning import StepPlanner
from torchrec_lookahead.runtime._threads import (
    _END,
    LoaderStats,
    _ReadError,
    _Run,
    check_nice,
    lower_thread_priority,
    single_threaded_ops,
)
from torchrec_lookahead.runtime.adapter import BatchAdapter
from torchrec_lookahead.runtime.batch import LookaheadBatch, staged_result
from torchrec_lookahead.runtime.scan import LockstepLoader, global_batches
from torchrec_lookahead.runtime.session import CacheSession
from torchrec_lookahead.runtime.types import PinnedPart
from torchrec_lookahead.store.channels import STAGE_CHANNEL, collective_channel

__all__ = ["LookaheadLoader"]

log = logging.getLogger(__name__)


class LookaheadLoader:
    """Iterable of :class:`LookaheadBatch` es planned ahead of training (see the module docstring).

    Args:
        loader: the wrapped training loader (yields TorchRec batches).
        session: the cached job's :class:`~torchrec_lookahead.runtime.CacheSession`: the loader plans its
            target's tables and attaches itself to it (the session applies the batches, driving this loader's
            apply gate); every iteration starts a new plan stream (:meth:`CacheSession.new_stream
            <torchrec_lookahead.runtime.CacheSession.new_stream>`), except with ``pinned`` rows, whose
            loader starts it itself.
        settings: the oracle's horizon, prefetch depth and policy (the rows are gathered ``prefetch_depth`` steps
            ahead); default :class:`~torchrec_lookahead.oracle.LookaheadSettings`'s defaults.
        queue_depth: planned batches kept ready (bounds memory and the oracle's lead).
        stop_timeout_s: with several ranks, how long a rank that stopped training waits for the others to join
            its planner thread's last id all-gather (and, over row-sharded stores, its stager's last row gather)
            before it gives up with a :class:`~torchrec_lookahead.errors.SetupError` (a peer failed or keeps
            training).
        planner_nice: nice value of the planner thread (Linux; 0 leaves it at the process's priority), see
            :class:`~torchrec_lookahead.data.LookaheadDataModule`.
        pinned: hot rows pinned in the first slots of the caches: the oracle plans the rest of each cache
            (:meth:`~torchrec_lookahead.fae.PinnedRows.cold_part` of every batch) and its plans are lifted
            to the whole cache. The pinned rows themselves are loaded by whoever starts the plan stream.
        batch_adapter: reads the wrapped loader's batches when they are not TorchRec ``Batch`` es (see
            :class:`~torchrec_lookahead.runtime.BatchAdapter`); the model then trains on its own batch type.
    """

    def __init__(
        self,
        loader: Any,
        session: CacheSession,
        settings: Optional[LookaheadSettings] = None,
        queue_depth: int = 8,
        stop_timeout_s: float = 60.0,
        planner_nice: int = 19,
        pinned: Optional[PinnedPart] = None,
        batch_adapter: Optional[BatchAdapter] = None,
    ) -> None:
        if not stop_timeout_s > 0:
            raise ConfigError(f"Expected stop_timeout_s > 0 but got {stop_timeout_s}")
        settings = settings if settings is not None else LookaheadSettings()
        check_nice(planner_nice)
        self.planner_nice = int(planner_nice)
        self.loader = loader
        self.stop_timeout_s = float(stop_timeout_s)
        self.session = session
        self.target = target = session.target
        self.pinned = pinned
        self.batch_adapter = batch_adapter
        self._oracle_kwargs: Dict[str, Any] = dict(
            capacity=dict(target.capacity) if pinned is None else pinned.dynamic_capacity(),
            **settings.oracle_fields(),
            num_embeddings=dict(target.num_embeddings),
            slot_spaces=dict(target.slot_spaces),
        )
        if target.num_ranks > 1:
            self._oracle_kwargs["num_ranks"] = target.num_ranks
        # Validate the arguments here, in the training thread; the planner thread builds a fresh oracle per
        # iteration.
        OracleConfig(feature_to_table=dict(target.feature_to_table), **self._oracle_kwargs)
        self.settings = settings
        self.horizon = settings.horizon
        self.prefetch_depth = prefetch_depth = settings.prefetch_depth
        #: the deepest disk prefetch of the stores: the planner runs at least that far ahead to hint its reads
        self.disk_prefetch_depth = max((s.disk_prefetch_depth for s in target.stores.values()), default=0)
        self.queue_depth = max(queue_depth, prefetch_depth + 2, self.disk_prefetch_depth + 2)
        self._yielded = 0
        #: the batches of a whole pass of the wrapped loader, where the capacity check read one: the next stream
        #: (the pass after the check's) that ends with fewer is refused, the loader cannot be read twice
        self.expected_batches: Optional[int] = None
        self._resume_from = 0
        self._resume_state: Dict[str, Any] = {}
        self._source: Optional[Iterator[Any]] = None  # the wrapped loader's iterator, started by __iter__
        #: the no-stale-read rule: which plans' write-backs have landed (the stager waits on it); the session's
        #: apply gate, which its apply drives
        self.progress = session.gate
        self._planned = -1
        self._planner_cpu = 0.0
        self._run: Optional[_Run] = None
        self._stop_error: Optional[BaseException] = None
        # the counters of stats(): each thread adds its own work (see _count)
        self._stats = LoaderStats()
        self._stats_lock = threading.Lock()
        #: the training thread may gather a step's rows itself (not when gathers are collectives, which run
        #: in lockstep on the stager's own process group)
        self.may_gather_here = not any(s.collective for s in target.stores.values())
        session.attach(self)

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def sampler(self) -> Any:
        """The wrapped loader's sampler: Lightning calls its ``set_epoch`` at every epoch, as for the resident job."""
        return getattr(self.loader, "sampler", None)

    @property
    def batch_sampler(self) -> Any:
        """The wrapped loader's batch sampler (see :attr:`sampler`)."""
        return getattr(self.loader, "batch_sampler", None)

    # ------------------------------------------------------------------------------------------- progress
    def staged_rows(self, plan: Optional[BatchPlan], staged: Future[StagedRows]) -> StagedRows:
        """The staged rows of ``plan`` for the training thread, its wait counted in
        :attr:`LoaderStats.stager_wait_s`. When the stager has not started them and gathers are not
        collectives, they are gathered here instead (counted in :attr:`LoaderStats.gathered_here`): every
        write-back they could depend on has landed (plan ``t - 1`` is applied).

        Raises:
            SetupError: the loader was stopped before the rows were gathered.
        """
        t0 = time.perf_counter()
        here = 0
        if plan is not None and not staged.done() and self.may_gather_here and staged.cancel():
            self.session.land_write_backs()
            rows = stage_rows(plan, self.target.stores, spaces=self.target.slot_spaces)
            here = 1
        else:
            rows = staged_result(plan, staged)
        self._count(LoaderStats(stager_wait_s=time.perf_counter() - t0, gathered_here=here))
        return rows

    def oracle_lead(self) -> int:
        """Batches planned but not yet applied."""
        return max(self._planned - self.progress.last, 0)

    def stats(self) -> LoaderStats:
        """The cumulative counters of the loader's threads (waits, CPU seconds, counts), as a snapshot.

        Example:
            >>> from torchrec_lookahead.runtime import CacheSession, CacheTarget
            >>> from torchrec_lookahead.store import TensorStore
            >>> store = TensorStore(100, 4, {}, name="t", seed=0)
            >>> session = CacheSession(CacheTarget({"t": 8}, {"f": "t"}, {"t": 100}, {"t": store}))
            >>> LookaheadLoader([], session).stats().planned
            0
        """
        return self._stats

    @property
    def oracle_fields(self) -> Dict[str, Any]:
        """The :class:`~torchrec_lookahead.oracle.OracleConfig` arguments of the planner's oracle (a copy)."""
        return dict(self._oracle_kwargs)

    def _count(self, work: LoaderStats) -> None:
        """Add a thread's ``work`` to :meth:`stats` (the planner, the stager and the training thread count
        concurrently)."""
        with self._stats_lock:
            self._stats = self._stats + work

    # ------------------------------------------------------------------------------------------ iteration
    def close(self) -> None:
        """Stop the background threads of the current iteration (the strategy or DataModule calls it when
        training stops before the epoch ends; a new iteration starts fresh threads).

        Raises:
            SetupError: with several ranks, the planner thread's last id all-gather (or the stager's last row
                gather over row-sharded stores) was not joined by every rank within ``stop_timeout_s`` (raised
                unless another exception is being handled, in which case it is logged).
        """
        run, self._run = self._run, None
        if run is not None:
            self._stopped(run)
        err, self._stop_error = self._stop_error, None
        if err is not None and sys.exc_info()[0] is None:
            raise err

    def _stopped(self, run: _Run) -> None:
        err = run.stop()
        if err is not None:
            # a peer's death is reported by the training thread's own error (the collective it was in): a second
            # line from a background thread's shutdown only repeats it
            log.log(logging.DEBUG if peer_gone(err) else logging.ERROR, "%s", err)
            self._stop_error = err

    def __iter__(self) -> Iterator[LookaheadBatch]:
        """An epoch of planned batches. At the first ``next``, on the training thread, where a resident loop
        does the same, the wrapped loader's iterator is created and its first batch read (then the planner and
        stager threads start): creating a ``DataLoader`` iterator draws its base seed from torch's global
        random stream, and a shuffling sampler draws its order at the first batch, so the training thread's
        stream (the model's dropout) sees the draws the resident loop's stream sees, in the same place."""
        self.close()
        start, self._resume_from = self._resume_from, 0
        if start:
            if not hasattr(self.loader, "load_state_dict"):
                raise CheckpointError(
                    f"Resuming mid-epoch (batch {start}) needs a wrapped loader with load_state_dict(); "
                    f"{type(self.loader).__name__} would replay the epoch from its first batch. Use a resumable "
                    "loader (e.g. torchrec_lookahead.data.ResumableBatchLoader) or resume from an end-of-epoch "
                    "checkpoint"
                )
            self.loader.load_state_dict({**self._resume_state, "batches_yielded": start})
        if self.pinned is None:
            self.session.new_stream()
        expected, self.expected_batches = self.expected_batches, None  # the pass after the check's only
        self._yielded = start
        self.progress.reset()
        self._planned = -1
        source = self._start_source()
        run = _Run(self.queue_depth, join_timeout_s=self.stop_timeout_s + 30.0)
        self._run = run
        if source is None:
            self._source = None
            run.start(self._plan, self._stage)
        else:  # a reader thread reads the wrapped loader ahead; the planner plans what it read
            self._source = run.read_ahead()
            run.start(self._plan, self._stage, functools.partial(self._read, source))
        try:
            while True:
                t0 = time.perf_counter()
                item = run.get()
                self._count(LoaderStats(batch_wait_s=time.perf_counter() - t0))
                if item is _END:
                    self._check_whole_epoch(expected)
                    return
                if isinstance(item, BaseException):
                    raise item
                self._yielded += 1
                yield item
        finally:
            self._stopped(run)
            if self._run is run:
                self._run = None

    def _check_whole_epoch(self, expected: Optional[int]) -> None:
        """At the end of a stream: it gave as many batches as the capacity check's whole pass (``expected``).

        Raises:
            DataError: fewer (a loader that cannot be read twice, such as a dataset wrapping a generator).
        """
        if expected is not None and self._yielded < expected:
            raise DataError(
                f"the training loader gave {self._yielded} batches where its pass for the capacity check gave "
                f"{expected}: it cannot be read twice (a dataset over a generator or a queue?); make its "
                "__iter__ start the epoch again, or use LookaheadDataModule(capacity_check='lookahead')"
            )

    def _start_source(self) -> Optional[Iterator[Any]]:
        """The wrapped loader's iterator with its first batch read (see :meth:`__iter__`); ``None`` for a loader
        whose reading is a collective in the planner's lockstep (``join_lockstep``): the planner thread starts
        it, after joining."""
        if isinstance(self.loader, LockstepLoader):
            return None
        it = iter(self.loader)
        first = next(it, _END)
        return it if first is _END else itertools.chain([first], it)

    def _read(self, source: Iterator[Any], run: _Run) -> None:
        """The reader thread: reads the wrapped loader's batches ahead of the planner (at most ``queue_depth``
        waiting), so that reading and planning use two cores; what reading raises goes to the planner, which
        hands it to the training thread."""
        single_threaded_ops()
        lower_thread_priority(self.planner_nice)
        cpu = time.thread_time()
        try:
            for b in source:
                now = time.thread_time()
                self._count(LoaderStats(reader_cpu_s=now - cpu, read=1))
                cpu = now
                if not run.put_read(b):
                    return
            run.put_read(_END)
        except BaseException as e:
            run.put_read(_ReadError(e))

    def _plan(self, run: _Run) -> None:
        single_threaded_ops()
        lower_thread_priority(self.planner_nice)
        gatherer = None
        if self.target.num_ranks > 1:
            gatherer = IdGatherer(
                self.target.num_ranks, self.target.group, lambda: run.stopped, self.stop_timeout_s
            )
        try:
            self._plan_stream(run, gatherer)
            if gatherer is not None and gatherer.peer_stopped:
                # Only seen by a rank that keeps training after another one stopped (not in lockstep).
                run.put(
                    SetupError(
                        f"rank(s) {gatherer.peer_stopped} stopped training at batch {gatherer.count - 1} of the "
                        f"epoch while rank {self.target.rank} still asks for batches: every rank must stop at the "
                        "same step (did another rank fail?)"
                    )
                )
            else:
                run.put(_END)
        except BaseException as e:  # handed to the training thread
            run.put(e)
        finally:
            run.to_stage.put(None)
            if gatherer is not None:
                try:  # tell the other ranks, through the same collective, that this rank stops
                    gatherer.stop()
                except BaseException as e:
                    run.shutdown_failed(e)

    def _plan_stream(self, run: _Run, gatherer: Optional[IdGatherer]) -> None:
        """Take the wrapped loader's batches (from the reader thread, or read here for a loader whose reading is a
        collective; their global ids, gathered in lockstep with several ranks), plan
        each with the oracle ``horizon`` batches ahead, and hand every planned batch to the stager and to the
        training thread, in order; returns when the loader ends or the run stops."""
        planner: Optional[StepPlanner] = None
        self._planner_cpu = time.thread_time()  # the planner's CPU time is counted per batch handed out
        read: Deque[Tuple[Batch, Any]] = collections.deque()  # read, not yet planned (the oracle's window)
        source, self._source = self._source, None
        for b, global_kjt in global_batches(
            self.loader, gatherer, lambda: run.stopped, self.batch_adapter, source
        ):
            if planner is None:
                planner = StepPlanner(
                    self.target,
                    self._oracle_kwargs,
                    self.pinned,
                    self.session.prepare,
                    self.session.pins_host_memory,
                )
            read.append((b, global_kjt))
            if not self._hand_out(run, planner, planner.feed(global_kjt), read):
                return
        if planner is not None:
            self._hand_out(run, planner, planner.finish(), read)

    def _hand_out(
        self, run: _Run, planner: StepPlanner, plans: List[BatchPlan], read: Deque[Tuple[Batch, Any]]
    ) -> bool:
        """Hand out the batches of ``plans`` (the oldest of ``read``): each plan to the stager, each batch to the
        training thread. ``False`` once the run stopped."""
        for plan in plans:
            b, global_kjt = read.popleft()
            plan = planner.whole_plan(plan, global_kjt)
            fut: Future[StagedRows] = Future()
            run.to_stage.put((plan, fut))
            item = planner.batch(plan, b, global_kjt, fut)
            self._planned = plan.step
            now = time.thread_time()  # reading, gathering, planning and remapping since the last batch
            self._count(LoaderStats(planner_cpu_s=now - self._planner_cpu, planned=1))
            self._planner_cpu = now
            if not run.put(item):
                return False
        return True

    def _stage_gathers(self, run: _Run) -> Optional[StageGathers]:
        """Lockstep for the stager's gathers when they are collectives (a row-sharded store over several ranks):
        they run on the stores' :data:`STAGE_CHANNEL` group, the status exchanges too."""
        for store in self.target.stores.values():
            if not store.collective:
                continue
            group = store.stage_group()
            world = dist.get_world_size(group)
            if world > 1:
                return StageGathers(world, group, lambda: run.stopped, self.stop_timeout_s)
        return None

    def _stage(self, run: _Run) -> None:
        single_threaded_ops()
        gathers = self._stage_gathers(run)
        wait = None if gathers is None else gathers.wait
        status = GatherStatus.STOP
        try:
            while not run.stopped:
                try:
                    item = run.to_stage.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is None:
                    status = GatherStatus.END
                    return
                plan, fut = item
                self.progress.wait(plan.step - self.prefetch_depth - 1, lambda: run.stopped)
                if run.stopped:
                    fut.cancel()
                    return
                if not fut.set_running_or_notify_cancel():
                    continue  # the training thread gathered these rows itself
                try:
                    if gathers is not None and not gathers.begin():
                        fut.set_exception(
                            SetupError(
                                f"rank(s) {gathers.peer_stopped} stopped gathering rows before plan {plan.step} "
                                f"while rank {self.target.rank} still trains: every rank must stop at the same step "
                                "(did another rank fail?)"
                            )
                        )
                        return
                    # A row-sharded store's gathers are collectives: on a process group of the stager's own,
                    # so they never interleave with the training thread's write-backs, and in lockstep.
                    cpu = time.thread_time()
                    # the evicted rows of the plans applied so far land first (the training thread left
                    # their store writes to this thread)
                    self.session.land_write_backs()
                    with collective_channel(STAGE_CHANNEL, wait):
                        rows = stage_rows(
                            plan,
                            self.target.stores,
                            pin_memory=self.session.pins_host_memory,
                            spaces=self.target.slot_spaces,
                        )
                    self._count(LoaderStats(stager_cpu_s=time.thread_time() - cpu, staged=1))
                    fut.set_result(rows)
                except BaseException as e:
                    fut.set_exception(e)
                    if (
                        gathers is not None
                    ):  # no further collective once one failed (the training thread raises)
                        return
        finally:
            if gathers is not None:
                try:  # tell the other ranks' stagers, through the same exchange, that this one stops
                    gathers.stop(status)
                except BaseException as e:
                    run.shutdown_failed(e)
                if (
                    gathers.timed_out is not None
                ):  # a gather abandoned after the stop (nobody waits for its rows)
                    run.shutdown_failed(gathers.timed_out)
            while True:  # cancel what is left, so that no one waits for it
                try:
                    item = run.to_stage.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[1].cancel()

    # ------------------------------------------------------------------------------------------ resumption
    def state_dict(self) -> Dict[str, Any]:
        """Batches handed out in the current epoch (the oracle restarts from an empty cache on resume), with what
        else the wrapped loader records (a :class:`~torchrec_lookahead.data.ResumableBatchLoader`: its files)."""
        inner = self.loader.state_dict() if hasattr(self.loader, "state_dict") else {}
        return {**(inner if isinstance(inner, dict) else {}), "batches_yielded": self._yielded}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if "batches_yielded" not in state_dict:
            hotcold = "hot_served" in state_dict and "cold_served" in state_dict
            raise CheckpointError(
                f"the checkpoint's loader state {dict(state_dict)} is not a lookahead loader's (no 'batches_yielded')"
                + (": it was written by a run with FAE's HotColdDataModule" if hotcold else "")
                + "; resume it with the config that wrote it, or start a new run from its weights"
            )
        self._resume_from = int(state_dict["batches_yielded"])
        # the rest goes to the wrapped loader when the next epoch starts there
        self._resume_state = {k: v for k, v in state_dict.items() if k != "batches_yielded"}
