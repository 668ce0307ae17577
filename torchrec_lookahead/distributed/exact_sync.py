"""Exact gradient synchronisation of the LRPP cache: TorchRec's sharded arithmetic, reproduced.

TorchRec's ``DistributedModelParallel`` trains a sharded table on the rank that owns it: the input all-to-all
brings it the global batch's bags of the table's features in rank order (feature by feature: rank 0's bags,
then rank 1's, ...), the gradients of their pooled outputs come back divided element-wise by the world size
(``comm_ops.GRADIENT_DIVISION``), and FBGEMM's backward sums each row's gradients bag after bag in that order
(its ``csr2csc`` is a stable sort by row) before its fused optimizer updates the row once. Adding per-rank
partial sums instead (an all-reduce) rounds differently, and recommendation training amplifies a one-ulp
difference into visible drift within tens of steps.

Every rank of the LRPP cache knows the step's global batch (the oracle plans it), so each rank builds its
*exchange batch*: the global batch's bags in TorchRec's order, each keeping only the ids whose rows this rank
holds (the rows it read); the gradients of other ranks' bags that hold a row read by several ranks arrive in
one all-gather, compacted to those bags and to each feature's columns. The kernel's own backward over this
batch (:meth:`~torchrec_lookahead.modules._kernels._CacheKernel.apply_batch`) then sums every row this rank
holds over exactly the global batch's bags, in exactly TorchRec's order, and updates it with the same kernel
(FBGEMM's where it has the optimizer). Rows read by one rank need no message; rows read by several ranks are
updated identically by each of their readers.

With delayed synchronisation, the shared rows no rank reads at the next step are left out of this backward:
their bags' gradients travel in a second all-gather in the background, and their update (a second exchange
batch with the step's iteration and learning rate) lands before the next plan is applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.errors import SetupError

__all__ = ["KernelLayout", "ExchangeBatch", "DelayedExchange", "PendingExchange", "exchange_batches"]


@dataclass(frozen=True)
class KernelLayout:
    """The features of one cache kernel, in the kernel's order.

    Attributes:
        features: feature names, in the kernel's order.
        feature_table: the kernel's local table of each feature.
        tables: the cached table name of each local table.
        capacity: cache rows of each local table.
        dims: embedding dimension of each feature.
        mean: MEAN pooling (else SUM).
        weighted: features carry per-id weights.
        unpooled: the kernel returns one row per id (an EmbeddingCollection's): its output gradient is per id,
            so the exchange sends the gradients of the ids that read a shared row instead of their bags'.
    """

    features: List[str]
    feature_table: List[int]
    tables: List[str]
    capacity: List[int]
    dims: List[int]
    mean: bool
    weighted: bool
    unpooled: bool = False

    @property
    def columns(self) -> List[int]:
        """First output column of each feature."""
        return np.concatenate([[0], np.cumsum(self.dims)[:-1]]).astype(np.int64).tolist()

    @property
    def width(self) -> int:
        return int(sum(self.dims))


@dataclass
class ExchangeBatch:
    """A kernel batch over the global bags: slot ids, offsets, per-id scales and the output gradient."""

    indices: torch.Tensor
    offsets: torch.Tensor
    weights: Optional[torch.Tensor]
    grad: torch.Tensor


@dataclass
class DelayedExchange:
    """The delayed rows' part of one step for one kernel: their all-gather in flight, and how to build their
    exchange batch once it has landed."""

    work: Any
    recv: List[torch.Tensor]
    build: Callable[[List[torch.Tensor]], ExchangeBatch]
    rows: int  #: rows of this rank the batch updates

    def batch(self, timeout: Optional[timedelta] = None) -> ExchangeBatch:
        """Wait for the all-gather (at most ``timeout``) and return the delayed rows' exchange batch."""
        if timeout is None:
            self.work.wait()
        else:
            self.work.wait(timeout=timeout)
        return self.build(self.recv)


@dataclass
class PendingExchange:
    """A delayed exchange of ``kernel`` in flight, with the optimizer iteration and rate of its step."""

    step: int
    kernel: Any
    iteration: int
    lr: float
    delayed: DelayedExchange

    @property
    def rows(self) -> int:
        return self.delayed.rows

    def land(self, timeout: Optional[timedelta] = None) -> int:
        """Wait for the all-gather and apply the delayed rows' update as in their step; returns the rows updated."""
        b = self.delayed.batch(timeout)
        self.kernel.apply_batch(b.indices, b.offsets, b.weights, b.grad, step=self.iteration, lr=self.lr)
        return self.rows


class _Global:
    """One kernel's features of the global slot batch, as flat NumPy arrays (feature-major, rank order)."""

    def __init__(self, layout: KernelLayout, kjt: KeyedJaggedTensor, world_size: int) -> None:
        keys = kjt.keys()
        stride = int(kjt.stride())
        self.bags = stride  # global bags per feature
        self.local = stride // world_size
        lengths_all = kjt.lengths().view(len(keys), stride)
        offsets_all = np.concatenate([[0], np.cumsum(kjt.lengths().numpy())])
        where = {k: i for i, k in enumerate(keys)}
        missing = [f for f in layout.features if f not in where]
        if missing:
            raise SetupError(f"features {missing} are missing from the step's global batch")
        values, lengths, weights = [], [], []
        w_all = kjt.weights_or_none()
        for f in layout.features:
            i = where[f]
            lo, hi = int(offsets_all[i * stride]), int(offsets_all[(i + 1) * stride])
            values.append(kjt.values()[lo:hi].numpy())
            lengths.append(lengths_all[i].numpy())
            if layout.weighted and w_all is not None:
                weights.append(w_all[lo:hi].numpy())
        self.values = np.concatenate(values).astype(np.int64)
        self.lengths = np.concatenate(lengths).astype(np.int64)  # (F * bags,)
        self.bag = np.repeat(np.arange(self.lengths.size, dtype=np.int64), self.lengths)
        self.feature = self.bag // stride
        self.rank = (self.bag % stride) // max(self.local, 1)
        self.table = np.asarray(layout.feature_table, dtype=np.int64)[self.feature]
        base = np.concatenate([[0], np.cumsum(layout.capacity)]).astype(np.int64)
        self.base = base
        self.kslot = self.values + base[self.table]  # slot in the kernel's concatenated capacity
        self.weights = np.concatenate(weights).astype(np.float32) if weights else None
        if self.weights is None and layout.mean:
            # FBGEMM's MEAN scale, computed in double and rounded to float, from the bag's full length.
            length = np.maximum(self.lengths[self.bag], 1).astype(np.float64)
            self.scale: Optional[np.ndarray] = (1.0 / length).astype(np.float32)
        else:
            self.scale = self.weights

    def mask(self, per_table: Sequence[torch.Tensor]) -> np.ndarray:
        """Boolean mask over the kernel's concatenated capacity of the given per-table slots."""
        out = np.zeros(int(self.base[-1]), dtype=bool)
        for t, slots in enumerate(per_table):
            if slots.numel():
                out[slots.numpy() + self.base[t]] = True
        return out


def _needed_bags(g: _Global, select: np.ndarray, world_size: int) -> List[List[np.ndarray]]:
    """Per rank, per feature: the rank's local bag indices (sorted) holding an id selected by ``select``."""
    bags = np.unique(g.bag[select[g.kslot]])
    feature = bags // g.bags
    within = bags % g.bags
    rank = within // max(g.local, 1)
    local = within - rank * g.local
    nf = g.lengths.size // g.bags if g.bags else 0
    return [[local[(rank == q) & (feature == f)] for f in range(nf)] for q in range(world_size)]


def _pack(grad: torch.Tensor, layout: KernelLayout, bags: List[np.ndarray]) -> torch.Tensor:
    """This rank's gradient columns of each feature for the given local bags, flattened feature by feature."""
    cols = layout.columns
    parts = [
        grad[torch.from_numpy(b), cols[f] : cols[f] + layout.dims[f]].reshape(-1)
        for f, b in enumerate(bags)
        if b.size
    ]
    return torch.cat(parts) if parts else grad.new_zeros(0)


def _sizes(layout: KernelLayout, needed: List[List[np.ndarray]]) -> List[int]:
    return [sum(int(b.size) * layout.dims[f] for f, b in enumerate(per_rank)) for per_rank in needed]


def _all_gather(
    send: torch.Tensor, sizes: List[int], group: Optional[dist.ProcessGroup], async_op: bool
) -> Tuple[Any, List[torch.Tensor]]:
    """All-gather of unequal flat buffers (padded to the largest, at least one element)."""
    width = max(max(sizes), 1)
    buf = send.new_zeros(width)
    buf[: send.numel()] = send
    recv = [send.new_empty(width) for _ in sizes]
    work = dist.all_gather(recv, buf, group=group, async_op=async_op)
    return work, recv


def _needed_ids(g: _Global, select: np.ndarray, world_size: int) -> List[np.ndarray]:
    """Per rank, the positions in the global batch of the rank's ids selected by ``select`` (unpooled)."""
    hit = select[g.kslot]
    return [np.flatnonzero(hit & (g.rank == q)) for q in range(world_size)]


def _build_ids(
    g: _Global,
    keep: np.ndarray,
    grad: torch.Tensor,
    rank: int,
    needed: List[np.ndarray],
    recv: List[torch.Tensor],
) -> ExchangeBatch:
    """The unpooled exchange batch: every global id selected by ``keep``, with its output gradient (this
    rank's own, or received), in the global batch's order."""
    dim = grad.shape[1]
    full = grad.new_zeros(g.values.size, dim)
    full[torch.from_numpy(np.flatnonzero(g.rank == rank))] = grad
    for q, pos in enumerate(needed):
        if q != rank and pos.size:
            full[torch.from_numpy(pos)] = recv[q][: pos.size * dim].view(-1, dim)
    lengths = np.bincount(g.bag[keep], minlength=g.lengths.size)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return ExchangeBatch(
        indices=torch.from_numpy(np.ascontiguousarray(g.values[keep])).to(grad.device),
        offsets=torch.from_numpy(offsets).to(grad.device),
        weights=None,
        grad=full[torch.from_numpy(np.flatnonzero(keep))],
    )


class _Exchange:
    """What one kernel's exchange sends and builds: bags' gradient columns (pooled kernels) or ids' gradient
    rows (unpooled ones)."""

    def __init__(
        self, g: _Global, layout: KernelLayout, grad: torch.Tensor, rank: int, world_size: int
    ) -> None:
        self.g, self.layout, self.rank, self.world_size = g, layout, rank, world_size
        own = np.flatnonzero(g.rank == rank)
        self._own = own
        expected = own.size if layout.unpooled else g.local
        if g.local * world_size != g.bags or grad.shape[0] != expected:
            raise SetupError(
                f"the global batch has {g.bags} bags per feature, not {world_size} ranks x {g.local} local bags "
                f"matching the output gradient's {grad.shape[0]} rows"
            )

    def needed(self, select: np.ndarray) -> List[Any]:
        if self.layout.unpooled:
            return _needed_ids(self.g, select, self.world_size)
        return _needed_bags(self.g, select, self.world_size)

    def sizes(self, needed: List[Any]) -> List[int]:
        if self.layout.unpooled:
            return [int(pos.size) * self.layout.dims[0] for pos in needed]
        return _sizes(self.layout, needed)

    def pack(self, grad: torch.Tensor, mine: Any) -> torch.Tensor:
        if self.layout.unpooled:
            return grad[torch.from_numpy(np.searchsorted(self._own, mine))].reshape(-1)
        return _pack(grad, self.layout, mine)

    def build(
        self, keep: np.ndarray, grad: torch.Tensor, needed: List[Any], recv: List[torch.Tensor]
    ) -> ExchangeBatch:
        if self.layout.unpooled:
            return _build_ids(self.g, keep, grad, self.rank, needed, recv)
        return _build(self.g, self.layout, keep, grad, self.rank, needed, recv)


def _build(
    g: _Global,
    layout: KernelLayout,
    keep: np.ndarray,
    grad: torch.Tensor,
    rank: int,
    needed: List[List[np.ndarray]],
    recv: List[torch.Tensor],
) -> ExchangeBatch:
    """The exchange batch keeping the ids selected by ``keep`` (per id of the global batch)."""
    cols = layout.columns
    full = grad.new_zeros(g.bags, layout.width)
    full[rank * g.local : (rank + 1) * g.local] = grad
    for q, per_rank in enumerate(needed):
        if q == rank:
            continue
        off = 0
        for f, b in enumerate(per_rank):
            if not b.size:
                continue
            d = layout.dims[f]
            n = int(b.size) * d
            rows = torch.from_numpy(b + q * g.local)
            full[rows, cols[f] : cols[f] + d] = recv[q][off : off + n].view(-1, d)
            off += n
    # The bags are the global bags of every feature; only the kernel's layout (F * bags bags) differs from a
    # local batch. Rows a bag reads that this rank does not hold are left out of it.
    lengths = np.bincount(g.bag[keep], minlength=g.lengths.size)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    weights = None if g.scale is None else torch.from_numpy(np.ascontiguousarray(g.scale[keep]))
    return ExchangeBatch(
        indices=torch.from_numpy(np.ascontiguousarray(g.values[keep])).to(grad.device),
        offsets=torch.from_numpy(offsets).to(grad.device),
        weights=None if weights is None else weights.to(grad.device),
        grad=full,
    )


def exchange_batches(
    layout: KernelLayout,
    global_kjt: KeyedJaggedTensor,
    grad: torch.Tensor,
    rank: int,
    world_size: int,
    shared: Sequence[torch.Tensor],
    delayed: Sequence[torch.Tensor],
    group: Optional[dist.ProcessGroup],
    delayed_group: Optional[dist.ProcessGroup],
    pinned: Optional[Sequence[int]] = None,
) -> Tuple[ExchangeBatch, Optional[DelayedExchange], int]:
    """This step's exchange batch for one kernel (see the module docstring), and the delayed part.

    A collective of every rank of ``group`` (one all-gather, also when no row is shared), plus, when some
    shared row is delayed, an asynchronous all-gather on ``delayed_group``.

    Args:
        layout: the kernel's features and tables.
        global_kjt: the step's global batch, cached features remapped to slots (every rank's bags in rank
            order).
        grad: this rank's gradient of the kernel's pooled output, (local bags, layout.width), or of its
            unpooled output, (local ids, D), already divided as TorchRec divides it.
        rank: this rank; world_size: W.
        shared: per local table, the sorted slots read by several ranks.
        delayed: per local table, the shared slots whose update is delayed (empty without delayed sync).
        group: the critical-path process group; delayed_group: the background one.
        pinned: per local table, rows pinned in its first slots (FAE's hot rows): every rank holds them, so they
            count as shared by every rank wherever the global batch reads them (never delayed).

    Returns:
        (the batch to apply now, the delayed part or ``None``, floats sent by this rank).
    """
    g = _Global(layout, global_kjt, world_size)
    ex = _Exchange(g, layout, grad, rank, world_size)
    mine = np.zeros(int(g.base[-1]), dtype=bool)
    mine[g.kslot[g.rank == rank]] = True
    everyone = np.zeros_like(mine)
    for t, n in enumerate(pinned or ()):
        everyone[g.base[t] : g.base[t] + int(n)] = True
    mine |= everyone
    late = g.mask(delayed) & ~everyone
    now_shared = (g.mask(shared) | everyone) & ~late
    needed = ex.needed(now_shared)
    sizes = ex.sizes(needed)
    _, recv = _all_gather(ex.pack(grad, needed[rank]), sizes, group, async_op=False)
    keep_now = mine[g.kslot] & ~late[g.kslot]
    now = ex.build(keep_now, grad, needed, recv)
    sent = sizes[rank]
    later = None
    if late.any():
        needed_late = ex.needed(late)
        sizes_late = ex.sizes(needed_late)
        work, recv_late = _all_gather(ex.pack(grad, needed_late[rank]), sizes_late, delayed_group, True)
        keep_late = mine[g.kslot] & late[g.kslot]
        saved = grad.clone()  # the autograd engine may reuse the gradient buffer

        def build(received: List[torch.Tensor]) -> ExchangeBatch:
            return ex.build(keep_late, saved, needed_late, received)

        later = DelayedExchange(work, recv_late, build, int(np.count_nonzero(mine & late)))
        sent += sizes_late[rank]
    return now, later, sent
