"""What the sharded modules our sharders build share: resident tables through TorchRec, cached tables through
the cache.

:class:`ShardedLookaheadCollection` replaces a TorchRec embedding collection inside
``DistributedModelParallel``. Tables planned with TorchRec's ``CUSTOMIZED_KERNEL`` compute kernel live in a
:class:`~torchrec_lookahead.modules.CachedCollection` (host store + bounded device cache); every other table is
sharded by TorchRec's own sharded collection exactly as without the plugin. It applies plans, flushes,
synchronises several ranks (LRPP, delayed sync, cDLRM) and routes each batch's features to the two parts; its
two kinds are siblings that put the parts' outputs together as the unsharded collection would return them:
:class:`~torchrec_lookahead.distributed.ShardedLookaheadEmbeddingBagCollection` (a ``KeyedTensor`` of pooled
bags) and :class:`~torchrec_lookahead.distributed.ShardedLookaheadEmbeddingCollection` (a dict of
``JaggedTensor`` s).

In training the cached features' values must already be cache slots and the step's plan applied
(:meth:`~ShardedLookaheadCollection.apply_plan`; the ``torchrec`` strategy does both for batches of a
:class:`~torchrec_lookahead.data.LookaheadDataModule`). In evaluation the values are ids: the cache is
flushed once and rows are read from the stores.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import time
from typing import Dict, Generic, List, Optional, Self, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import (
    Awaitable,
    LazyAwaitable,
    NoWait,
    NullShardedModuleContext,
    ShardedModule,
)
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.distributed._rank_sync import RankSync, StepState
from torchrec_lookahead.distributed.exact_sync import ExchangeSpec
from torchrec_lookahead.distributed.fused_optimizer import CacheFusedOptimizer, fused_optimizers
from torchrec_lookahead.distributed.lrpp import LRPPPlan
from torchrec_lookahead.errors import ConfigError, DataError, SetupError
from torchrec_lookahead.modules import CachedCollection, PreparedPlan
from torchrec_lookahead.modules.types import BackwardHook, StagedRows
from torchrec_lookahead.oracle.types import BatchPlan

__all__ = ["ShardedLookaheadCollection", "CUSTOMIZED"]

log = logging.getLogger(__name__)

CUSTOMIZED = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value

#: the kind's table config (``EmbeddingBagConfig``, ``EmbeddingConfig``) and output (``KeyedTensor``,
#: ``Dict[str, JaggedTensor]``)
_ConfigT = TypeVar("_ConfigT", bound=BaseEmbeddingConfig)
_OutT = TypeVar("_OutT")

#: seconds a flush on the exception path waits for a pending delayed all-gather (a peer may be gone)
_EXCEPTION_PATH_WAIT = 60.0


class _Ready(LazyAwaitable[_OutT]):
    """An output computed already (the cache's collections need no output distribution)."""

    def __init__(self, value: _OutT) -> None:
        super().__init__()
        self._value = value

    def _wait_impl(self) -> _OutT:
        return self._value


class ShardedLookaheadCollection(
    ShardedModule[KeyedJaggedTensor, _OutT, _OutT, NullShardedModuleContext],
    FusedOptimizerModule,
    Generic[_ConfigT, _OutT],
):
    """A TorchRec embedding collection whose large tables train through the lookahead cache: everything but
    the output, which each kind's :meth:`compute` puts together from :meth:`_part_outputs` and its
    :meth:`_eval_lookup` reads from the stores.

    Args:
        tables: every table of the unsharded collection, in its order.
        resident: TorchRec's sharded collection of the resident tables (``None`` when every table is cached).
        cache: the cached tables' collection.
        is_weighted: whether features carry per-id weights.
        rank: this rank.
        world_size: W; with W > 1 the cache is an LRPP cache (or cDLRM's with ``average_every``).
        process_group: the group of the W ranks (critical-path collectives).
        average_every: cDLRM's scheme: average the caches every this many steps instead of LRPP.
        delayed_sync: with LRPP, all-gather the gradients of shared rows that no rank reads at the next step
            in the background, on ``delayed_group``, and apply their update before the next plan (see
            docs/design.md, "Delayed synchronisation"); ``False``: every shared row on the critical path.
        delayed_group: a process group of the same ranks used only for delayed synchronisation, created
            identically on every rank (required when ``delayed_sync`` is on with W > 1 and no cDLRM).
    """

    def __init__(
        self,
        tables: Sequence[_ConfigT],
        resident: Optional[nn.Module],
        cache: CachedCollection[_ConfigT, _OutT],
        is_weighted: bool = False,
        rank: int = 0,
        world_size: int = 1,
        process_group: Optional[dist.ProcessGroup] = None,
        average_every: Optional[int] = None,
        delayed_sync: bool = True,
        delayed_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        super().__init__()
        if average_every is not None and average_every < 1:
            raise ConfigError(
                f"Expected average_every to be a positive number of steps but got {average_every}"
            )
        self.average_every = average_every
        self._tables: List[_ConfigT] = list(tables)
        self.resident = resident
        self.cache = cache
        self._is_weighted = is_weighted
        #: every feature of the collection, in its order, and its table's dimension
        self._feature_names = [f for t in self._tables for f in t.feature_names]
        self._dims = [t.embedding_dim for t in self._tables for _ in t.feature_names]
        self._cached_features = set(cache.feature_names)
        self._resident_features = [f for f in self._feature_names if f not in self._cached_features]
        self._cached_order = [f for f in self._feature_names if f in self._cached_features]
        #: the state of the current step, in one place (see StepState)
        self.step_state = StepState()
        self.rank = rank
        self.world_size = world_size
        self._pg = process_group
        self.sync_counters: Dict[str, int] = {}
        #: seconds the cache kernels' backward hooks ran (several ranks: the exact exchange and its update)
        self.backward_hook_s = 0.0
        self.delayed_sync = bool(delayed_sync) and world_size > 1 and average_every is None
        self._delayed_pg = delayed_group
        self._fused_optim: Optional[KeyedOptimizer] = None
        #: the multi-rank synchronisation (``None`` with one rank)
        self._sync: Optional[RankSync] = None
        if self.delayed_sync and delayed_group is None:
            raise SetupError(
                "delayed_sync needs a process group of its own (delayed_group), created on every rank; build the "
                "module with LookaheadEmbeddingBagCollectionSharder, or pass delayed_sync=False"
            )
        if world_size > 1:
            cache.share_stores()  # one rank writes each row: apply_plan and flush name this rank's rows
            self._sync = RankSync(
                cache,
                rank,
                world_size,
                process_group,
                delayed_group,
                average_every,
                self.delayed_sync,
                is_weighted,
                self.step_state,
                self.sync_counters,
            )
            for group in cache.kernel_groups():
                group.kernel.set_backward_hook(self._timed(self._sync.backward_hook(group)))
            self.register_state_dict_pre_hook(lambda module, prefix, keep_vars: module.flush())
            self.register_load_state_dict_pre_hook(lambda module, *args: module.land_delayed())
            self.register_load_state_dict_post_hook(lambda module, incompatible: module._barrier())

    def _timed(self, hook: BackwardHook) -> BackwardHook:
        """``hook``, its time added to :attr:`backward_hook_s`."""

        def timed(
            grad: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]
        ) -> None:
            t0 = time.perf_counter()
            try:
                hook(grad, indices, offsets, weights)
            finally:
                self.backward_hook_s += time.perf_counter() - t0

        return timed

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """The in-backward optimizers of this collection, for DistributedModelParallel's ``fused_optimizer``:
        the cache's (:class:`CacheFusedOptimizer`) and, when TorchRec's module trains resident tables beside
        the cache, its own under ``resident`` (the keys it had before)."""
        if self._fused_optim is None:
            parts: List[Tuple[str, KeyedOptimizer]] = [("", CacheFusedOptimizer(self.cache))]
            if self.resident is not None:
                parts += fused_optimizers(self.resident, "resident")
            self._fused_optim = CombinedOptimizer(parts) if len(parts) > 1 else parts[0][1]
        return self._fused_optim

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        """The group of the ranks this collection trains on (its critical-path collectives)."""
        return self._pg

    # ---------------------------------------------------------------------------------------------- plans
    @property
    def cached_tables(self) -> List[str]:
        """Names of the tables trained through the cache."""
        return sorted(self.cache.capacity)

    def apply_plan(
        self,
        plan: BatchPlan,
        staged: Optional[StagedRows] = None,
        lrpp: Optional[LRPPPlan] = None,
        trusted: bool = False,
        prepared: Optional[PreparedPlan] = None,
        defer_write_backs: bool = False,
    ) -> None:
        """Apply the cached tables' part of a step's plan (write-backs, then loads; with several ranks also
        the refresh of invalid replicas, and the gradient synchronisation of the coming backward).

        ``prepared`` (the cache's :meth:`prepare_plan` of this part, built ahead) and ``defer_write_backs`` are
        the cache's ``apply_plan`` arguments; with several ranks the write-backs are never deferred."""
        mine = {t: p for t, p in plan.tables.items() if t in self.cache.capacity}
        sub = BatchPlan(plan.step, mine)
        sub_staged = None
        if staged is not None:
            sub_staged = StagedRows(
                staged.step,
                {t: r for t, r in staged.tables.items() if t in mine},
                {s: r for s, r in staged.spaces.items() if s.split("+")[0] in mine},
            )
        if self.world_size > 1:
            if lrpp is None or lrpp.step != plan.step:
                raise SetupError(f"multi-rank step {plan.step} has no LRPP synchronisation plan")
            # this collection's tables only (a model may hold several cached collections: EBC and EC)
            lrpp = dataclasses.replace(
                lrpp, tables={t: p for t, p in lrpp.tables.items() if t in self.cache.capacity}
            )
            # The previous step's delayed rows land before this plan evicts, refreshes or loads anything.
            self.land_delayed()
            every = self.average_every
            averaging = every is not None
            if every is not None and plan.step > 0 and plan.step % every == 0:
                self._rank_sync().average()
            evict_mine: Dict[str, torch.Tensor] = {}  # the evicted rows this rank writes back
            for t, tp in mine.items():
                if averaging:  # cDLRM: replicas agree only after averaging; rank 0's copy is written back
                    evict_mine[t] = tp.evict_ids if self.rank == 0 else tp.evict_ids[:0]
                else:
                    evict_mine[t] = tp.evict_ids[lrpp.tables[t].evict_writer == self.rank]
            self.cache.apply_plan(sub, sub_staged, trusted=trusted, prepared=prepared, writes=evict_mine)
            if not averaging:
                self._rank_sync().refresh(lrpp)
            self.step_state.lrpp = lrpp
            for k, v in lrpp.counters(self.delayed_sync).items():
                self.sync_counters[k] = self.sync_counters.get(k, 0) + v
        else:
            self.cache.apply_plan(
                sub, sub_staged, trusted=trusted, prepared=prepared, defer_write_backs=defer_write_backs
            )
        self.step_state.eval_flushed = False
        self.step_state.dirty = True

    def prepare_plan(self, plan: BatchPlan) -> PreparedPlan:
        """The cache's :meth:`~torchrec_lookahead.modules.CachedEmbeddingBagCollection.prepare_plan` of its part
        of ``plan`` (safe on the planning thread)."""
        return self.cache.prepare_plan(
            BatchPlan(plan.step, {t: p for t, p in plan.tables.items() if t in self.cache.capacity})
        )

    def pin_rows(self, plan: BatchPlan) -> None:
        """Load pinned rows (a :meth:`~torchrec_lookahead.fae.PinnedRows.pin_plan`) into the emptied caches:
        every rank loads every pinned row of its cached tables; nothing is evicted or written back. With
        several ranks the stores' reads are collectives where the stores are row-sharded: every rank calls this
        at the same step (the first batch of a plan stream)."""
        mine = {t: p for t, p in plan.tables.items() if t in self.cache.capacity}
        if any(p.evict_ids.numel() for p in mine.values()):
            raise SetupError(f"the pin plan of step {plan.step} evicts rows; pin into an emptied cache")
        self.cache.apply_plan(BatchPlan(plan.step, mine))
        self.cache.consume_applied_plan()  # pinned rows are no step's plan: a forward still needs one
        self.step_state.eval_flushed = False
        self.step_state.dirty = True

    @property
    def collective_stores(self) -> bool:
        """Whether the cached tables' stores are row-sharded over the ranks (their reads and writes are
        collectives of every rank)."""
        return any(s.collective for s in self.cache.stores.values())

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self._pg)

    def flush(self, barrier: bool = True) -> None:
        """Write every cached row and its optimizer state back to the stores (with several ranks: each row once,
        by a rank holding its current value, then, with ``barrier``, a barrier so that every rank reads the
        landed rows). ``barrier=False`` is the exception path: with row-sharded stores (whose writes are
        collectives other ranks may never join) it writes nothing."""
        if self.world_size == 1:
            self.cache.flush()
            return
        # Pending delayed rows land first. On the exception path (no barrier) a peer may be gone: wait a
        # bounded time, and write back what this rank holds if the collective cannot finish.
        if barrier:
            self.land_delayed()
        else:
            try:
                self.land_delayed(timeout=_EXCEPTION_PATH_WAIT)
            except SetupError as e:
                log.error("flush on the exception path: %s", e)
        if not barrier and self.collective_stores:
            # Row-sharded stores are written with collectives, which another rank (gone, or inside another
            # collective on this exception path) may never join: keep the last checkpoint instead of hanging.
            if self.step_state.dirty and not self.step_state.unflushed_reported:
                self.step_state.unflushed_reported = True
                log.warning(
                    "not flushing the lookahead cache to its row-sharded stores on this exit path (peers may be "
                    "gone); updates since the last checkpoint are lost"
                )
            return
        if self.step_state.lrpp is not None:
            if self.average_every is not None and barrier:
                self._rank_sync().average()  # a collective: not on the exception path (barrier=False)
            held: Dict[str, torch.Tensor] = {}
            for t, tp in self.step_state.lrpp.tables.items():
                slot_ids = self.cache.slot_ids(t)
                writer = (
                    torch.zeros_like(slot_ids)
                    if self.average_every is not None
                    else tp.writer.to(torch.int64)
                )
                mine = (writer == self.rank) & (slot_ids >= 0)
                held[t] = slot_ids[mine]
            self.cache.flush(writes=held)
        self.step_state.dirty = False
        if barrier:
            self._barrier()

    def invalidate(self) -> None:
        """Empty the cache (after :meth:`flush`); the next plan stream starts from an empty cache."""
        self.land_delayed()
        self.cache.invalidate()
        self.step_state.lrpp = None

    # ------------------------------------------------------------------------------------------------ LRPP
    def _rank_sync(self) -> RankSync:
        if self._sync is None:
            raise SetupError("a one-rank collection has no multi-rank synchronisation")
        return self._sync

    def exchange_specs(self) -> List[ExchangeSpec]:
        """The cache kernels whose exact gradient exchange the planner thread indexes ahead, with each step's
        LRPP plan (several ranks, exact LRPP; none with one rank or in cDLRM mode)."""
        return [] if self._sync is None else self._sync.exchange_specs()

    def land_delayed(self, timeout: Optional[float] = None) -> int:
        """Land the last backward's delayed exchanges (see :meth:`RankSync.land_delayed
        <torchrec_lookahead.distributed._rank_sync.RankSync.land_delayed>`); 0 with one rank.

        Raises:
            SetupError: a collective did not finish within ``timeout``.
        """
        return 0 if self._sync is None else self._sync.land_delayed(timeout)

    # ---------------------------------------------------------------------------------- ShardedModule API
    def create_context(self) -> NullShardedModuleContext:
        return NullShardedModuleContext()

    def input_dist(
        self, ctx: NullShardedModuleContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        return NoWait(NoWait(features))

    def _part_outputs(self, dist_input: KeyedJaggedTensor) -> List[_OutT]:
        """The outputs of TorchRec's module (resident features) and of the cache (cached features), those
        present, in that order."""
        # One permute (resident features, then cached ones) and a split, rather than one permute per part.
        res_kjt: Optional[KeyedJaggedTensor] = None
        cache_kjt: Optional[KeyedJaggedTensor] = None
        nres, ncached = len(self._resident_features), len(self._cached_order)
        if nres and ncached:
            res_kjt, cache_kjt = _select(dist_input, self._resident_features + self._cached_order).split(
                [nres, ncached]
            )
        elif nres:
            res_kjt = _select(dist_input, self._resident_features)
        else:
            cache_kjt = _select(dist_input, self._cached_order)
        outs: List[_OutT] = []
        if res_kjt is not None:
            assert self.resident is not None
            out = self.resident(res_kjt)
            outs.append(out.wait() if hasattr(out, "wait") else out)
        if cache_kjt is not None:
            if self.training:
                if self.cache.applied_plan is None:  # the cache's forward consumes it: one plan, one forward
                    raise SetupError(_no_plan_message(self.cache.consumed_step))
                outs.append(self.cache(cache_kjt))
            else:
                if self.cache.applied_plan is not None:
                    raise SetupError(
                        "The lookahead cache received a planned (slot-remapped) training batch while it is in eval "
                        "mode; keep the model in training mode during fit (call model.train())"
                    )
                outs.append(self._eval_part(cache_kjt))
        return outs

    @abc.abstractmethod
    def compute(self, ctx: NullShardedModuleContext, dist_input: KeyedJaggedTensor) -> _OutT:
        """The unsharded collection's output for ``dist_input``, from :meth:`_part_outputs`."""

    def output_dist(self, ctx: NullShardedModuleContext, output: _OutT) -> LazyAwaitable[_OutT]:
        return _Ready(output)

    # ------------------------------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def _eval_part(self, kjt: KeyedJaggedTensor) -> _OutT:
        """The cached features' output in evaluation, where their values are ids (not slots): read from the
        stores after one flush per evaluation."""
        if not self.step_state.eval_flushed:
            self.flush()
            self.step_state.eval_flushed = True
        return self._eval_lookup(kjt)

    @abc.abstractmethod
    def _eval_lookup(self, kjt: KeyedJaggedTensor) -> _OutT:
        """The kind's output for the cached features' ids (not slots), read from the flushed stores."""

    def train(self, mode: bool = True) -> Self:
        super().train(mode)
        if mode:
            self.step_state.eval_flushed = False
        return self


def _select(kjt: KeyedJaggedTensor, keys: List[str]) -> KeyedJaggedTensor:
    if kjt.keys() == keys:
        return kjt
    index = {k: i for i, k in enumerate(kjt.keys())}
    missing = [k for k in keys if k not in index]
    if missing:
        raise DataError(
            f"features {missing} are missing from the batch (it has {kjt.keys()}); the tables read them: give every "
            "batch the features the model was built with"
        )
    return kjt.permute([index[k] for k in keys])


def _no_plan_message(consumed_step: Optional[int]) -> str:
    """Why a training forward reached the cache without a plan: a second forward after the one that used the
    step's plan (``consumed_step``), or no plan at all."""
    if consumed_step is not None:
        return (
            f"A second training forward of the cached tables after the one that used step {consumed_step}'s plan: "
            "a step's plan covers one forward (two passes of the batch, as R-Drop or a no_grad pass first, look "
            "the tables up once: call the embedding collection once and reuse its output)"
        )
    return (
        "A training forward reached the lookahead cache without a plan for the step: wrap the DataModule in "
        "LookaheadDataModule and train with strategy='torchrec' (or call apply_plan() and feed slot-remapped "
        "features yourself)"
    )
