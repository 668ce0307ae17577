"""The multi-rank synchronisation of one cached collection (:class:`RankSync`): LRPP's refresh of stale
replicas, the exact gradient exchange of every backward (with its delayed part), cDLRM's averaging; and the
state a collection keeps of the step in flight (:class:`StepState`).

The sharded collection (:class:`~torchrec_lookahead.distributed.ShardedLookaheadCollection`) calls
it from ``apply_plan`` and ``flush``, and hands it each cache kernel's backward (``set_backward_hook``).
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from torchrec_lookahead.distributed.exact_sync import (
    ExchangeIndex,
    ExchangeSpec,
    KernelLayout,
    PendingExchange,
    exchange,
    exchange_index,
)
from torchrec_lookahead.distributed.lrpp import LRPPPlan
from torchrec_lookahead.errors import SetupError
from torchrec_lookahead.modules import CachedCollection
from torchrec_lookahead.modules.cached_collection import KernelGroup
from torchrec_lookahead.modules.types import BackwardHook

__all__ = ["RankSync", "StepState"]


@dataclasses.dataclass
class StepState:
    """The state a sharded collection keeps of the cached step in flight, in one place.

    :meth:`ShardedLookaheadCollection.apply_plan` sets ``dirty`` and (several ranks) ``lrpp``; the backward
    hook reads ``lrpp`` and appends the step's delayed exchanges to ``pending``; the next ``apply_plan``,
    ``flush`` or ``invalidate`` lands them first; ``flush`` clears ``dirty``; an evaluation flushes once
    (``eval_flushed``). The plan a training forward covers is the cache's own one-forward token
    (``CachedCollection.applied_plan``), not a flag here.

    Attributes:
        lrpp: with several ranks, the synchronisation plan of the last applied step (its backward's exchange
            and the slot writers a flush writes back by); ``None`` after :meth:`invalidate`.
        pending: delayed exchanges of the last backward, not landed yet.
        dirty: a plan was applied since the last complete flush.
        eval_flushed: the cache has been flushed for the current evaluation (reset by ``train()``).
        unflushed_reported: the exception path's flush has said that the rows since the last checkpoint are
            not written back (the strategy and the session both flush there: said once).
    """

    lrpp: Optional[LRPPPlan] = None
    pending: List[PendingExchange] = dataclasses.field(default_factory=list)
    dirty: bool = False
    eval_flushed: bool = False
    unflushed_reported: bool = False


class RankSync:
    """The collectives that keep W ranks' caches of one collection exact (see docs/design.md, "LRPP").

    Args:
        cache: the collection's cache.
        rank: this rank.
        world_size: W (> 1).
        group: the group of the W ranks (critical-path collectives).
        delayed_group: a group of the same ranks for the delayed all-gathers (``None`` without delayed sync).
        average_every: cDLRM's averaging period (``None``: exact LRPP).
        delayed_sync: whether rows no rank reads at the next step are exchanged in the background.
        weighted: whether the features carry per-id weights.
        state: the collection's step state (the backward reads its LRPP plan, appends pending exchanges).
        counters: the collection's synchronisation counters (added to).
    """

    def __init__(
        self,
        cache: CachedCollection[BaseEmbeddingConfig, object],
        rank: int,
        world_size: int,
        group: Optional[dist.ProcessGroup],
        delayed_group: Optional[dist.ProcessGroup],
        average_every: Optional[int],
        delayed_sync: bool,
        weighted: bool,
        state: StepState,
        counters: Dict[str, int],
    ) -> None:
        self.cache = cache
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.delayed_group = delayed_group
        self.average_every = average_every
        self.delayed_sync = delayed_sync
        self.weighted = weighted
        self.state = state
        self.counters = counters

    def land_delayed(self, timeout: Optional[float] = None) -> int:
        """Wait for the pending delayed all-gathers and apply the optimizer to their rows, each with the
        iteration count and learning rate of the step that computed its gradients (so the result is what the
        update inside that step's backward would have been). Runs before anything reads or writes cached rows
        again: the collection's next ``apply_plan``, ``flush`` (checkpoints, evaluation, the end of fit),
        ``invalidate``.

        Args:
            timeout: seconds to wait for the collectives (``None``: as long as the process group allows).
                Used on the exception path, where a peer may be gone.

        Returns:
            Rows updated.

        Raises:
            SetupError: a collective did not finish within ``timeout`` (its rows keep their value before
                the step; the pending work is dropped).
        """
        pending, self.state.pending = self.state.pending, []
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

    def average(self) -> None:
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
        dist.all_reduce(buf, group=self.group)
        buf /= self.world_size
        off = 0
        with torch.no_grad():
            for occ, tensors in parts:
                for x in tensors:
                    n = occ.numel() * x.shape[1]
                    x[occ] = buf[off : off + n].view(-1, x.shape[1])
                    off += n
        self.counters["rows_averaged"] = self.counters.get("rows_averaged", 0) + sum(
            int(occ.numel()) for occ, _ in parts
        )

    def refresh(self, lrpp: LRPPPlan) -> None:
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
        dist.all_reduce(buf, group=self.group)
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

    def _layout(self, group: KernelGroup) -> KernelLayout:
        cache, kernel = self.cache, group.kernel
        names = list(group.tables)
        missing = [n for n in names if n not in cache.capacity]
        if missing:
            raise SetupError(f"multi-rank caches train only cached tables in their kernels, not {missing}")
        features = list(group.features)
        ftm = list(kernel.feature_table_map)
        return KernelLayout(
            features=features,
            feature_table=ftm,
            tables=names,
            capacity=[cache.cache_rows(n) for n in names],
            dims=[int(kernel.dims[t]) for t in ftm],
            mean=kernel.pooling == PoolingMode.MEAN,
            weighted=self.weighted,
            unpooled=kernel.pooling == PoolingMode.NONE,
        )

    def exchange_specs(self) -> List[ExchangeSpec]:
        """The collection's kernels whose exact exchange the planner thread indexes ahead
        (:meth:`LRPPPlan.with_exchanges <torchrec_lookahead.distributed.lrpp.LRPPPlan.with_exchanges>`); none in
        cDLRM mode, which exchanges no gradients."""
        if self.average_every is not None:
            return []
        return [ExchangeSpec(self._layout(g), self.delayed_sync) for g in self.cache.kernel_groups()]

    def _exchange_index(self, spec: ExchangeSpec, lrpp: LRPPPlan) -> ExchangeIndex:
        """The step's exchange index of the kernel of ``spec``: the one the planner built with the LRPP plan, or
        (a plan made elsewhere, e.g. by hand) built here, counted in
        ``exchanges_indexed_in_backward``."""
        names = tuple(spec.layout.tables)
        index = lrpp.exchange.get(names)
        if index is not None:
            if index.spec != spec or index.rank != self.rank or index.world_size != self.world_size:
                raise SetupError(
                    f"the exchange index of step {lrpp.step} for tables {list(names)} was built for another "
                    "kernel layout, rank or world size"
                )
            return index
        if lrpp.features is None:
            raise SetupError(
                f"the LRPP plan of step {lrpp.step} carries no global batch: pass features= (the global batch "
                "remapped to slots) to LRPPTracker.step"
            )
        plans = [lrpp.tables[t] for t in names]
        self.counters["exchanges_indexed_in_backward"] = (
            self.counters.get("exchanges_indexed_in_backward", 0) + 1
        )
        return exchange_index(
            spec,
            lrpp.features,
            self.rank,
            self.world_size,
            [tp.shared_slots for tp in plans],
            [tp.delayed_slots for tp in plans],
            [lrpp.pinned.get(t, (0, 0)) for t in names],
        )

    def backward_hook(self, group: KernelGroup) -> BackwardHook:
        spec = ExchangeSpec(self._layout(group), self.delayed_sync)
        kernel = group.kernel

        def hook(
            grad: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor]
        ) -> None:
            lrpp = self.state.lrpp
            if lrpp is None:
                raise SetupError("a multi-rank backward ran without the step's LRPP plan")
            if self.average_every is not None:
                # cDLRM: every rank applies its own gradients; the caches are averaged every few steps. The
                # 1-element all-reduce keeps a collective in every backward (see the stager's argument).
                dist.all_reduce(torch.zeros(1, device=grad.device), group=self.group)
                kernel.apply_batch(indices, offsets, weights, grad)
                return
            index = self._exchange_index(spec, lrpp)
            # TorchRec divides the gradients of sharded embeddings element-wise by the world size
            # (comm_ops.GRADIENT_DIVISION, to match DDP's averaging of dense gradients): the cache does too.
            if get_gradient_division():
                grad = torch.div(grad, self.world_size)
            now, later, sent = exchange(index, grad, self.group, self.delayed_group)
            kernel.apply_batch(now.indices, now.offsets, now.weights, now.grad)
            self.counters["grad_floats_sent"] = self.counters.get("grad_floats_sent", 0) + sent
            if later is not None:
                self.state.pending.append(
                    PendingExchange(
                        lrpp.step, kernel, int(kernel.get_step()), kernel.get_learning_rate(), later
                    )
                )

        return hook
