"""``LookaheadDataModule``: wraps any DataModule of TorchRec batches and plans the cache ahead of training.

A background thread reads the wrapped training loader, runs the
:class:`~torchrec_lookahead.oracle.LookaheadOracle` over the stream (``horizon`` batches ahead) and replaces
the ids of cached tables by cache slots; a second thread gathers the rows each plan fetches (with their
optimizer state) from the host stores, ``prefetch_depth`` steps ahead, but never before the write-backs
they depend on have landed: rows for step ``t`` are gathered only after plan ``t - prefetch_depth - 1`` has
been applied (the oracle never evicts an id needed within the prefetch window, so no later write-back can
touch them). The ``torchrec`` strategy applies each batch's plan right before its training step.

Validation and test loaders are the wrapped DataModule's own: evaluation reads ids, not slots.

With several ranks, the planner threads all-gather every batch's ids in lockstep (an
:class:`~torchrec_lookahead.distributed.lrpp.IdGatherer`): all ranks stop gathering at the same batch, whether
the epoch ends, a rank's loader runs out early (a typed error on every rank) or a rank stops training. When
the stores are collectives (a row-sharded store), the stager threads keep their gathers in lockstep too (a
:class:`~torchrec_lookahead.distributed.lrpp.StageGathers`: a status exchanged before each plan's gathers).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import queue
import sys
import threading
import time
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Generator, Iterator, List, Mapping, Optional, Tuple

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torchrec.datasets.utils import Batch
from typing_extensions import override

from torchrec_lookahead.data.capacity import check_stream, preserved_rng
from torchrec_lookahead.data.rank_split import split_for_ranks
from torchrec_lookahead.data.wrapper import WrappedDataModule
from torchrec_lookahead.distributed.lrpp import (
    GatherStatus,
    IdGatherer,
    LRPPTracker,
    StageGathers,
    slice_samples,
)
from torchrec_lookahead.errors import CheckpointError, ConfigError, SetupError
from torchrec_lookahead.hotcold.pinned import PinnedRows
from torchrec_lookahead.modules import remap_kjt, stage_rows, table_ids
from torchrec_lookahead.modules.types import StagedRows
from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig, Policy
from torchrec_lookahead.oracle.types import BatchPlan
from torchrec_lookahead.store.sharded_store import STAGE_CHANNEL, collective_channel
from torchrec_lookahead.store.types import EmbeddingStore

__all__ = ["LookaheadBatch", "LookaheadDataModule", "LookaheadLoader", "CacheTarget"]

log = logging.getLogger(__name__)


@dataclass
class LookaheadBatch(Batch):
    """A TorchRec batch whose cached features hold cache slots, with the step's plan and staged rows.

    Attributes:
        plan: the step's plan (apply before the step).
        staged: future of the rows the plan fetches (gathered in the background).
        loader: the loader that produced the batch (told when the plan has been applied); ``None`` for a
            hot batch of pinned rows, which moves nothing.
        lrpp: with several ranks, the step's synchronisation plan.
        pin: a plan to apply before ``plan``, on an empty cache: it loads the pinned hot rows (first batch of
            a plan stream with pinned rows, see :class:`~torchrec_lookahead.hotcold.PinnedRows`).
    """

    plan: Optional[BatchPlan] = None
    staged: Optional[Future[StagedRows]] = None
    loader: Optional[LookaheadLoader] = field(default=None, repr=False)
    lrpp: Optional[Any] = None
    pin: Optional[BatchPlan] = None

    def to(self, device: torch.device, non_blocking: bool = False) -> LookaheadBatch:
        return LookaheadBatch(
            dense_features=self.dense_features.to(device=device, non_blocking=non_blocking),
            sparse_features=self.sparse_features.to(device=device, non_blocking=non_blocking),
            labels=self.labels.to(device=device, non_blocking=non_blocking),
            plan=self.plan,
            staged=self.staged,
            loader=self.loader,
            lrpp=self.lrpp,
            pin=self.pin,
        )

    def wait_staged(self) -> Optional[StagedRows]:
        """The staged rows (blocks until the stager has gathered them); the wait is counted by the loader.

        Raises:
            SetupError: the loader was stopped before the rows were gathered (the batch is from a finished
                iteration).
        """
        if self.staged is None:
            return None
        t0 = time.perf_counter()
        loader = self.loader
        if (
            loader is not None
            and self.plan is not None
            and not self.staged.done()
            and loader.may_gather_here
            and self.staged.cancel()
        ):
            # The stager has not started these rows (it is behind, or not scheduled): gather them here rather
            # than wait for it. Every write-back they could depend on has landed (plan t - 1 is applied).
            rows = stage_rows(self.plan, loader.target.stores)
            loader.stats_wait_s += time.perf_counter() - t0
            loader.stats_gathered_here += 1
            return rows
        try:
            rows = self.staged.result()
        except CancelledError:
            raise SetupError(
                f"the staged rows of step {self.plan.step if self.plan else '?'} were cancelled: the lookahead "
                "loader that produced this batch has been stopped"
            ) from None
        if self.loader is not None:
            self.loader.stats_wait_s += time.perf_counter() - t0
        return rows

    def mark_started(self) -> None:
        """Call before waiting for the staged rows. With several ranks, this rank finishing step ``t - 1``
        (whose backward collectives wait for every rank) proves that every rank applied plan ``t - 1``, so
        its write-backs have landed in the shared store."""
        if self.loader is not None and self.plan is not None and self.loader.target.num_ranks > 1:
            self.loader.mark_applied(self.plan.step - 1)

    def mark_applied(self) -> None:
        """Call after applying the plan: on one rank, its write-backs have landed."""
        if self.loader is not None and self.plan is not None and self.loader.target.num_ranks == 1:
            self.loader.mark_applied(self.plan.step)


@dataclass(frozen=True)
class CacheTarget:
    """What the oracle and stager need to know about the model's cached tables.

    Attributes:
        capacity: cache rows per cached table.
        feature_to_table: feature -> table, for every cached table's features.
        num_embeddings: rows per cached table.
        stores: host store per cached table.
        num_ranks: data-parallel ranks (LRPP when > 1: every rank plans the global batch).
        rank: this rank.
        group: process group on which the planner thread gathers the other ranks' ids.
        average_every: cDLRM mode's averaging period λ (``None``: exact LRPP).
    """

    capacity: Mapping[str, int]
    feature_to_table: Mapping[str, str]
    num_embeddings: Mapping[str, int]
    stores: Mapping[str, EmbeddingStore]
    num_ranks: int = 1
    rank: int = 0
    group: Optional[Any] = None
    average_every: Optional[int] = None


_END = object()


def single_threaded_ops() -> None:
    """Run the calling thread's torch operators on one thread (the lookahead threads call it first).

    With OpenMP, a parallel operator started from a thread other than the training thread gets a thread team of
    its own, as large as torch's intra-op setting: the planner's and stager's small operators would add that
    many spinning workers beside the training thread's team (oversubscription). ``torch.set_num_threads``
    sets the calling thread's team size and also the default that threads initialising later start from;
    the default is set back from a short-lived thread, so that only this thread changes.
    """
    default = torch.get_num_threads()
    if default == 1:
        return
    torch.set_num_threads(1)
    restore = threading.Thread(target=torch.set_num_threads, args=(default,), name="restore-num-threads")
    restore.start()
    restore.join()


def _check_nice(nice: int) -> None:
    if not 0 <= int(nice) <= 19:
        raise ConfigError(f"Expected planner_nice in [0, 19] but got {nice}")


def global_batches(
    loader: Any, gatherer: Optional[IdGatherer], stopped: Callable[[], bool] = lambda: False
) -> Iterator[Tuple[Batch, Any]]:
    """``(batch, global sparse features)`` for each batch of ``loader``: with a gatherer (several ranks), every
    rank's ids of the batch gathered in lockstep (dense features never leave the rank); without, the batch's
    own. Ends with the loader (with a gatherer: when the gathers end) or once ``stopped()``."""
    it = iter(loader)
    while not stopped():
        b = next(it, None)
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


def check_cdlrm_schedule(policy: str, window: int, average_every: Optional[int]) -> None:
    """cDLRM mode writes back rank 0's copy of an evicted row, which holds every rank's updates only right
    after an averaging: evictions must happen at averaging steps. The ``window`` policy evicts only at window
    starts, so its window must be a multiple of λ (any policy will do with λ = 1).

    Raises:
        ConfigError: the plan stream can evict between two averagings (other ranks' updates would be lost).
    """
    if average_every is None or average_every <= 1:
        return
    if policy != Policy.WINDOW.value or window % average_every != 0:
        raise ConfigError(
            f"cDLRM mode (cdlrm_average_every={average_every}) needs evictions only at averaging steps: use "
            f"LookaheadDataModule(policy='window', window=k*{average_every}) (got policy={policy!r}, window="
            f"{window}), or cdlrm_average_every=1; otherwise rows evicted between averagings would lose the "
            "other ranks' updates"
        )


def lower_thread_priority(nice: int) -> None:
    """Raise the calling thread's nice value by ``nice`` (Linux schedules threads as tasks; elsewhere, and for 0,
    nothing happens). A thread can lower its own priority without privileges, never raise it back."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + nice, 19))
    except OSError as e:  # e.g. a sandbox refusing setpriority: run at normal priority
        log.debug("could not lower the planner thread's priority: %s", e)


class _Run:
    """The queues, stop flag and threads of one iteration of a :class:`LookaheadLoader`."""

    def __init__(self, queue_depth: int, join_timeout_s: float = 30.0) -> None:
        self.out: queue.Queue[Any] = queue.Queue(maxsize=queue_depth)
        self.to_stage: queue.Queue[Any] = queue.Queue()
        self._stop = threading.Event()
        self.threads: List[threading.Thread] = []
        self.join_timeout_s = join_timeout_s
        #: the first error of the planner's or the stager's shutdown (its last collective was not joined by every
        #: rank)
        self.shutdown_error: Optional[BaseException] = None
        self._lock = threading.Lock()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def start(self, plan: Any, stage: Any) -> None:
        self.threads = [
            threading.Thread(target=plan, args=(self,), daemon=True, name="lookahead-oracle"),
            threading.Thread(target=stage, args=(self,), daemon=True, name="lookahead-stager"),
        ]
        for t in self.threads:
            t.start()

    def put(self, item: Any) -> bool:
        """Hand an item to the training thread; ``False`` once the run is stopped."""
        while not self.stopped:
            try:
                self.out.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def get(self) -> Any:
        return self.out.get()

    def shutdown_failed(self, error: BaseException) -> None:
        """Record an error of a thread's shutdown (the first one is kept)."""
        with self._lock:
            if self.shutdown_error is None:
                self.shutdown_error = error

    def stop(self) -> Optional[BaseException]:
        """Stop and join the threads; returns the first shutdown error of the planner or the stager, if any."""
        self._stop.set()
        for t in self.threads:
            if t is not threading.current_thread():
                t.join(timeout=self.join_timeout_s)
                if t.is_alive():
                    log.warning(
                        "lookahead thread %s did not stop within %g s (blocked in the wrapped loader?)",
                        t.name,
                        self.join_timeout_s,
                    )
        return self.shutdown_error


class LookaheadLoader:
    """Iterable of :class:`LookaheadBatch` es planned ahead of training (see the module docstring).

    Args:
        loader: the wrapped training loader (yields TorchRec batches).
        target: the model's cached tables.
        horizon: batches the oracle reads ahead.
        prefetch_depth: steps ahead the rows are gathered.
        policy: the oracle's policy.
        queue_depth: planned batches kept ready (bounds memory and the oracle's lead).
        on_epoch_start: called at every new iteration (the strategy flushes and empties the cache there, so
            that a fresh oracle starts from an empty cache).
        oracle_kwargs: extra :class:`~torchrec_lookahead.oracle.OracleConfig` fields (``window``, ``ways``, ...).
        stop_timeout_s: with several ranks, how long a rank that stopped training waits for the others to join
            its planner thread's last id all-gather (and, over row-sharded stores, its stager's last row gather)
            before it gives up with a :class:`~torchrec_lookahead.errors.SetupError` (a peer failed or keeps
            training).
        planner_nice: nice value of the planner thread (Linux; 0 leaves it at the process's priority), see
            :class:`LookaheadDataModule`.
        pinned: hot rows pinned in the first slots of the caches: the oracle plans the rest of each cache
            (:meth:`~torchrec_lookahead.hotcold.PinnedRows.cold_part` of every batch) and its plans are lifted
            to the whole cache. The pinned rows themselves are loaded by whoever starts the plan stream.
    """

    def __init__(
        self,
        loader: Any,
        target: CacheTarget,
        horizon: int,
        prefetch_depth: int,
        policy: str,
        queue_depth: int = 8,
        on_epoch_start: Optional[Any] = None,
        oracle_kwargs: Optional[Dict[str, Any]] = None,
        stop_timeout_s: float = 60.0,
        planner_nice: int = 19,
        pinned: Optional[PinnedRows] = None,
    ) -> None:
        if not stop_timeout_s > 0:
            raise ConfigError(f"Expected stop_timeout_s > 0 but got {stop_timeout_s}")
        _check_nice(planner_nice)
        self.planner_nice = int(planner_nice)
        self.loader = loader
        self.stop_timeout_s = float(stop_timeout_s)
        self.target = target
        self.pinned = pinned
        self._oracle_kwargs: Dict[str, Any] = dict(
            capacity=dict(target.capacity) if pinned is None else pinned.dynamic_capacity(),
            horizon=horizon,
            prefetch_depth=prefetch_depth,
            policy=policy,
            num_embeddings=dict(target.num_embeddings),
            **(oracle_kwargs or {}),
        )
        if target.num_ranks > 1:
            self._oracle_kwargs["num_ranks"] = target.num_ranks
        # Validate the arguments here, in the training thread; the planner thread builds the oracle per
        # iteration, once it has seen the batches' feature names.
        OracleConfig(feature_to_table=dict(target.feature_to_table), **self._oracle_kwargs)
        self.prefetch_depth = prefetch_depth
        self.queue_depth = max(queue_depth, prefetch_depth + 2)
        self.on_epoch_start = on_epoch_start
        self._yielded = 0
        self._resume_from = 0
        self._applied = -1
        self._planned = -1
        self._cond = threading.Condition()
        self._run: Optional[_Run] = None
        self._stop_error: Optional[BaseException] = None
        self.stats_wait_s = 0.0
        #: seconds the training thread waited for the planner's next batch (the planner was behind)
        self.stats_batch_wait_s = 0.0
        #: CPU seconds of the planner thread (reading the wrapped loader, planning, remapping) and batches planned
        self.stats_planner_cpu_s = 0.0
        self.stats_planned = 0
        #: CPU seconds of the stager thread (gathering rows) and plans staged
        self.stats_stager_cpu_s = 0.0
        self.stats_staged = 0
        #: steps whose rows the training thread gathered itself because the stager had not started them
        self.stats_gathered_here = 0
        #: the training thread may gather a step's rows itself (not when gathers are collectives, which run
        #: in lockstep on the stager's own process group)
        self.may_gather_here = not any(s.collective for s in target.stores.values())

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
    def mark_applied(self, step: int) -> None:
        with self._cond:
            self._applied = max(self._applied, step)
            self._cond.notify_all()

    def oracle_lead(self) -> int:
        """Batches planned but not yet applied."""
        return max(self._planned - self._applied, 0)

    def stats(self) -> Dict[str, float]:
        """The cumulative ``stats_*`` counters (waits and CPU seconds, counts), by attribute name."""
        return {k: float(v) for k, v in vars(self).items() if k.startswith("stats_")}

    # ------------------------------------------------------------------------------------------ iteration
    def close(self) -> None:
        """Stop the background threads of the current iteration (the strategy or DataModule calls it when
        training stops before the epoch ends; a new iteration starts fresh threads).

        Raises:
            SetupError: with several ranks, the planner thread's last id all-gather (or the stager's last row
                gather over row-sharded stores) was not joined by every rank within ``stop_timeout_s`` (raised unless another exception is being handled, in which case it
                is logged).
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
            log.error("%s", err)
            self._stop_error = err

    def __iter__(self) -> Iterator[LookaheadBatch]:
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
            self.loader.load_state_dict({"batches_yielded": start})
        if self.on_epoch_start is not None:
            self.on_epoch_start()
        self._yielded = start
        self._applied = -1
        self._planned = -1
        run = _Run(self.queue_depth, join_timeout_s=self.stop_timeout_s + 30.0)
        self._run = run
        run.start(self._plan, self._stage)
        try:
            while True:
                t0 = time.perf_counter()
                item = run.get()
                self.stats_batch_wait_s += time.perf_counter() - t0
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                self._yielded += 1
                yield item
        finally:
            self._stopped(run)
            if self._run is run:
                self._run = None

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
        batches: queue.Queue[Batch] = queue.Queue()
        multi = gatherer is not None

        def sparse() -> Iterator[Any]:
            for b, global_kjt in global_batches(self.loader, gatherer, lambda: run.stopped):
                batches.put(b)
                yield global_kjt

        stream = sparse()
        first = next(stream, None)
        if first is None:
            return
        # Features of tables the cache does not plan (other modules' features too) are ignored.
        f2t = {k: self.target.feature_to_table.get(k, f"__unplanned__/{k}") for k in first.keys()}
        oracle = LookaheadOracle(OracleConfig(feature_to_table=f2t, **self._oracle_kwargs))
        cached = sorted(self.target.capacity)
        f2t_cached = dict(self.target.feature_to_table)
        tracker = LRPPTracker(self.target.capacity, self.target.num_ranks) if multi else None
        globals_: queue.Queue[Any] = queue.Queue()

        pinned = self.pinned

        def record() -> Iterator[Any]:
            for kjt in itertools.chain([first], stream):
                globals_.put(kjt)
                yield kjt if pinned is None else pinned.cold_part(kjt)

        cpu = time.thread_time()
        for plan in oracle.plan_stream(record()):
            b = batches.get()
            global_kjt = globals_.get()
            if pinned is not None:
                plan = pinned.lift(plan, global_kjt)
            fut: Future[StagedRows] = Future()
            run.to_stage.put((plan, fut))
            kjt = remap_kjt(global_kjt, plan, f2t_cached, cached)
            lrpp = None
            if tracker is not None:
                lrpp = tracker.step(plan, table_ids(global_kjt, f2t_cached, cached), features=kjt)
                stride = b.sparse_features.stride()
                kjt = slice_samples(kjt, self.target.rank * stride, (self.target.rank + 1) * stride)
            item = LookaheadBatch(
                b.dense_features, kjt, b.labels, plan=plan, staged=fut, loader=self, lrpp=lrpp
            )
            self._planned = plan.step
            now = time.thread_time()
            self.stats_planner_cpu_s += now - cpu
            self.stats_planned += 1
            cpu = now
            if not run.put(item):
                return

    def _stage_gathers(self, run: _Run) -> Optional[StageGathers]:
        """Lockstep for the stager's gathers when they are collectives (a row-sharded store over several ranks):
        they run on the stores' :data:`STAGE_CHANNEL` group, the status exchanges too."""
        for store in self.target.stores.values():
            if not store.collective:
                continue
            inner = getattr(store, "inner", store)
            group = inner.channel_group(STAGE_CHANNEL) if hasattr(inner, "channel_group") else None
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
                need = plan.step - self.prefetch_depth - 1
                with self._cond:
                    while self._applied < need and not run.stopped:
                        self._cond.wait(timeout=0.05)
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
                    with collective_channel(STAGE_CHANNEL, wait):
                        rows = stage_rows(plan, self.target.stores)
                    self.stats_stager_cpu_s += time.thread_time() - cpu
                    self.stats_staged += 1
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
    def state_dict(self) -> Dict[str, int]:
        """Batches handed out in the current epoch (the oracle restarts from an empty cache on resume)."""
        return {"batches_yielded": self._yielded}

    def load_state_dict(self, state_dict: Dict[str, int]) -> None:
        if "batches_yielded" not in state_dict:
            raise CheckpointError(f"Loader state {state_dict} has no 'batches_yielded'")
        self._resume_from = int(state_dict["batches_yielded"])


def scan_epoch(
    inner: Any, target: CacheTarget, prefetch_depth: int, stop_timeout_s: float = 60.0
) -> Dict[str, int]:
    """Read one epoch of ``inner`` (a loader of TorchRec batches) and check every window and id against the cache
    before training (:func:`~torchrec_lookahead.data.capacity.check_stream`; with several ranks over the
    global batches, gathered in lockstep). Random states, the loader's generators included, are restored.

    Returns:
        The largest window working set per cached table.

    Raises:
        CapacityError, InvalidIdError: see :func:`~torchrec_lookahead.data.capacity.check_stream`.
        SetupError: another rank failed during its scan.
    """

    def sparse() -> Generator[Any, None, None]:
        if target.num_ranks == 1:
            yield from (kjt for _, kjt in global_batches(inner, None))
            return
        # Every rank plans the global batch: the same lockstep gathers as the planner thread's. A rank that
        # fails (its loader raises, a check fails) tells the others, which then fail too instead of waiting.
        failed = False
        gatherer = IdGatherer(target.num_ranks, target.group, lambda: failed, stop_timeout_s)
        try:
            yield from (kjt for _, kjt in global_batches(inner, gatherer))
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

    stream = sparse()
    try:
        with preserved_rng(inner):
            need = check_stream(
                stream,
                target.capacity,
                target.feature_to_table,
                target.num_embeddings,
                prefetch_depth,
            )
    finally:
        stream.close()
    return need


class _ColdParts:
    """Batches of ``loader`` without their pinned (hot) ids: what the oracle plans (for the capacity check)."""

    def __init__(self, loader: Any, pinned: PinnedRows) -> None:
        self.loader = loader
        self.pinned = pinned

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Batch]:
        for b in self.loader:
            yield Batch(b.dense_features, self.pinned.cold_part(b.sparse_features), b.labels)


class LookaheadDataModule(WrappedDataModule):
    """Wrap a DataModule of TorchRec batches so that the model's cached tables are planned ahead.

    Args:
        datamodule: any DataModule whose loaders yield :class:`~torchrec.datasets.utils.Batch` es.
        horizon: batches the oracle reads ahead.
        prefetch_depth: steps ahead the fetched rows are gathered (must not exceed ``horizon``).
        policy: ``belady`` (default), ``ttl``, ``window`` or ``lru``.
        queue_depth: planned batches kept ready.
        window: batches per window of the ``window`` policy.
        ways: associativity of the ``window`` policy.
        capacity_check: ``"epoch"`` (default): before training, read the epoch's sparse features once and
            raise :class:`~torchrec_lookahead.errors.CapacityError` / :class:`~torchrec_lookahead.errors.InvalidIdError`
            if any window does not fit its cache or an id is out of range (costs one pass over the training
            data; torch's, numpy's and Python's random states are restored, so a shuffling loader keeps its
            order). ``"lookahead"``: no pre-scan; such errors surface when the oracle (``horizon`` batches ahead of
            training) reaches the window, possibly mid-training, after a flush. Loaders without ``len()`` and
            the ``window`` policy (set-associative: its own placement rules) are planned with ``"lookahead"``.
        stop_timeout_s: with several ranks, how long a rank that stopped training waits for the others to join
            the planner's last id all-gather (and the stager's last row gather over row-sharded stores) before
            it gives up with a typed error (a peer failed).
        planner_nice: how much lower the planner thread runs than training (Linux nice value, 0 to 19;
            default 19, 0 leaves it alone). The planner reads and plans batches ahead, so it only has to keep
            up on average; at lower priority it takes the CPU time training leaves, instead of preempting
            the training thread or its OpenMP workers in the middle of a parallel operator, which made cached
            steps on 2 cores 1.23-1.28x resident ones instead of 1.04-1.11x.

    Example:
        >>> from torchrec_lookahead.data import CriteoSyntheticDataModule
        >>> dm = LookaheadDataModule(CriteoSyntheticDataModule(batch_size=8, num_train_batches=2), horizon=16)
        >>> dm.num_dense_features
        13
    """

    def __init__(
        self,
        datamodule: pl.LightningDataModule,
        horizon: int = 64,
        prefetch_depth: int = 1,
        policy: str = "belady",
        queue_depth: int = 8,
        window: Optional[int] = None,
        ways: Optional[int] = None,
        capacity_check: str = "epoch",
        stop_timeout_s: float = 60.0,
        planner_nice: int = 19,
    ) -> None:
        super().__init__(datamodule)
        _check_nice(planner_nice)
        self.planner_nice = int(planner_nice)
        if capacity_check not in ("epoch", "lookahead"):
            raise ConfigError(f"Expected capacity_check 'epoch' or 'lookahead' but got {capacity_check!r}")
        if not stop_timeout_s > 0:
            raise ConfigError(f"Expected stop_timeout_s > 0 but got {stop_timeout_s}")
        self.stop_timeout_s = float(stop_timeout_s)
        if horizon < 1:
            raise ConfigError(f"Expected horizon >= 1 but got {horizon}")
        if prefetch_depth < 0 or prefetch_depth > horizon:
            raise ConfigError(
                f"Expected 0 <= prefetch_depth <= horizon but got prefetch_depth={prefetch_depth}, "
                f"horizon={horizon}; raise horizon or lower prefetch_depth"
            )
        try:
            Policy(policy)
        except ValueError:
            raise ConfigError(f"Expected policy in {[p.value for p in Policy]} but got {policy!r}") from None
        self.horizon = horizon
        self.prefetch_depth = prefetch_depth
        self.policy = policy
        self.queue_depth = queue_depth
        self.oracle_kwargs: Dict[str, Any] = {}
        if window is not None:
            self.oracle_kwargs["window"] = window
        if ways is not None:
            self.oracle_kwargs["ways"] = ways
        self.capacity_check = capacity_check
        self.loader: Optional[Any] = None  # a LookaheadLoader, or a HotColdLookaheadLoader around one

    @override
    def teardown(self, stage: str) -> None:
        if self.loader is not None:
            self.loader.close()
        super().teardown(stage)

    def _target(self) -> Optional[CacheTarget]:
        trainer = self.trainer
        strategy = getattr(trainer, "strategy", None)
        if strategy is None or not hasattr(strategy, "cache_target"):
            return None
        return strategy.cache_target()  # type: ignore[no-any-return]

    @override
    def train_dataloader(self) -> Any:
        from torchrec_lookahead.hotcold.datamodule import HotColdLoader  # hotcold/ imports data/'s wrapper

        inner = self.datamodule.train_dataloader()
        target = self._target()
        if isinstance(inner, HotColdLoader) and target is not None and target.capacity:
            return self._hotcold_loader(inner, target)
        if target is not None and target.capacity and self.trainer is not None:
            inner = split_for_ranks(self.trainer, inner)
        if target is None or not target.capacity:
            rank_zero_warn(
                "LookaheadDataModule: the model has no cached tables; batches pass through unplanned"
            )
            return inner
        window = int(self.oracle_kwargs.get("window", OracleConfig.__dataclass_fields__["window"].default))
        check_cdlrm_schedule(self.policy, window, target.average_every)
        if self.loader is not None:  # a reload: the previous loader's threads must not outlive it
            self.loader.close()
        self._check_epoch(inner, target)
        self.loader = self._lookahead(inner, target)
        return self.loader

    def _lookahead(
        self, inner: Any, target: CacheTarget, pinned: Optional[PinnedRows] = None
    ) -> LookaheadLoader:
        strategy = self.trainer.strategy if self.trainer is not None else None
        return LookaheadLoader(
            inner,
            target,
            self.horizon,
            self.prefetch_depth,
            self.policy,
            self.queue_depth,
            on_epoch_start=None if pinned is not None else getattr(strategy, "reset_caches", None),
            oracle_kwargs=self.oracle_kwargs,
            stop_timeout_s=self.stop_timeout_s,
            planner_nice=self.planner_nice,
            pinned=pinned,
        )

    def _hotcold_loader(self, inner: Any, target: CacheTarget) -> Any:
        """FAE with pinned hot rows: hot batches read pinned slots, the oracle plans the cold batches alone."""
        from torchrec_lookahead.data.hotcold_lookahead import ColdBatches, HotColdLookaheadLoader

        if target.num_ranks > 1:
            raise ConfigError(
                "Pinned hot rows (a HotColdDataModule inside a LookaheadDataModule over cached tables) train on one "
                f"rank; this run has {target.num_ranks}. Train FAE with resident tables on several ranks (drop the "
                "LookaheadDataModule), or run on one rank"
            )
        if self.policy == Policy.WINDOW.value:
            raise ConfigError("Pinned hot rows need a fixed-slot policy (belady, ttl or lru), not 'window'")
        hot_set = getattr(self.datamodule, "hot_set", None)
        if hot_set is None:
            raise SetupError("The hot/cold DataModule has no hot set; call its setup('fit') first")
        pinned = PinnedRows(
            {name: table.hot_ids for name, table in hot_set.tables.items()},
            target.feature_to_table,
            target.capacity,
            target.num_embeddings,
        )
        rank_zero_info("Pinned hot rows in the lookahead cache:\n  " + "\n  ".join(pinned.summary()))
        if self.loader is not None:
            self.loader.close()
        if self.capacity_check == "epoch":
            t0 = time.perf_counter()
            dynamic = dataclasses.replace(target, capacity=pinned.dynamic_capacity())
            need = scan_epoch(_ColdParts(ColdBatches(inner.stream), pinned), dynamic, self.prefetch_depth)
            rank_zero_info(
                f"Lookahead capacity check of the cold batches: {time.perf_counter() - t0:.1f} s; the largest "
                f"windows need {need} dynamic cache rows"
            )
        strategy = self.trainer.strategy if self.trainer is not None else None
        self.loader = HotColdLookaheadLoader(
            inner, pinned, target, self._lookahead, on_epoch_start=getattr(strategy, "reset_caches", None)
        )
        return self.loader

    def _check_epoch(self, inner: Any, target: CacheTarget) -> None:
        """``capacity_check="epoch"``: fail before training if a window of the epoch does not fit (contract 2)."""
        if self.capacity_check != "epoch" or self.policy == Policy.WINDOW.value:
            return
        try:
            len(inner)
        except TypeError:
            rank_zero_warn(
                "LookaheadDataModule: the training loader has no len(), so its windows are checked as the oracle "
                "reaches them (capacity_check='lookahead')"
            )
            return

        t0 = time.perf_counter()
        need = scan_epoch(inner, target, self.prefetch_depth, self.stop_timeout_s)
        rank_zero_info(
            f"Lookahead capacity check: {len(inner)} batches read ahead in {time.perf_counter() - t0:.1f} s; "
            f"the largest windows need {need} cache rows"
        )
