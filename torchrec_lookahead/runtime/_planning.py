"""The planner thread's work on one batch (:class:`StepPlanner`): the oracle's plan (lifted over pinned rows),
the stores' read and use hints, the ids remapped to cache slots and, with several ranks, the step's LRPP plan (with
the id part of each kernel's backward exchange, :meth:`~torchrec_lookahead.distributed.lrpp.LRPPPlan.with_exchanges`)
and this rank's slice of the global batch. :meth:`LookaheadLoader._plan_stream
<torchrec_lookahead.runtime.LookaheadLoader>` drives it, one batch read and planned after the other.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional, Tuple

from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.distributed.lrpp import LRPPTracker, slice_samples
from torchrec_lookahead.modules import PreparedPlan, remap_kjt
from torchrec_lookahead.modules.types import StagedRows
from torchrec_lookahead.oracle import BatchPlan, LookaheadOracle, OracleConfig, UnknownFeatures, table_ids
from torchrec_lookahead.runtime._host_windows import HostWindowCheck
from torchrec_lookahead.runtime.batch import LookaheadBatch
from torchrec_lookahead.runtime.target import CacheTarget
from torchrec_lookahead.runtime.types import PinnedPart

__all__ = ["StepPlanner"]


class StepPlanner:
    """One plan stream's oracle, LRPP tracker and the work done on each of its batches.

    Args:
        target: the cached tables.
        oracle_fields: the :class:`~torchrec_lookahead.oracle.OracleConfig` arguments (capacity, horizon,
            policy, ...); features of tables the cache does not plan are ignored.
        pinned: rows pinned in the caches for the whole stream (the oracle plans the rest).
        prepare: builds each cached collection's moves of a plan (``CacheSession.prepare``), here rather than on
            the training thread; ``None``: the collections build them when they apply the plan.
        pin_memory: put each planned batch in pinned memory (a CUDA cache: the training thread copies it to the
            device without waiting for the copy).
    """

    def __init__(
        self,
        target: CacheTarget,
        oracle_fields: Dict[str, Any],
        pinned: Optional[PinnedPart],
        prepare: Optional[Callable[[BatchPlan], Tuple[PreparedPlan, ...]]] = None,
        pin_memory: bool = False,
    ) -> None:
        self.target = target
        self._prepare = prepare
        self._pin = pin_memory
        self.pinned = pinned
        self.oracle = LookaheadOracle(
            OracleConfig(
                feature_to_table=dict(target.feature_to_table),
                unknown_features=UnknownFeatures.IGNORE,
                **oracle_fields,
            )
        )
        self._cached = sorted(target.capacity)
        self._f2t = dict(target.feature_to_table)
        # with rows pinned the check sees each batch's cold part, in the table's own ids (hot ids never pass
        # through the host tier: they are simply absent)
        self._host = HostWindowCheck(dict(target.host_windows or {}))
        # the stores that rank their rows by the ids each batch looks up (a disk store's lookahead host policy)
        self._use_stores = {n: s for n, s in target.stores.items() if n in target.capacity and s.uses_hints}
        self._fed = 0  # batches given to the oracle: the step of the next one
        self._tracker: Optional[LRPPTracker] = None
        if target.num_ranks > 1:
            self._tracker = LRPPTracker(
                target.cache_rows(), target.num_ranks, pinned=None if pinned is None else pinned.pinned_slots
            )

    def feed(self, global_kjt: KeyedJaggedTensor) -> List[BatchPlan]:
        """Give the oracle the next batch (its part outside the pinned rows); returns the plans now ready. The
        stores that rank their rows by it are told which ids the batch looks up (the horizon before its plan).

        Raises:
            CapacityError: a window ending at this batch does not fit a device cache (the oracle's check) or the
                host tier of a disk store (``tier="host"``), ``horizon`` batches before it is trained.
        """
        kjt = global_kjt if self.pinned is None else self.pinned.cold_part(global_kjt)
        plans = self.oracle.feed(kjt)  # checks the ids and the device caches first
        step, self._fed = self._fed, self._fed + 1
        tables = sorted(set(self._host.tables) | set(self._use_stores))
        if tables:
            ids = table_ids(kjt, self._f2t, tables, unknown=UnknownFeatures.IGNORE)
            if self._host:
                short = self._host.push({t: ids[t].numpy() for t in self._host.tables})
                if short:
                    raise short[0].error()
            for name, store in self._use_stores.items():
                if ids[name].numel():
                    store.plan_uses(step, ids[name])
        return plans

    def finish(self) -> List[BatchPlan]:
        """The stream ended: the plans of the batches still in the oracle's window."""
        return self.oracle.finish()

    def whole_plan(self, plan: BatchPlan, global_kjt: KeyedJaggedTensor) -> BatchPlan:
        """``plan`` as a plan of the whole cache (lifted over the pinned rows), with every store told which rows
        the step gathers (a disk store reads them ahead)."""
        if self.pinned is not None:
            plan = self.pinned.lift(plan, global_kjt)
        for name, table_plan in plan.tables.items():
            store = self.target.stores.get(name)
            if store is not None and table_plan.fetch_ids.numel():
                store.plan_reads(plan.step, table_plan.fetch_ids)
        return plan

    def batch(
        self, plan: BatchPlan, b: Batch, global_kjt: KeyedJaggedTensor, staged: Future[StagedRows]
    ) -> LookaheadBatch:
        """Batch ``b`` planned: its cached ids remapped to slots by ``plan`` (with several ranks, from the global
        batch, with the step's LRPP plan and its exchange indices, then this rank's slice), with the future of
        its staged rows and the collections' moves of the plan."""
        kjt = remap_kjt(global_kjt, plan, self._f2t, self._cached)
        lrpp = None
        if self._tracker is not None:
            ids = table_ids(global_kjt, self._f2t, self._cached, unknown=UnknownFeatures.IGNORE)
            # the id part of the backward's gradient exchange too, here rather than on the training thread
            lrpp = self._tracker.step(plan, ids, features=kjt).with_exchanges(
                self.target.exchanges, self.target.rank, self.target.num_ranks
            )
            stride = b.sparse_features.stride()
            kjt = slice_samples(kjt, self.target.rank * stride, (self.target.rank + 1) * stride)
        adapted = isinstance(b, LookaheadBatch)
        dense, labels = b.dense_features, b.labels
        if self._pin:
            dense, kjt, labels = dense.pin_memory(), kjt.pin_memory(), labels.pin_memory()
        return LookaheadBatch(
            dense,
            kjt,
            labels,
            plan=plan,
            staged=staged,
            lrpp=lrpp,
            source=b.source if adapted else None,
            adapter=b.adapter if adapted else None,
            prepared=None if self._prepare is None else self._prepare(plan),
        )
