"""FAE inside the lookahead cache: hot batches read pinned rows, the oracle plans the cold stream only.

:class:`HotColdLookaheadLoader` is what :class:`~torchrec_lookahead.data.LookaheadDataModule` serves when it
wraps a :class:`~torchrec_lookahead.fae.HotColdDataModule` and the model has cached tables::

    training order  <- HotColdStream (the scheduler's requests choose hot or cold at run time)
      hot batch j   -> ids mapped to pinned slots (PinnedRows.hot_plan): no plan ahead, no staging, no store
      cold batch j  -> the j-th batch of a LookaheadLoader over the cold batches alone, read on their own:
                       its oracle plans cold_part(batch) in the dynamic slots, its plans are lifted to the
                       whole cache, its stager gathers their rows ahead, as for any cached job

The cold batches' contents are fixed by the data alone (the scheduler only chooses the interleaving), so the
planner reads them ahead without knowing the scheduler's future decisions, and a decision never invalidates a
plan. The first batch of every plan stream (epoch start, resume) carries the pin plan, which loads the hot
rows into their slots after the strategy has emptied the cache. Every cold batch is checked against the one
the training order holds (same labels and ids), so a loader that does not give the same batches when read
twice fails with a typed error instead of training on the wrong plan.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any, Callable, Dict, Iterator, Mapping, Optional

import torch
from torchrec.datasets.utils import Batch

from torchrec_lookahead.distributed.lockstep import IdGatherer
from torchrec_lookahead.distributed.lrpp import LRPPPlan, LRPPTablePlan, LRPPTracker, slice_samples
from torchrec_lookahead.errors import CapacityError, CheckpointError, ConfigError, DataError, SetupError
from torchrec_lookahead.fae.hotset import HotSet
from torchrec_lookahead.fae.loader import HotColdLoader
from torchrec_lookahead.fae.pinned import PinnedRows
from torchrec_lookahead.fae.samples import Samples
from torchrec_lookahead.fae.shared_read import SharedRead
from torchrec_lookahead.fae.stream import BatchKind, HotColdStream
from torchrec_lookahead.modules import remap_kjt
from torchrec_lookahead.oracle import Policy
from torchrec_lookahead.oracle.types import BatchPlan
from torchrec_lookahead.runtime import (
    CacheSession,
    CapacityCheck,
    LoaderStats,
    LookaheadBatch,
    prescan,
)
from torchrec_lookahead.runtime.report import need_lines, report_text, scan_progress, sigterm_pending
from torchrec_lookahead.runtime.types import LookaheadFactory, PinnedLoaderOptions

__all__ = ["ColdBatches", "HotColdLookaheadLoader", "pinned_lookahead_loader"]


class ColdBatches:
    """The cold batches of a hot/cold stream, in order, read on their own (a second pass over the source).

    Args:
        stream: the training order's stream (its source, hot masks, batch size, window and length are used).

    Example:
        >>> from torchrec import KeyedJaggedTensor
        >>> ones = torch.ones(4, dtype=torch.int32)
        >>> batches = [Batch(torch.zeros(4, 1), KeyedJaggedTensor(["a"], torch.tensor([i, 2, 3, 0]), lengths=ones),
        ...                  torch.zeros(4)) for i in range(3)]
        >>> src = lambda: iter(batches)
        >>> s = HotColdStream(src, {"a": torch.tensor([True, True, False, False])}, 2, 4, num_samples=(5, 12))
        >>> [b.sparse_features.values().tolist() for b in ColdBatches(s)]
        [[2, 3], [2, 3], [2, 2], [3, 0]]
    """

    def __init__(self, stream: HotColdStream) -> None:
        self.stream = stream
        #: where the next iteration reads the source batches (``None``: the stream's own source)
        self.source: Optional[Callable[[], Iterator[Batch]]] = None
        self._resume = 0
        self._lockstep: Optional[IdGatherer] = None

    def join_lockstep(self, gatherer: IdGatherer) -> None:
        """Gather the ranks' source slices of the next iteration through ``gatherer`` (the lookahead planner's
        lockstep, on its thread and process group) instead of the stream's own gather on the default group,
        which the training thread uses at the same time."""
        self._lockstep = gatherer

    def __len__(self) -> int:
        return self.stream.batches_per_epoch()[BatchKind.COLD]

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Start the next iteration after ``state_dict["batches_yielded"]`` cold batches."""
        if "batches_yielded" not in state_dict:
            raise CheckpointError(f"Cold batch state {dict(state_dict)} has no 'batches_yielded'")
        self._resume = int(state_dict["batches_yielded"])

    def __iter__(self) -> Iterator[Batch]:
        main = self.stream
        cold = HotColdStream(
            self.source or main.source,
            main.masks,
            main.batch_size,
            window=main.window,
            num_samples=main.num_samples,
            rank=main.rank,
            world_size=main.world_size,
            gather=main.gather if self._lockstep is None else self._lockstep_gather(self._lockstep),
        )
        if self._resume:
            cold.load_state_dict({"hot_served": 0, "cold_served": self._resume})
            self._resume = 0
        cold.request(BatchKind.COLD)
        for kind, batch in cold:
            if kind is BatchKind.COLD:
                yield batch

    @staticmethod
    def _lockstep_gather(gatherer: IdGatherer) -> Callable[[Samples], Optional[Samples]]:
        def gather(s: Samples) -> Optional[Samples]:
            parts = gatherer.gather_object(s.tensors())
            return None if parts is None else s.joined(parts)

        return gather


def _same_batch(a: Batch, b: Batch) -> bool:
    return torch.equal(a.labels, b.labels) and torch.equal(
        a.sparse_features.lengths(), b.sparse_features.lengths()
    )


class HotColdLookaheadLoader:
    """Training loader of FAE with pinned hot rows and a lookahead cache for the cold rows (module docstring).

    It stands in for the :class:`~torchrec_lookahead.fae.HotColdLoader` it wraps: ``request``,
    ``last_kind``, ``remaining`` and ``batches_per_epoch`` (the scheduler's interface), ``len`` and the
    mid-epoch state are that loader's.

    Args:
        hotcold: the hot/cold DataModule's training loader.
        pinned: the hot rows pinned in the caches.
        session: the cached job's session: it applies the batches, and every iteration starts a new plan
            stream on it (the pinned rows load with its first batch).
        lookahead: builds the :class:`~torchrec_lookahead.runtime.LookaheadLoader` of the cold batches from a
            loader, the session and the pinned rows (the DataModule passes its horizon, depth and policy).
    """

    def __init__(
        self,
        hotcold: HotColdLoader,
        pinned: PinnedRows,
        session: CacheSession,
        lookahead: LookaheadFactory,
    ) -> None:
        self.hotcold = hotcold
        self.pinned = pinned
        self.session = session
        self.target = target = session.target
        self.cold_batches = ColdBatches(hotcold.stream)
        self.cold = lookahead(self.cold_batches, session, pinned)
        self._cached = sorted(target.capacity)
        self._f2t = dict(target.feature_to_table)
        #: the current (or last) iteration's read of the source, shared by the planner and training
        self.shared_read: Optional[SharedRead[Batch]] = None

    # the scheduler's and Lightning's view: the hot/cold loader's
    def __len__(self) -> int:
        return len(self.hotcold)

    def request(self, kind: Optional[BatchKind]) -> None:
        """Serve ``kind`` next when the window allows (``None``: stream order)."""
        self.hotcold.request(kind)

    @property
    def last_kind(self) -> Optional[BatchKind]:
        """The kind of the batch handed out last."""
        return self.hotcold.last_kind

    def remaining(self) -> Dict[BatchKind, int]:
        """Batches of each kind still to come this epoch."""
        return self.hotcold.remaining()

    def batches_per_epoch(self) -> Dict[BatchKind, int]:
        """Hot and cold batches per epoch."""
        return self.hotcold.batches_per_epoch()

    def stats(self) -> LoaderStats:
        """The cold lookahead loader's counters (the hot batches applied are the session's:
        :meth:`CacheSession.stats <torchrec_lookahead.runtime.CacheSession.stats>`)."""
        return self.cold.stats()

    def oracle_lead(self) -> int:
        """Cold batches planned but not yet applied."""
        return self.cold.oracle_lead()

    def state_dict(self) -> Dict[str, int]:
        return self.hotcold.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.hotcold.load_state_dict(state_dict)
        self.cold.load_state_dict({"batches_yielded": int(state_dict["cold_served"])})

    def close(self) -> None:
        """Stop the cold loader's background threads."""
        self.cold.close()

    def _hot(self, batch: Batch, step: int, writers: Mapping[str, torch.Tensor]) -> LookaheadBatch:
        if self.target.num_ranks == 1:
            plan = self.pinned.hot_plan(batch.sparse_features, step)
            kjt = remap_kjt(batch.sparse_features, plan, self._f2t, self._cached)
            return LookaheadBatch(batch.dense_features, kjt, batch.labels, plan=plan)
        # Several ranks: every rank holds every pinned row, so each updates every row the global batch reads,
        # from every bag that reads it (LRPPPlan.pinned); the plan moves nothing, and no slot's replicas change.
        whole = self.hotcold.stream.last_global
        if whole is None:
            raise SetupError("the hot/cold stream handed out a batch without its global batch")
        whole_kjt = whole.batch().sparse_features
        plan = self.pinned.hot_plan(whole_kjt, step)
        glob = remap_kjt(whole_kjt, plan, self._f2t, self._cached)
        stride = batch.sparse_features.stride()
        rank = self.target.rank
        kjt = slice_samples(glob, rank * stride, (rank + 1) * stride)
        none = torch.zeros(0, dtype=torch.int64)
        lrpp = LRPPPlan(
            step,
            {
                t: LRPPTablePlan(
                    evict_writer=none,
                    refresh_slots=none,
                    refresh_source=none,
                    shared_slots=none,
                    writer=writers[t],
                    rows_read=0,
                )
                for t in plan.tables
            },
            glob,
            self.pinned.pinned_slots,
        )
        # the gradient exchanges' index built here, before the step (the planner builds the cold batches')
        lrpp = lrpp.with_exchanges(self.target.exchanges, rank, self.target.num_ranks)
        return LookaheadBatch(batch.dense_features, kjt, batch.labels, plan=plan, lrpp=lrpp)

    def _first_writers(self) -> Dict[str, torch.Tensor]:
        """Slot writers before the first cold plan: rank 0 for the pinned rows, nobody for the empty rest."""
        return LRPPTracker(
            self.target.cache_rows(), self.target.num_ranks, self.pinned.pinned_slots
        ).writers()

    def share_bound(self) -> int:
        """Source batches the shared read keeps at most (:class:`~torchrec_lookahead.fae.shared_read.SharedRead`):
        the regrouping window plus the planner's lead (horizon and ready queue, in cold batches) in source
        batches, at the epoch's share of cold samples, and at most eight windows."""
        stream = self.hotcold.stream
        lead = self.cold.horizon + self.cold.queue_depth + 2
        hot, total = stream.num_samples or (0, 1)
        per_cold = total / max(total - hot, 1)
        return min(stream.window + math.ceil(lead * per_cold), 8 * stream.window)

    def __iter__(self) -> Iterator[LookaheadBatch]:
        self.session.new_stream()  # the caches are empty: the pinned rows load with the first batch
        pin: Optional[BatchPlan] = self.pinned.pin_plan()
        # The planner's pass over the cold batches and the training order read the same source batches: one
        # read serves both (the planner, ahead, reads; training takes the batches it kept).
        self.shared_read = SharedRead(self.hotcold.stream.source, consumers=2, bound=self.share_bound())
        self.shared_read.start()  # here, on the training thread, as the resident stream starts its source
        cold_reader, training_reader = self.shared_read.readers()
        self.cold_batches.source = cold_reader
        cold_it = iter(self.cold)
        last_cold = -1
        writers = self._first_writers() if self.target.num_ranks > 1 else {}
        try:
            for kind, batch in self.hotcold.kinds(training_reader):
                if kind is BatchKind.COLD:
                    try:
                        item = next(cold_it, None)
                    except (
                        CapacityError
                    ) as err:  # the oracle's, of the dynamic slots: told of the whole cache
                        raise self.pinned.whole_cache_error(err) from None
                    if item is None or not _same_batch(item, batch):
                        raise DataError(
                            f"cold batch {self.hotcold.stream.served[BatchKind.COLD] - 1} of the epoch differs "
                            "between two reads of the training data; the hot/cold lookahead reads the cold batches "
                            "ahead in a second pass, so the wrapped loader must give the same batches every time "
                            "it is read in an epoch (seed its shuffling by epoch)"
                        )
                    if item.plan is not None:
                        last_cold = item.plan.step
                    if item.lrpp is not None:
                        writers.update({t: tp.writer for t, tp in item.lrpp.tables.items()})
                else:
                    with self.session.cache_code():  # the training thread's cache work, as apply's
                        item = self._hot(batch, last_cold, writers)
                if pin is not None:
                    item, pin = replace(item, pin=pin), None
                yield item
        finally:
            self.cold.close()
            self.cold_batches.source = None


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


def pinned_lookahead_loader(
    hotcold: HotColdLoader,
    hot_set: Optional[HotSet],
    session: CacheSession,
    lookahead: LookaheadFactory,
    options: PinnedLoaderOptions,
) -> HotColdLookaheadLoader:
    """FAE with pinned hot rows: hot batches read pinned slots, the oracle plans the cold batches alone.

    What :meth:`HotColdDataModule.pinned_loader <torchrec_lookahead.fae.HotColdDataModule.pinned_loader>` gives a
    :class:`~torchrec_lookahead.data.LookaheadDataModule`: refuses the options pinned rows do not support, pins
    ``hot_set`` in the caches of ``session`` (reported to ``options.trainer``), checks the cold batches' windows
    against the dynamic caches with ``capacity_check="epoch"``, and returns the loader.

    Args:
        hotcold: the hot/cold DataModule's training loader.
        hot_set: its hot set.
        session: the cached job's session.
        lookahead: builds the :class:`~torchrec_lookahead.runtime.LookaheadLoader` of the cold batches.
        options: the lookahead DataModule's options.

    Raises:
        ConfigError: a ``batch_adapter``, cDLRM averaging (``average_every``) or the ``window`` policy.
        SetupError: no hot set.
        CapacityError: a table's hot rows leave no dynamic slot, or a cold window does not fit the dynamic cache.
    """
    target = session.target

    if options.batch_adapter is not None:
        raise ConfigError(
            "Pinned hot rows (a HotColdDataModule inside a LookaheadDataModule) regroup TorchRec Batches; "
            "drop batch_adapter, or yield TorchRec Batches from the wrapped DataModule"
        )
    if target.average_every is not None:
        raise ConfigError(
            "Pinned hot rows are kept identical on every rank by their exact gradient exchange; cDLRM's "
            "periodic averaging (average_every) does not apply to them: drop average_every"
        )
    if options.policy is Policy.WINDOW:
        raise ConfigError("Pinned hot rows need a fixed-slot policy (belady, ttl or lru), not 'window'")
    if hot_set is None:
        raise SetupError("The hot/cold DataModule has no hot set; call its setup('fit') first")
    pinned = PinnedRows(
        {name: table.hot_ids for name, table in hot_set.tables.items()},
        target.feature_to_table,
        target.capacity,
        target.num_embeddings,
        target.slot_spaces,
    )
    trainer = options.trainer
    report_text(
        trainer,
        "lookahead/pinned_rows",
        "Pinned hot rows in the lookahead cache:\n  " + "\n  ".join(pinned.summary()),
    )
    if options.capacity_check is CapacityCheck.EPOCH:
        t0 = time.perf_counter()
        # the cold batches' ids, in the tables' own numbering: the host windows as they are; their windows must
        # fit in what the pinned rows leave of each cache, and the report and refusals speak of whole caches
        cold = _ColdParts(ColdBatches(hotcold.stream), pinned)
        oracle_fields = None
        if (
            options.policy is Policy.TTL and options.settings is not None
        ):  # the planner's own oracle, as it plans
            oracle_fields = dict(
                capacity=pinned.dynamic_capacity(),
                **options.settings.oracle_fields(),
                num_embeddings=dict(target.num_embeddings),
                slot_spaces=dict(target.slot_spaces),
                **({"num_ranks": target.num_ranks} if target.num_ranks > 1 else {}),
            )
        with scan_progress(trainer, "Lookahead capacity check (cold batches)", None) as tick:
            scan = prescan(
                cold,
                target,
                options.prefetch_depth,
                on_batch=tick,
                max_batches=options.capacity_check_batches,
                max_seconds=options.capacity_check_seconds,
                signalled=sigterm_pending(trainer),
                oracle_fields=oracle_fields,
                pinned=pinned.pinned_rows,
            )
        rest = (
            ""
            if scan.ended
            else "; the windows of the later cold batches are checked as the oracle plans them"
        )
        head = (
            f"Lookahead capacity check of the cold batches: {scan.batches:,} read ahead in "
            f"{time.perf_counter() - t0:.1f} s{rest}; the largest windows read need, of each cache's rows:"
        )
        lines = [head] + need_lines(scan, target, pinned.pinned_rows)
        report_text(trainer, "lookahead/capacity_check", "\n".join(lines))
    return HotColdLookaheadLoader(hotcold, pinned, session, lookahead)
