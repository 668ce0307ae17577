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

Everything but the gradient is known once the step is planned, so the work is split in two.
:func:`exchange_index` (the planner thread, beside the step's LRPP plan) builds an :class:`ExchangeIndex`: which
rows are shared, delayed or pinned, which bags (or ids) each rank sends, where received gradients go, and the
exchange batches' indices, offsets and weights. :func:`exchange` (the backward hook, on the training thread)
then packs this rank's gradient by the precomputed positions, all-gathers it, places what it received and
returns the batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead._arrays import sorted_unique
from torchrec_lookahead.errors import DataError, SetupError

__all__ = [
    "KernelLayout",
    "ExchangeSpec",
    "GatherIndex",
    "ExchangeIndex",
    "ExchangeBatch",
    "DelayedExchange",
    "PendingExchange",
    "exchange_index",
    "exchange",
]


@dataclass(frozen=True)
class KernelLayout:
    """The features of one cache kernel, in the kernel's order.

    Attributes:
        features: feature names, in the kernel's order.
        feature_table: the kernel's local table of each feature.
        tables: the cached table name of each local table.
        capacity: cache rows of each local table (its slot space's: tables sharing one each index all its rows).
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
            raise DataError(
                f"features {missing} are missing from the step's global batch; give every batch the features the "
                "model was built with"
            )
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


def _bag_floats(
    g: _Global, layout: KernelLayout, select: np.ndarray, world_size: int
) -> Tuple[List[int], List[np.ndarray]]:
    """The gradient floats of the bags holding a row selected by ``select`` (per kernel slot): per rank, how many,
    and their positions in the flattened full gradient (global bags, ``layout.width`` columns), in the order the
    rank sends them: feature after feature, bag after bag (ascending), each bag's feature columns in order."""
    bags = sorted_unique(g.bag[select[g.kslot]])  # sorted: feature-major, then global bag (rank, local bag)
    feature = bags // g.bags
    within = bags % g.bags
    rank = within // max(g.local, 1)
    order = np.argsort(rank, kind="stable")  # rank-major, the (feature, bag) order kept within a rank
    feature, within, rank = feature[order], within[order], rank[order]
    dims = np.asarray(layout.dims, dtype=np.int64)[feature]
    first = within * layout.width + np.asarray(layout.columns, dtype=np.int64)[feature]
    # each bag's run of dims[i] consecutive positions, from first[i]
    runs = np.cumsum(dims) - dims
    pos = np.repeat(first - runs, dims) + np.arange(int(dims.sum()), dtype=np.int64)
    sizes = [int(dims[rank == q].sum()) for q in range(world_size)]
    bounds = np.cumsum([0, *sizes])
    return sizes, [pos[bounds[q] : bounds[q + 1]] for q in range(world_size)]


def _needed_ids(g: _Global, select: np.ndarray, world_size: int) -> List[np.ndarray]:
    """Per rank, the positions in the global batch of the rank's ids selected by ``select`` (unpooled)."""
    hit = select[g.kslot]
    return [np.flatnonzero(hit & (g.rank == q)) for q in range(world_size)]


def _flat(rows: np.ndarray, width: int, first: int, count: int) -> np.ndarray:
    """Positions in a flattened (rows, ``width``) tensor of columns ``[first, first + count)`` of ``rows``, row
    after row."""
    return (rows[:, None] * width + (first + np.arange(count, dtype=np.int64))).reshape(-1)


_NONE = np.zeros(0, dtype=np.int64)


def _all_gather(
    send: torch.Tensor, sizes: Sequence[int], group: Optional[dist.ProcessGroup], async_op: bool
) -> Tuple[Any, List[torch.Tensor]]:
    """All-gather of unequal flat buffers (padded to the largest, at least one element)."""
    width = max(max(sizes), 1)
    buf = send.new_zeros(width)
    buf[: send.numel()] = send
    recv = [send.new_empty(width) for _ in sizes]
    work = dist.all_gather(recv, buf, group=group, async_op=async_op)
    return work, recv


def _width(layout: KernelLayout) -> int:
    """Columns of a kernel's output gradient: its features' dimensions (pooled), one id's (unpooled)."""
    if layout.unpooled:
        return layout.dims[0] if layout.dims else 0
    return layout.width


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device)


@dataclass(frozen=True)
class ExchangeSpec:
    """What the planner thread needs of one kernel to index its exchange ahead of the backward
    (:func:`exchange_index`).

    Attributes:
        layout: the kernel's features and tables.
        delayed_sync: the shared rows no rank reads at the next step go to a delayed exchange.
    """

    layout: KernelLayout
    delayed_sync: bool


@dataclass(frozen=True, eq=False)
class GatherIndex:
    """One all-gather of an exchange and the batch built from it, without the gradient: which floats of its
    gradient this rank sends, where the floats it receives go, and the batch's kernel inputs.

    Attributes:
        sizes: floats each rank sends (the all-gather pads them to the largest).
        send: positions, in this rank's flattened output gradient, of the floats it sends, in order.
        place: per rank, positions in the flattened full gradient of the floats received from it (empty for
            this rank).
        select: rows of the full gradient the batch keeps (an unpooled kernel's ids); ``None``: every row
            (a pooled kernel's global bags).
        indices: the batch's slot ids (int64), in the kernel's concatenated capacity's tables.
        offsets: the batch's bag offsets (int64), ``F * bags + 1`` of them.
        weights: per id, its float32 scale (weights, or MEAN pooling's ``1 / L``); ``None``: none.
    """

    sizes: Tuple[int, ...]
    send: torch.Tensor
    place: Tuple[torch.Tensor, ...]
    select: Optional[torch.Tensor]
    indices: torch.Tensor
    offsets: torch.Tensor
    weights: Optional[torch.Tensor]


@dataclass(frozen=True, eq=False)
class ExchangeIndex:
    """Everything of one kernel's exchange at one step that depends on the ids alone (the global batch
    remapped to slots, the layout, the shared, delayed and pinned slots, the rank and the world size), built
    ahead of the backward by :func:`exchange_index`; :func:`exchange` then only moves the gradient.

    Attributes:
        spec: the kernel it was built for.
        rank: this rank; world_size: W.
        bags: the global batch's bags per feature; local: per rank.
        grad_rows: rows of this rank's output gradient (its local bags, or its ids for an unpooled kernel).
        full_rows: rows of the full gradient the batches are built on (the global bags, or the global ids).
        own: rows of the full gradient that hold this rank's own gradient, in its order (an unpooled kernel's);
            ``None``: the rows ``[rank * local, (rank + 1) * local)`` (a pooled kernel's local bags).
        now: the critical exchange (applied in the backward).
        late: the delayed exchange (``None`` when no shared row is delayed).
        late_rows: rows of this rank the delayed batch updates.
    """

    spec: ExchangeSpec
    rank: int
    world_size: int
    bags: int
    local: int
    grad_rows: int
    full_rows: int
    own: Optional[torch.Tensor]
    now: GatherIndex
    late: Optional[GatherIndex]
    late_rows: int

    @property
    def width(self) -> int:
        """Columns of the output gradient."""
        return _width(self.spec.layout)

    def check(self, grad: torch.Tensor) -> None:
        """Raises ``SetupError`` unless ``grad`` is this rank's output gradient of the indexed batch."""
        if self.local * self.world_size != self.bags:
            raise SetupError(
                f"the global batch has {self.bags} bags per feature, not {self.world_size} ranks x {self.local} "
                "local bags"
            )
        if tuple(grad.shape) != (self.grad_rows, self.width):
            raise SetupError(
                f"the output gradient has shape {tuple(grad.shape)} but rank {self.rank}'s part of the step's "
                f"global batch needs ({self.grad_rows}, {self.width})"
            )

    def batch(self, part: GatherIndex, grad: torch.Tensor, recv: Sequence[torch.Tensor]) -> ExchangeBatch:
        """The exchange batch of ``part``: this rank's gradient and the received floats placed in the global
        batch's rows, with ``part``'s kernel inputs."""
        device = grad.device
        full = grad.new_zeros(self.full_rows, self.width)
        if self.own is None:
            full[self.rank * self.local : (self.rank + 1) * self.local] = grad
        else:
            full[_on(self.own, device)] = grad
        flat = full.view(-1)
        for q, pos in enumerate(part.place):
            n = int(pos.numel())
            if q != self.rank and n:
                flat.index_copy_(0, _on(pos, device), recv[q][:n])
        return ExchangeBatch(
            indices=_on(part.indices, device),
            offsets=_on(part.offsets, device),
            weights=None if part.weights is None else _on(part.weights, device),
            grad=full if part.select is None else full[_on(part.select, device)],
        )


def _gather_index(
    g: _Global,
    layout: KernelLayout,
    select: np.ndarray,
    keep: np.ndarray,
    rank: int,
    world_size: int,
    own_ids: np.ndarray,
    width: int,
) -> GatherIndex:
    """The all-gather of the bags (or ids) holding a row selected by ``select`` (per kernel slot), and the batch
    keeping the global batch's ids selected by ``keep`` (per id)."""
    if layout.unpooled:  # whole gradient rows of ids; this rank's rows are its ids in global order
        needed = _needed_ids(g, select, world_size)
        sizes = [int(pos.size) * width for pos in needed]
        send = _flat(np.searchsorted(own_ids, needed[rank]).astype(np.int64), width, 0, width)
        floats = [_flat(pos, width, 0, width) for pos in needed]
        selected: Optional[torch.Tensor] = torch.from_numpy(np.flatnonzero(keep).astype(np.int64))
        weights = None
    else:  # feature columns of bags; this rank's rows are its local bags
        sizes, floats = _bag_floats(g, layout, select, world_size)
        send = floats[rank] - rank * g.local * width
        selected = None
        weights = None if g.scale is None else torch.from_numpy(np.ascontiguousarray(g.scale[keep]))
    place = tuple(torch.from_numpy(_NONE if q == rank else pos) for q, pos in enumerate(floats))
    # The bags are the global bags of every feature; only the kernel's layout (F * bags bags) differs from a
    # local batch. Rows a bag reads that this rank does not hold are left out of it.
    lengths = np.bincount(g.bag[keep], minlength=g.lengths.size)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return GatherIndex(
        sizes=tuple(sizes),
        send=torch.from_numpy(np.ascontiguousarray(send, dtype=np.int64)),
        place=place,
        select=selected,
        indices=torch.from_numpy(np.ascontiguousarray(g.values[keep])),
        offsets=torch.from_numpy(offsets),
        weights=weights,
    )


def exchange_index(
    spec: ExchangeSpec,
    global_kjt: KeyedJaggedTensor,
    rank: int,
    world_size: int,
    shared: Sequence[torch.Tensor],
    delayed: Sequence[torch.Tensor],
    pinned: Optional[Sequence[Tuple[int, int]]] = None,
) -> ExchangeIndex:
    """The id part of one kernel's exchange at one step (see the module docstring): built on the planner thread
    when the step's LRPP plan is made, so that the backward only moves gradients (:func:`exchange`).

    Args:
        spec: the kernel's layout and whether its delayed rows are split off.
        global_kjt: the step's global batch, cached features remapped to slots (every rank's bags in rank
            order).
        rank: this rank; world_size: W.
        shared: per local table, the sorted slots read by several ranks.
        delayed: per local table, the shared slots whose update is delayed (ignored without
            ``spec.delayed_sync``).
        pinned: per local table, the slots of its pinned rows as (first slot, rows) (FAE's hot rows): every rank
            holds them, so they count as shared by every rank wherever the global batch reads them (never
            delayed).

    Raises:
        SetupError: a feature of the kernel is missing from the global batch.
    """
    layout = spec.layout
    g = _Global(layout, global_kjt, world_size)
    own_ids = np.flatnonzero(g.rank == rank)
    width = _width(layout)
    mine = np.zeros(int(g.base[-1]), dtype=bool)
    mine[g.kslot[g.rank == rank]] = True
    everyone = np.zeros_like(mine)
    for t, (first, n) in enumerate(pinned or ()):
        everyone[g.base[t] + int(first) : g.base[t] + int(first) + int(n)] = True
    mine |= everyone
    late = (g.mask(delayed) if spec.delayed_sync else np.zeros_like(mine)) & ~everyone
    now_shared = (g.mask(shared) | everyone) & ~late
    keep_now = mine[g.kslot] & ~late[g.kslot]
    now = _gather_index(g, layout, now_shared, keep_now, rank, world_size, own_ids, width)
    later, late_rows = None, 0
    if late.any():
        keep_late = mine[g.kslot] & late[g.kslot]
        later = _gather_index(g, layout, late, keep_late, rank, world_size, own_ids, width)
        late_rows = int(np.count_nonzero(mine & late))
    unpooled = layout.unpooled
    return ExchangeIndex(
        spec=spec,
        rank=rank,
        world_size=world_size,
        bags=g.bags,
        local=g.local,
        grad_rows=int(own_ids.size) if unpooled else g.local,
        full_rows=int(g.values.size) if unpooled else g.bags,
        own=torch.from_numpy(own_ids.astype(np.int64)) if unpooled else None,
        now=now,
        late=later,
        late_rows=late_rows,
    )


def exchange(
    index: ExchangeIndex,
    grad: torch.Tensor,
    group: Optional[dist.ProcessGroup],
    delayed_group: Optional[dist.ProcessGroup],
) -> Tuple[ExchangeBatch, Optional[DelayedExchange], int]:
    """This step's exchange batch for one kernel, and the delayed part, from its precomputed ``index``: the
    backward's part of the exchange, which moves only the gradient (packs this rank's floats, all-gathers them,
    places the received ones).

    A collective of every rank of ``group`` (one all-gather, also when no row is shared), plus, when some
    shared row is delayed, an asynchronous all-gather on ``delayed_group``.

    Args:
        index: the kernel's exchange at this step (:func:`exchange_index`).
        grad: this rank's gradient of the kernel's pooled output, (local bags, layout.width), or of its
            unpooled output, (local ids, D), already divided as TorchRec divides it.
        group: the critical-path process group; delayed_group: the background one.

    Returns:
        (the batch to apply now, the delayed part or ``None``, floats sent by this rank).

    Raises:
        SetupError: ``grad`` is not this rank's gradient of the indexed batch.
    """
    index.check(grad)
    flat = grad.reshape(-1)
    now = index.now
    _, recv = _all_gather(flat[_on(now.send, grad.device)], now.sizes, group, async_op=False)
    batch = index.batch(now, grad, recv)
    sent = now.sizes[index.rank]
    later = None
    late = index.late
    if late is not None:
        work, recv_late = _all_gather(flat[_on(late.send, grad.device)], late.sizes, delayed_group, True)
        saved = grad.clone()  # the autograd engine may reuse the gradient buffer

        def build(received: List[torch.Tensor]) -> ExchangeBatch:
            return index.batch(late, saved, received)

        later = DelayedExchange(work, recv_late, build, index.late_rows)
        sent += late.sizes[index.rank]
    return batch, later, sent
