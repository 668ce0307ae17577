"""The sharded module our sharder builds: resident tables through TorchRec, cached tables through the cache.

``ShardedLookaheadEmbeddingBagCollection`` replaces an ``EmbeddingBagCollection`` inside
``DistributedModelParallel``. Tables planned with TorchRec's ``CUSTOMIZED_KERNEL`` compute kernel live in a
:class:`~torchrec_lookahead.modules.CachedEmbeddingBagCollection` (host store + bounded device cache); every
other table is sharded by TorchRec's own ``ShardedEmbeddingBagCollection`` exactly as without the plugin. The
output is the KeyedTensor the unsharded collection would return (same keys, same order).

In training the cached features' values must already be cache slots and the step's plan applied
(:meth:`apply_plan`; the ``torchrec`` strategy does both for batches of a
:class:`~torchrec_lookahead.data.LookaheadDataModule`). In evaluation the values are ids: the cache is
flushed once and rows are read from the stores.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torch import nn
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import (
    Awaitable,
    LazyAwaitable,
    NoWait,
    NullShardedModuleContext,
    ShardedModule,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.fused import FusedOptimizer, FusedOptimizerModule
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_lookahead.distributed.exact_sync import KernelLayout, PendingExchange, exchange_batches
from torchrec_lookahead.distributed.lrpp import LRPPPlan, WriterFilteredStore, writing_only
from torchrec_lookahead.errors import ConfigError, InvalidIdError, SetupError
from torchrec_lookahead.modules import CachedEmbeddingBagCollection
from torchrec_lookahead.modules.types import StagedRows
from torchrec_lookahead.oracle.types import BatchPlan

__all__ = ["ShardedLookaheadEmbeddingBagCollection", "CacheFusedOptimizer", "CUSTOMIZED"]

log = logging.getLogger(__name__)

CUSTOMIZED = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value

#: seconds a flush on the exception path waits for a pending delayed all-reduce (a peer may be gone)
_EXCEPTION_PATH_WAIT = 60.0


class _LazyNoWait(LazyAwaitable[KeyedTensor]):
    def __init__(self, value: KeyedTensor) -> None:
        super().__init__()
        self._value = value

    def _wait_impl(self) -> KeyedTensor:
        return self._value


class CacheFusedOptimizer(FusedOptimizer):
    """The cache's in-backward optimizer as TorchRec's optimizers see it: one parameter group whose ``lr`` is
    handed to the cache's kernels on ``zero_grad()`` and ``step()``, exactly as TorchRec's fused optimizer hands
    its group's ``lr`` to its TBE, so a learning-rate scheduler acting on the model's ``fused_optimizer`` (or on
    an optimizer combining it, as ``DLRMModule.configure_optimizers`` builds) schedules the cached tables too.

    It owns no optimizer state: the rows and their state live in the cache and its stores (and in the module's
    state dict), so checkpoints keep their keys. Its group holds one empty placeholder tensor, keyed
    ``learning_rate``, so that TorchRec can tell the groups of several such optimizers apart when it saves and
    restores parameter groups (it matches groups by their parameters' keys).

    Args:
        cache: the cached collection.
    """

    def __init__(self, cache: CachedEmbeddingBagCollection) -> None:
        self._cache = cache
        anchor = torch.empty(0)
        super().__init__({"learning_rate": anchor}, {}, [{"params": [anchor], "lr": cache.learning_rate}])

    def _push(self) -> None:
        lr = list(self.param_groups)[0]["lr"]
        if lr != self._cache.learning_rate:
            self._cache.set_learning_rate(lr)

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._push()

    def step(self, closure: Any = None) -> None:
        self._push()

    def set_optimizer_step(self, step: int) -> None:
        """Set the optimizer iteration of the cache's kernels (Adam's bias correction), as TorchRec's fused
        optimizer sets its TBE's."""
        self._cache.set_optimizer_step(step)

    def update_hyper_parameters(self, params_dict: Dict[str, Any]) -> None:
        """Set hyper-parameters as TorchRec's fused optimizer does; the cache supports ``lr``.

        Raises:
            ConfigError: another hyper-parameter (it would silently diverge from the resident tables).
        """
        unknown = sorted(set(params_dict) - {"lr"})
        if unknown:
            raise ConfigError(
                f"the lookahead cache's optimizer can update only 'lr' during training, not {unknown}; set them "
                "in the optimizer configuration instead"
            )
        if "lr" in params_dict:
            list(self.param_groups)[0]["lr"] = params_dict["lr"]
            self._push()


def _fused_optimizers(module: nn.Module, path: str = "") -> List[Tuple[str, KeyedOptimizer]]:
    """The fused optimizers of ``module``'s submodules, keyed by path, as DistributedModelParallel collects
    them (it stops at the first FusedOptimizerModule on each branch)."""
    if isinstance(module, FusedOptimizerModule):
        return [(path, module.fused_optimizer)]
    out: List[Tuple[str, KeyedOptimizer]] = []
    for name, child in module.named_children():
        out += _fused_optimizers(child, f"{path}.{name}" if path else name)
    return out


class ShardedLookaheadEmbeddingBagCollection(
    ShardedModule[KeyedJaggedTensor, KeyedTensor, KeyedTensor, NullShardedModuleContext],
    FusedOptimizerModule,
):
    """An EmbeddingBagCollection whose large tables train through the lookahead cache.

    Args:
        tables: every table of the unsharded collection, in its order.
        resident: TorchRec's sharded collection of the resident tables (``None`` when every table is cached).
        cache: the cached tables' collection.
        is_weighted: whether features carry per-id weights.
        rank: this rank.
        world_size: W; with W > 1 the cache is an LRPP cache (or cDLRM's with ``average_every``).
        process_group: the group of the W ranks (critical-path collectives).
        average_every: cDLRM's scheme: average the caches every this many steps instead of LRPP.
        delayed_sync: with LRPP, all-reduce the gradients of shared rows that no rank reads at the next step
            in the background, on ``delayed_group``, and apply their update before the next plan (see
            docs/design.md, "Delayed synchronisation"); ``False``: every shared row on the critical path.
        delayed_group: a process group of the same ranks used only for delayed synchronisation, created
            identically on every rank (required when ``delayed_sync`` is on with W > 1 and no cDLRM).
    """

    def __init__(
        self,
        tables: List[EmbeddingBagConfig],
        resident: Optional[nn.Module],
        cache: CachedEmbeddingBagCollection,
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
        self._tables = list(tables)
        self.resident = resident
        self.cache = cache
        self._is_weighted = is_weighted
        self._feature_names = [f for t in self._tables for f in t.feature_names]
        self._dims = [t.embedding_dim for t in self._tables for _ in t.feature_names]
        self._cached_features = set(cache.feature_names)
        self._resident_features = [f for f in self._feature_names if f not in self._cached_features]
        self._cached_order = [f for f in self._feature_names if f in self._cached_features]
        self._column_runs: Dict[Tuple[Tuple[str, ...], ...], List[Tuple[int, int, int]]] = {}
        self._plan_pending = False
        self._eval_flushed = False
        self._dirty = False  # a plan was applied since the last complete flush
        self.rank = rank
        self.world_size = world_size
        self._pg = process_group
        self._lrpp: Optional[LRPPPlan] = None
        self.sync_counters: Dict[str, int] = {}
        self.delayed_sync = bool(delayed_sync) and world_size > 1 and average_every is None
        self._delayed_pg = delayed_group
        self._pending: List[PendingExchange] = []
        self._fused_optim: Optional[KeyedOptimizer] = None
        if self.delayed_sync and delayed_group is None:
            raise SetupError(
                "delayed_sync needs a process group of its own (delayed_group), created on every rank; build the "
                "module with LookaheadEmbeddingBagCollectionSharder, or pass delayed_sync=False"
            )
        if world_size > 1:
            for name, store in cache.stores.items():
                if not isinstance(store, WriterFilteredStore):
                    raise SetupError(
                        f"table '{name}': multi-rank caches need WriterFilteredStore views of a shared store"
                    )
            for g, kernel in enumerate(cache._kernels):
                kernel.backward_hook = self._make_backward_hook(g, kernel)
            self.register_state_dict_pre_hook(lambda module, prefix, keep_vars: module.flush())
            self.register_load_state_dict_pre_hook(lambda module, *args: module.land_delayed())
            self.register_load_state_dict_post_hook(lambda module, incompatible: module._barrier())

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        """The in-backward optimizers of this collection, for DistributedModelParallel's ``fused_optimizer``:
        the cache's (:class:`CacheFusedOptimizer`) and, when TorchRec's module trains resident tables beside
        the cache, its own under ``resident`` (the keys it had before)."""
        if self._fused_optim is None:
            parts: List[Tuple[str, KeyedOptimizer]] = [("", CacheFusedOptimizer(self.cache))]
            if self.resident is not None:
                parts += _fused_optimizers(self.resident, "resident")
            self._fused_optim = CombinedOptimizer(parts) if len(parts) > 1 else parts[0][1]
        return self._fused_optim

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        """The group of the ranks this collection trains on (its critical-path collectives)."""
        return self._pg

    @property
    def unsharded_module_type(self) -> type:
        return EmbeddingBagCollection

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
    ) -> None:
        """Apply the cached tables' part of a step's plan (write-backs, then loads; with several ranks also
        the refresh of invalid replicas, and the gradient synchronisation of the coming backward)."""
        mine = {t: p for t, p in plan.tables.items() if t in self.cache.capacity}
        sub = BatchPlan(plan.step, mine)
        sub_staged = None
        if staged is not None:
            sub_staged = StagedRows(staged.step, {t: r for t, r in staged.tables.items() if t in mine})
        if self.world_size > 1:
            if lrpp is None or lrpp.step != plan.step:
                raise SetupError(f"multi-rank step {plan.step} has no LRPP synchronisation plan")
            # this collection's tables only (a model may hold several cached collections: EBC and EC)
            lrpp = dataclasses.replace(
                lrpp, tables={t: p for t, p in lrpp.tables.items() if t in self.cache.capacity}
            )
            # The previous step's delayed rows land before this plan evicts, refreshes or loads anything.
            self.land_delayed()
            stores = self.cache.stores
            averaging = self.average_every is not None
            if averaging and plan.step > 0 and plan.step % int(self.average_every) == 0:  # type: ignore[arg-type]
                self._average()
            evict_mine: Dict[str, torch.Tensor] = {}  # the evicted rows this rank writes back
            for t, tp in mine.items():
                if averaging:  # cDLRM: replicas agree only after averaging; rank 0's copy is written back
                    evict_mine[t] = tp.evict_ids if self.rank == 0 else tp.evict_ids[:0]
                else:
                    evict_mine[t] = tp.evict_ids[lrpp.tables[t].evict_writer == self.rank]
            with writing_only(stores, evict_mine):
                self.cache.apply_plan(sub, sub_staged, trusted=trusted)
            if not averaging:
                self._refresh(lrpp)
            self._lrpp = lrpp
            for k, v in lrpp.counters(self.delayed_sync).items():
                self.sync_counters[k] = self.sync_counters.get(k, 0) + v
        else:
            self.cache.apply_plan(sub, sub_staged, trusted=trusted)
        self._plan_pending = True
        self._eval_flushed = False
        self._dirty = True

    def pin_rows(self, plan: BatchPlan) -> None:
        """Load pinned rows (a :meth:`~torchrec_lookahead.hotcold.PinnedRows.pin_plan`) into the emptied caches:
        every rank loads every pinned row of its cached tables; nothing is evicted or written back. With
        several ranks the stores' reads are collectives where the stores are row-sharded: every rank calls this
        at the same step (the first batch of a plan stream)."""
        mine = {t: p for t, p in plan.tables.items() if t in self.cache.capacity}
        if any(p.evict_ids.numel() for p in mine.values()):
            raise SetupError(f"the pin plan of step {plan.step} evicts rows; pin into an emptied cache")
        self.cache.apply_plan(BatchPlan(plan.step, mine))
        self._eval_flushed = False
        self._dirty = True

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
            if self._dirty:
                log.warning(
                    "not flushing the lookahead cache to its row-sharded stores on this exit path (peers may be "
                    "gone); updates since the last checkpoint are lost"
                )
            return
        if self._lrpp is not None:
            stores = self.cache.stores
            if self.average_every is not None and barrier:
                self._average()  # a collective: not on the exception path (barrier=False)
            held: Dict[str, torch.Tensor] = {}
            for t, tp in self._lrpp.tables.items():
                slot_ids = self.cache.slot_ids(t)
                writer = (
                    torch.zeros_like(slot_ids)
                    if self.average_every is not None
                    else tp.writer.to(torch.int64)
                )
                mine = (writer == self.rank) & (slot_ids >= 0)
                held[t] = slot_ids[mine]
            with writing_only(stores, held):
                self.cache.flush()
        self._dirty = False
        if barrier:
            self._barrier()

    def invalidate(self) -> None:
        """Empty the cache (after :meth:`flush`); the next plan stream starts from an empty cache."""
        self.land_delayed()
        self.cache.invalidate()
        self._lrpp = None

    # ------------------------------------------------------------------------------------------------ LRPP
    def _average(self) -> None:
        """cDLRM: average every cached row and its optimizer state over the ranks (replicas diverge between
        averages because each rank applies only its own gradients)."""
        parts = []
        for t in sorted(self.cache.capacity):
            occupied = (self.cache.slot_ids(t) >= 0).nonzero().flatten()
            states = self.cache.cache_states(t)
            tensors = [self.cache.cache_weights(t), *(states[k] for k in sorted(states))]
            parts.append((occupied, tensors))
        flat = [x[occ].reshape(-1) for occ, tensors in parts for x in tensors]
        if not flat:
            return
        buf = torch.cat(flat)
        dist.all_reduce(buf, group=self._pg)
        buf /= self.world_size
        off = 0
        with torch.no_grad():
            for occ, tensors in parts:
                for x in tensors:
                    n = occ.numel() * x.shape[1]
                    x[occ] = buf[off : off + n].view(-1, x.shape[1])
                    off += n
        self.sync_counters["rows_averaged"] = self.sync_counters.get("rows_averaged", 0) + sum(
            int(occ.numel()) for occ, _ in parts
        )

    def _refresh(self, lrpp: LRPPPlan) -> None:
        """Give every rank the current value of the rows it reads but holds only as a stale replica: the
        holder contributes the row (and its optimizer state), the others zeros, in one compacted all-reduce."""
        parts: List[Tuple[str, torch.Tensor, torch.Tensor, List[str], int]] = []
        total = 0
        for t, tp in lrpp.tables.items():
            n = int(tp.refresh_slots.numel())
            if n == 0:
                continue
            states = self.cache.cache_states(t)
            names = sorted(states)
            width = self.cache.cache_weights(t).shape[1] + sum(states[k].shape[1] for k in names)
            parts.append((t, tp.refresh_slots, tp.refresh_source, names, width))
            total += n * width
        if total == 0:
            return
        buf = torch.zeros(total, device=self.cache.device)
        off = 0
        for t, slots, source, names, _width in parts:
            rows = torch.cat(
                [self.cache.cache_weights(t)[slots], *(self.cache.cache_states(t)[k][slots] for k in names)],
                1,
            )
            rows = torch.where((source == self.rank).unsqueeze(1), rows, torch.zeros_like(rows))
            buf[off : off + rows.numel()] = rows.reshape(-1)
            off += rows.numel()
        dist.all_reduce(buf, group=self._pg)
        off = 0
        with torch.no_grad():
            for t, slots, _, names, width in parts:
                rows = buf[off : off + slots.numel() * width].view(-1, width)
                off += rows.numel()
                w = self.cache.cache_weights(t)
                d = w.shape[1]
                w[slots] = rows[:, :d]
                col = d
                for k in names:
                    st = self.cache.cache_states(t)[k]
                    st[slots] = rows[:, col : col + st.shape[1]]
                    col += st.shape[1]

    def land_delayed(self, timeout: Optional[float] = None) -> int:
        """Wait for the pending delayed all-gathers and apply the optimizer to their rows, each with the
        iteration count and learning rate of the step that computed its gradients (so the result is what the
        update inside that step's backward would have been). Runs before anything reads or writes cached rows
        again: the next :meth:`apply_plan`, :meth:`flush` (checkpoints, evaluation, the end of fit),
        :meth:`invalidate`.

        Args:
            timeout: seconds to wait for the collectives (``None``: as long as the process group allows).
                Used on the exception path, where a peer may be gone.

        Returns:
            Rows updated.

        Raises:
            SetupError: a collective did not finish within ``timeout`` (its rows keep their value before
                the step; the pending work is dropped).
        """
        pending, self._pending = self._pending, []
        rows = 0
        for p in pending:
            try:
                rows += p.land(None if timeout is None else datetime.timedelta(seconds=timeout))
            except Exception as e:  # noqa: BLE001 - the collective's error type depends on the backend
                raise SetupError(
                    f"the delayed synchronisation of step {p.step} did not finish ({e}); "
                    f"{p.rows} shared rows keep their value before that step"
                ) from e
        return rows

    def _kernel_layout(self, g: int, kernel: Any) -> KernelLayout:
        cache = self.cache
        tables = sorted((t.local, n) for n, t in cache._tables.items() if t.group == g)
        names = [n for _, n in tables]
        missing = [n for n in names if n not in cache.capacity]
        if missing:
            raise SetupError(f"multi-rank caches train only cached tables in their kernels, not {missing}")
        features = list(cache._group_features[g])
        ftm = list(kernel.feature_table_map)
        return KernelLayout(
            features=features,
            feature_table=ftm,
            tables=names,
            capacity=[int(cache.capacity[n]) for n in names],
            dims=[int(kernel.dims[t]) for t in ftm],
            mean=kernel.pooling == PoolingMode.MEAN,
            weighted=self._is_weighted,
            unpooled=kernel.pooling == PoolingMode.NONE,
        )

    def _make_backward_hook(self, g: int, kernel: Any) -> Any:
        layout = self._kernel_layout(g, kernel)

        def hook(
            grad: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]
        ) -> None:
            lrpp = self._lrpp
            if lrpp is None:
                raise SetupError("a multi-rank backward ran without the step's LRPP plan")
            if self.average_every is not None:
                # cDLRM: every rank applies its own gradients; the caches are averaged every few steps. The
                # 1-element all-reduce keeps a collective in every backward (see the stager's argument).
                dist.all_reduce(torch.zeros(1, device=grad.device), group=self._pg)
                kernel.apply_batch(indices, offsets, weights, grad)
                return
            if lrpp.features is None:
                raise SetupError(
                    f"the LRPP plan of step {lrpp.step} carries no global batch: pass features= (the global batch "
                    "remapped to slots) to LRPPTracker.step"
                )
            # TorchRec divides the gradients of sharded embeddings element-wise by the world size
            # (comm_ops.GRADIENT_DIVISION, to match DDP's averaging of dense gradients): the cache does too.
            if get_gradient_division():
                grad = torch.div(grad, self.world_size)
            plans = [lrpp.tables[t] for t in layout.tables]
            empty = torch.zeros(0, dtype=torch.int64)
            delayed = [tp.delayed_slots if self.delayed_sync else empty for tp in plans]
            now, later, sent = exchange_batches(
                layout,
                lrpp.features,
                grad,
                self.rank,
                self.world_size,
                [tp.shared_slots for tp in plans],
                delayed,
                self._pg,
                self._delayed_pg,
                [lrpp.pinned.get(t, 0) for t in layout.tables],
            )
            kernel.apply_batch(now.indices, now.offsets, now.weights, now.grad)
            self.sync_counters["grad_floats_sent"] = self.sync_counters.get("grad_floats_sent", 0) + sent
            if later is not None:
                self._pending.append(
                    PendingExchange(
                        lrpp.step, kernel, int(kernel.get_step()), kernel.get_learning_rate(), later
                    )
                )

        return hook

    # ---------------------------------------------------------------------------------- ShardedModule API
    def create_context(self) -> NullShardedModuleContext:
        return NullShardedModuleContext()

    def input_dist(
        self, ctx: NullShardedModuleContext, features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        return NoWait(NoWait(features))

    def _part_outputs(self, dist_input: KeyedJaggedTensor) -> List[Any]:
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
        outs: List[Any] = []
        if res_kjt is not None:
            assert self.resident is not None
            out = self.resident(res_kjt)
            outs.append(out.wait() if hasattr(out, "wait") else out)
        if cache_kjt is not None:
            if self.training:
                if not self._plan_pending:
                    raise SetupError(
                        "A training forward reached the lookahead cache without a plan for the step: wrap the "
                        "DataModule in LookaheadDataModule and train with strategy='torchrec' (or call "
                        "apply_plan() and feed slot-remapped features yourself)"
                    )
                self._plan_pending = False
                outs.append(self.cache(cache_kjt))
            else:
                if self._plan_pending:
                    raise SetupError(
                        "The lookahead cache received a planned (slot-remapped) training batch while it is in eval "
                        "mode; keep the model in training mode during fit (call model.train())"
                    )
                outs.append(self._eval_lookup(cache_kjt))
        return outs

    def compute(self, ctx: NullShardedModuleContext, dist_input: KeyedJaggedTensor) -> KeyedTensor:
        outs = self._part_outputs(dist_input)
        if len(outs) == 1 and outs[0].keys() == self._feature_names:
            values = outs[0].values()
        else:  # back to the collection's feature order: one concatenation of column runs
            values = torch.cat([outs[i].values()[:, a:b] for i, a, b in self._runs(outs)], dim=1)
        return KeyedTensor(keys=list(self._feature_names), length_per_key=list(self._dims), values=values)

    def _runs(self, outs: List[KeyedTensor]) -> List[Tuple[int, int, int]]:
        """(part, first column, end column) runs that, concatenated, put the parts' pooled embeddings in
        feature order (consecutive features of one part form one run)."""
        layout = tuple(tuple(o.keys()) for o in outs)
        runs = self._column_runs.get(layout)
        if runs is None:
            where: Dict[str, Tuple[int, int]] = {}
            for i, o in enumerate(outs):
                col = 0
                for k, d in zip(o.keys(), o.length_per_key()):
                    where[k] = (i, col)
                    col += d
            runs = []
            for f, d in zip(self._feature_names, self._dims):
                i, a = where[f]
                if runs and runs[-1][0] == i and runs[-1][2] == a:
                    runs[-1] = (i, runs[-1][1], a + d)
                else:
                    runs.append((i, a, a + d))
            self._column_runs[layout] = runs
        return runs

    def output_dist(self, ctx: NullShardedModuleContext, output: KeyedTensor) -> LazyAwaitable[KeyedTensor]:
        return _LazyNoWait(output)

    # ------------------------------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def _eval_lookup(self, kjt: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of ids (not slots), read from the stores after one flush per evaluation."""
        if not self._eval_flushed:
            self.flush()
            self._eval_flushed = True
        stores = self.cache.stores
        f2t = self.cache.feature_to_table
        configs = {c.name: c for c in self.cache.embedding_bag_configs()}
        outs: List[torch.Tensor] = []
        dims: List[int] = []
        for name, jt in kjt.to_dict().items():
            table = f2t[name]
            cfg = configs[table]
            ids = jt.values().to(torch.int64)
            if table in stores:
                uniq, inverse = torch.unique(ids, return_inverse=True)
                rows, _ = stores[table].gather(uniq)
            else:  # a resident table trained in the cache's kernel (fuse_resident): all its rows are there
                n = cfg.num_embeddings
                if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
                    bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
                    raise InvalidIdError(
                        f"feature '{name}' of table '{table}' has id {bad} outside [0, {n}); hash or clip ids into "
                        "the table"
                    )
                inverse, rows = ids, self.cache.cache_weights(table)
            weights = jt.weights() if self._is_weighted else None
            mean = cfg.pooling == PoolingType.MEAN
            pooled = F.embedding_bag(
                inverse.to(self.cache.device),
                rows.to(self.cache.device),
                offsets=jt.offsets()[:-1].to(torch.int64),
                # torch has no weighted mean: FBGEMM's is the weighted sum over the bag's length
                mode="mean" if mean and weights is None else "sum",
                per_sample_weights=weights,
                include_last_offset=False,
            )
            if mean and weights is not None:
                pooled = pooled / jt.lengths().to(pooled.device, pooled.dtype).clamp(min=1).unsqueeze(1)
            outs.append(pooled)
            dims.append(cfg.embedding_dim)
        return KeyedTensor(keys=kjt.keys(), length_per_key=dims, values=torch.cat(outs, dim=1))

    def train(self, mode: bool = True) -> ShardedLookaheadEmbeddingBagCollection:
        super().train(mode)
        if mode:
            self._eval_flushed = False
        return self


def _select(kjt: KeyedJaggedTensor, keys: List[str]) -> KeyedJaggedTensor:
    if kjt.keys() == keys:
        return kjt
    index = {k: i for i, k in enumerate(kjt.keys())}
    missing = [k for k in keys if k not in index]
    if missing:
        raise SetupError(f"features {missing} are missing from the batch (it has {kjt.keys()})")
    return kjt.permute([index[k] for k in keys])
