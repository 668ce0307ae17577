"""LRPP: a logically replicated, physically partitioned cache over W data-parallel ranks (Bagpipe).

Every rank plans the *global* batch with the same oracle, so cache slots are laid out identically on every
rank without messages. What differs between ranks is which replicas of a slot hold the current row:

* a row read at step ``t`` by one rank only is updated by that rank alone; the other replicas become invalid;
* a row read by several ranks has its per-rank gradients summed in one compacted all-reduce inside the
  backward pass (exactly what TorchRec's sharded tables compute), and every reader applies the same update;
  with delayed synchronisation, the shared rows no rank reads at the next step are all-reduced in the
  background instead, and their update lands before the next plan is applied;
* before step ``t``, rows that a reading rank holds only as an invalid replica are refreshed from a rank
  holding the current row (one compacted all-reduce on the critical path);
* a row leaving the cache (eviction, flush) is written to the shared host store by one rank holding it.

:class:`LRPPTracker` derives all of this from the plans (a pure function of the plan stream, identical on every
rank); :class:`WriterFilteredStore` makes each rank write back only the rows it is responsible for.
"""

from __future__ import annotations

import enum
import pickle
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.errors import DataError, SetupError
from torchrec_lookahead.oracle.types import BatchPlan
from torchrec_lookahead.store.types import EmbeddingStore

__all__ = [
    "LRPPTablePlan",
    "LRPPPlan",
    "LRPPTracker",
    "WriterFilteredStore",
    "lowest_rank",
    "gather_global_kjt",
    "slice_samples",
    "GatherStatus",
    "LockstepGathers",
    "IdGatherer",
    "StageGathers",
]


def lowest_rank(mask: np.ndarray) -> np.ndarray:
    """Index of the lowest set bit of each int64 mask (-1 where the mask is 0).

    Example:
        >>> lowest_rank(np.array([0, 1, 6, 8])).tolist()
        [-1, 0, 1, 3]
    """
    mask = np.asarray(mask, dtype=np.int64)
    low = mask & -mask
    out = np.full(mask.shape, -1, dtype=np.int64)
    nz = low != 0
    out[nz] = np.frexp(low[nz].astype(np.float64))[1] - 1
    return out


@dataclass(frozen=True)
class LRPPTablePlan:
    """One table's synchronisation at one step.

    Attributes:
        evict_writer: (E,) rank writing back each evicted row (aligned with the plan's ``evict_ids``).
        refresh_slots: (R,) slots some reading rank holds only as an invalid replica, sorted.
        refresh_source: (R,) a rank holding each of those rows.
        shared_slots: (S,) slots read by two or more ranks, sorted: their gradients are all-reduced.
        delayed_slots: (D,) the shared slots no rank reads at the next step, sorted (a subset of
            ``shared_slots``): with delayed synchronisation their gradients are all-reduced in the background
            and their update lands before the next step's plan is applied.
        writer: (capacity,) rank responsible for writing back each slot after the step (-1: empty).
        rows_read: unique rows read at the step.
    """

    evict_writer: torch.Tensor
    refresh_slots: torch.Tensor
    refresh_source: torch.Tensor
    shared_slots: torch.Tensor
    writer: torch.Tensor
    rows_read: int
    delayed_slots: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))


@dataclass(frozen=True)
class LRPPPlan:
    """The synchronisation of one step, per cached table.

    Attributes:
        step: the plan's step.
        tables: per cached table, its synchronisation.
        features: the step's global batch (every rank's samples in rank order) with the cached features'
            values remapped to slots: each rank's backward rebuilds TorchRec's gradient order from it
            (``distributed/exact_sync.py``).
    """

    step: int
    tables: Dict[str, LRPPTablePlan] = field(default_factory=dict)
    features: Optional[KeyedJaggedTensor] = None

    def counters(self, delayed_sync: bool = False) -> Dict[str, int]:
        """Rows synchronised on the critical path (refreshed, or gradient all-reduced inside the backward),
        delayed (gradient all-reduced in the background; 0 without ``delayed_sync``) and skipped (read by one
        rank only, never synchronised)."""
        shared = sum(int(t.shared_slots.numel()) for t in self.tables.values())
        refresh = sum(int(t.refresh_slots.numel()) for t in self.tables.values())
        read = sum(t.rows_read for t in self.tables.values())
        delayed = sum(int(t.delayed_slots.numel()) for t in self.tables.values()) if delayed_sync else 0
        return {"rows_synced_critical": shared - delayed + refresh, "rows_synced_delayed": delayed,
                "rows_refreshed": refresh, "rows_grad_synced": shared, "rows_skipped": read - shared}  # fmt: skip


class LRPPTracker:
    """Replica validity per cached slot, advanced plan by plan (identical on every rank).

    Args:
        capacity: cache rows per cached table.
        num_ranks: W (at most 62).

    Example:
        >>> from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig
        >>> oracle = LookaheadOracle(OracleConfig(capacity={"t": 4}, horizon=2, num_ranks=2))
        >>> batches = [{"t": (torch.tensor([1, 2]), torch.tensor([1, 1]))},
        ...            {"t": (torch.tensor([2, 1]), torch.tensor([1, 1]))}]
        >>> tracker = LRPPTracker({"t": 4}, num_ranks=2)
        >>> ids = [b["t"][0] for b in batches]
        >>> plans = [tracker.step(p, {"t": i}) for p, i in zip(oracle.plan_stream(batches), ids)]
        >>> plans[1].tables["t"].refresh_slots.numel()  # each rank now reads the row the other one updated
        2
    """

    def __init__(self, capacity: Mapping[str, int], num_ranks: int) -> None:
        if not 1 <= num_ranks <= 62:
            raise SetupError(f"LRPP supports 1 to 62 ranks but got {num_ranks}")
        self.num_ranks = num_ranks
        self._all = (1 << num_ranks) - 1
        self._valid = {t: np.zeros(int(c), dtype=np.int64) for t, c in capacity.items()}

    def step(
        self,
        plan: BatchPlan,
        table_ids: Mapping[str, torch.Tensor],
        features: Optional[KeyedJaggedTensor] = None,
    ) -> LRPPPlan:
        """Advance over ``plan`` (whose tables carry rank annotations) and return the step's synchronisation.

        Args:
            plan: the step's global plan (``OracleConfig(num_ranks=W)``).
            table_ids: the global batch's ids per cached table, in the order of the plan's ``slots``.
            features: the global batch remapped to slots (``remap_kjt``), carried to the backward
                (:attr:`LRPPPlan.features`); a multi-rank LRPP training step needs it.
        """
        out: Dict[str, LRPPTablePlan] = {}
        for name, tp in plan.tables.items():
            valid = self._valid[name]
            ann = tp.ranks
            if ann is None:
                raise SetupError(
                    f"plan step {plan.step} has no rank annotation for table '{name}'; plan with num_ranks > 1"
                )
            ev = tp.evict_slots.numpy()
            evict_writer = lowest_rank(valid[ev])
            valid[ev] = 0
            valid[tp.fetch_slots.numpy()] = self._all
            ids = table_ids[name].numpy()
            slots = tp.slots.numpy()
            uniq_ids = ann.unique_ids.numpy()
            order = np.argsort(ids, kind="stable")
            pos = np.searchsorted(ids[order], uniq_ids)
            uslots = slots[order[pos]] if uniq_ids.size else np.zeros(0, dtype=np.int64)
            readers = ann.reader_mask.numpy()
            need = readers & ~valid[uslots]
            stale = need != 0
            refresh = uslots[stale]
            source = lowest_rank(valid[refresh])
            if (source < 0).any():
                raise SetupError(f"table '{name}' step {plan.step}: a read slot holds no valid replica")
            ro = np.argsort(refresh)
            shared = np.sort(uslots[~ann.single_rank.numpy()])
            delayed = np.sort(uslots[ann.shared_delayed.numpy()])
            valid[uslots] = readers
            out[name] = LRPPTablePlan(
                evict_writer=torch.from_numpy(evict_writer),
                refresh_slots=torch.from_numpy(refresh[ro]),
                refresh_source=torch.from_numpy(source[ro]),
                shared_slots=torch.from_numpy(shared),
                writer=torch.from_numpy(lowest_rank(valid).astype(np.int8)),
                rows_read=int(uniq_ids.size),
                delayed_slots=torch.from_numpy(delayed),
            )
        return LRPPPlan(plan.step, out, features)


class WriterFilteredStore(EmbeddingStore):
    """A view of a shared store through which a rank writes only the rows it is responsible for.

    ``allowed`` (set by the LRPP coordinator before each write-back or flush) lists the ids this rank may
    write; writes of other ids are dropped, and with ``allowed=None`` nothing is written. Reads pass through.
    Over a collective store (:class:`~torchrec_lookahead.store.RowShardedStore`) every write still reaches
    the store, with the rows this rank may write (possibly none), so that every rank joins the collective.
    """

    def __init__(self, store: EmbeddingStore) -> None:
        self.inner = store
        self.allowed: Optional[torch.Tensor] = None

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def collective(self) -> bool:
        return self.inner.collective

    @property
    def num_embeddings(self) -> int:
        return self.inner.num_embeddings

    @property
    def embedding_dim(self) -> int:
        return self.inner.embedding_dim

    @property
    def state_widths(self) -> Dict[str, int]:
        return self.inner.state_widths

    def gather(self, ids: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        return self.inner.gather(ids)

    def scatter(
        self, ids: torch.Tensor, weights: torch.Tensor, states: Optional[Mapping[str, torch.Tensor]] = None
    ) -> None:
        self._write(self.inner.scatter, ids, weights, states)

    def write_back(
        self, ids: torch.Tensor, weights: torch.Tensor, states: Optional[Mapping[str, torch.Tensor]] = None
    ) -> None:
        self._write(self.inner.write_back, ids, weights, states)

    def _write(
        self,
        write: Callable[..., None],
        ids: torch.Tensor,
        weights: torch.Tensor,
        states: Optional[Mapping[str, torch.Tensor]],
    ) -> None:
        if self.inner.collective:
            # A collective store (RowShardedStore): every rank takes part in every write, if only with no rows.
            keep = (
                torch.zeros(ids.numel(), dtype=torch.bool)
                if self.allowed is None
                else torch.isin(ids, self.allowed)
            )
            write(ids[keep], weights[keep], {k: v[keep] for k, v in (states or {}).items()})
            return
        if self.allowed is None or ids.numel() == 0:
            return
        keep = torch.isin(ids, self.allowed)
        if bool(keep.all()):
            write(ids, weights, states)
        elif bool(keep.any()):
            write(ids[keep], weights[keep], {k: v[keep] for k, v in (states or {}).items()})

    def full_weights(self) -> torch.Tensor:
        return self.inner.full_weights()

    def full_states(self) -> Dict[str, torch.Tensor]:
        return self.inner.full_states()

    def load(self, weights: torch.Tensor, states: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        self.inner.load(weights, states)

    def flush(self) -> None:
        self.inner.flush()


def _local_part(kjt: KeyedJaggedTensor) -> Tuple[Any, ...]:
    weights = kjt.weights_or_none()
    return (
        list(kjt.keys()),
        kjt.values().cpu(),
        kjt.lengths().cpu(),
        int(kjt.stride()),
        None if weights is None else weights.cpu(),
    )


def gather_global_kjt(
    kjt: KeyedJaggedTensor, world_size: int, group: Optional[dist.ProcessGroup]
) -> KeyedJaggedTensor:
    """The global batch's sparse features: every rank's slice, in rank order (ids, lengths and per-id weights;
    no dense features). A collective on ``group``; every rank must call it for every batch.

    Raises:
        DataError: the ranks' slices have different keys or batch sizes (use ``drop_last`` for the last batch).
    """
    parts: list = [None] * world_size
    dist.all_gather_object(parts, _local_part(kjt), group=group)
    return _merge_parts(parts)


def _merge_parts(parts: List[Any]) -> KeyedJaggedTensor:
    keys = parts[0][0]
    if any(p[0] != keys for p in parts):
        raise DataError(f"ranks hold different sparse features: {[p[0] for p in parts]}")
    strides = [p[3] for p in parts]
    if len(set(strides)) != 1:
        raise DataError(
            f"ranks hold slices of different sizes {strides} (a ragged final batch); the multi-rank cache needs "
            "equal slices: use drop_last=True (the default of our DataModules with several ranks)"
        )
    weighted = parts[0][4] is not None
    if any((p[4] is not None) != weighted for p in parts):
        raise DataError("some ranks' sparse features carry per-id weights and others do not")
    num_keys, stride = len(keys), strides[0]
    per_rank = []
    for p in parts:
        lengths = p[2].view(num_keys, stride)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.sum(1).cumsum(0)])
        per_rank.append((lengths, offsets))
    values, lengths_out, weights_out = [], [], []
    for i in range(num_keys):
        for p, (lengths, offsets) in zip(parts, per_rank):
            lo, hi = int(offsets[i]), int(offsets[i + 1])
            values.append(p[1][lo:hi])
            lengths_out.append(lengths[i])
            if weighted:
                weights_out.append(p[4][lo:hi])
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat(values),
        lengths=torch.cat(lengths_out),
        weights=torch.cat(weights_out) if weighted else None,
    )


def slice_samples(kjt: KeyedJaggedTensor, lo: int, hi: int) -> KeyedJaggedTensor:
    """Samples ``[lo, hi)`` of every feature of ``kjt``."""
    keys = kjt.keys()
    stride = kjt.stride()
    lengths = kjt.lengths().view(len(keys), stride)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), kjt.lengths().cumsum(0)])
    values = []
    for i in range(len(keys)):
        start = int(offsets[i * stride + lo])
        end = int(offsets[i * stride + hi])
        values.append(kjt.values()[start:end])
    weights = None
    if kjt.weights_or_none() is not None:
        w = kjt.weights()
        weights = torch.cat(
            [w[int(offsets[i * stride + lo]) : int(offsets[i * stride + hi])] for i in range(len(keys))]
        )
    return KeyedJaggedTensor(
        keys=keys, values=torch.cat(values), lengths=lengths[:, lo:hi].reshape(-1), weights=weights
    )


class GatherStatus(enum.IntEnum):
    """What a rank brings to one lockstep id all-gather."""

    BATCH = 0  #: the sparse features of its next batch
    END = 1  #: its loader is exhausted (the end of the epoch)
    STOP = 2  #: its training stopped (max_steps, an exception, a signal): no more gathers


class LockstepGathers:
    """Collectives of one background thread of every rank, kept in lockstep by a status exchanged first.

    Each exchange is one header all-gather of ``[status, payload size]`` on ``group``; the first exchange in
    which some rank does not bring :attr:`GatherStatus.BATCH` is the last one for every rank (:attr:`finished`),
    so no rank is left inside a collective its peers never join. A rank that stops calls :meth:`stop`, which
    joins the exchange its peers are in (or waits for them at the next one). Every collective of the thread is
    asynchronous and waited for with :meth:`wait`: while the rank has not stopped (``stopped()`` is false) the
    wait is unbounded (a peer's thread may be held while its training thread validates or checkpoints); once it
    has stopped, a collective that does not complete within ``stop_timeout_s`` is abandoned with a
    :class:`~torchrec_lookahead.errors.SetupError` (a peer failed or keeps training), and the exchanges are over.

    :class:`IdGatherer` (the planner's id all-gathers) and :class:`StageGathers` (the stager's row gathers) are
    built on it.

    Args:
        world_size: ranks in ``group``.
        group: the thread's process group (``None``: the default group).
        stopped: tells whether this rank's training has stopped.
        stop_timeout_s: bound of the wait once stopped.
        what: what the collectives are, for error messages (default: the class's :attr:`what`).
    """

    #: what the collectives are, for error messages
    what = "collective"

    def __init__(
        self,
        world_size: int,
        group: Optional[dist.ProcessGroup],
        stopped: Callable[[], bool],
        stop_timeout_s: float = 60.0,
        what: Optional[str] = None,
    ) -> None:
        self.world_size = world_size
        self.group = group
        self.stopped = stopped
        self.stop_timeout_s = float(stop_timeout_s)
        if what is not None:
            self.what = what
        self.count = 0
        self.finished = False
        self.peer_stopped: List[int] = []
        #: the error of an abandoned wait (see :meth:`wait`), once one was abandoned
        self.timed_out: Optional[SetupError] = None

    def stop(self, status: GatherStatus = GatherStatus.STOP) -> None:
        """Tell the peers that this rank stops (one exchange with ``status``, ``STOP`` or ``END``, unless the
        exchanges are already over).

        Raises:
            SetupError: the peers did not join within ``stop_timeout_s``.
        """
        if self.finished:
            return
        self.finished = True
        self._statuses(status, 0)

    def wait(self, work: Any, what: str) -> None:
        """Wait for the asynchronous collective ``work`` (see the class docstring for the bound).

        Raises:
            SetupError: this rank stopped and ``work`` did not complete within ``stop_timeout_s``.
        """
        deadline: Optional[float] = None
        while True:
            try:
                work.wait(timeout=timedelta(seconds=0.2))
                return
            except RuntimeError as e:
                if work.is_completed():
                    # It finished as the bounded wait expired (likely on a loaded machine): an unbounded wait
                    # returns at once, or raises the collective's own error. Treating the expired wait as a
                    # failure here would leave this rank one collective behind its peers.
                    work.wait()
                    return
                if "timed out" not in str(e).lower():
                    raise
            if self.stopped():
                now = time.monotonic()
                deadline = deadline if deadline is not None else now + self.stop_timeout_s
                if now >= deadline:
                    self.finished = True
                    self.timed_out = SetupError(
                        f"{self.what} {self.count - 1} ({what}) was not joined by every rank within "
                        f"{self.stop_timeout_s:g} s after this rank stopped training: another rank failed, or "
                        "keeps training past the step at which this one stopped (every rank must stop at the "
                        "same step)"
                    )
                    raise self.timed_out

    def _statuses(self, status: GatherStatus, size: int) -> Tuple[List[int], List[int]]:
        """One header exchange: every rank's status and payload size."""
        self.count += 1
        header = torch.tensor([int(status), size], dtype=torch.int64)
        headers = [torch.zeros(2, dtype=torch.int64) for _ in range(self.world_size)]
        self.wait(dist.all_gather(headers, header, group=self.group, async_op=True), f"status {status.name}")
        return [int(h[0]) for h in headers], [int(h[1]) for h in headers]


class IdGatherer(LockstepGathers):
    """The id all-gathers of one epoch of the lookahead loader's planner thread, kept in lockstep.

    Every gather carries, besides the rank's sparse ids, a :class:`GatherStatus`. The first gather in which any
    rank does not bring a batch is the last one for every rank, so all ranks stop at the same gather and no rank
    is left inside an all-gather its peers never join:

    * every rank ``END``: the epoch is over;
    * some ranks ``END`` and others ``BATCH``: the ranks' loaders have different lengths (a ragged or missing
      final slice): :class:`~torchrec_lookahead.errors.DataError` on every rank;
    * some rank ``STOP``: that rank stopped training; the others end their plan stream there (with the ranks
      stopping in lockstep, as at ``max_steps``, no rank ever asks for a batch beyond it).

    A rank that stops calls :meth:`stop`, which joins the gather its peers are in (or waits for them at the
    next one). Each gather is one header all-gather (status and payload size) and, when every rank brings a
    batch, one payload all-gather, both asynchronous: while the rank has not stopped, the wait is unbounded (a
    peer's planner may be held by a full queue while its training thread validates or checkpoints); once it
    has stopped (``stopped()`` is true), a gather that does not complete within ``stop_timeout_s`` is
    abandoned with a :class:`~torchrec_lookahead.errors.SetupError` (a peer failed or keeps training).

    Args:
        world_size: ranks in ``group``.
        group: the planner thread's gloo process group (``None``: the default group).
        stopped: tells whether this rank's training has stopped.
        stop_timeout_s: bound of the wait once stopped.
    """

    what = "id all-gather of the lookahead planner"

    def gather(self, kjt: Optional[KeyedJaggedTensor]) -> Optional[KeyedJaggedTensor]:
        """The global batch (``kjt``: this rank's slice; ``None``: its loader is exhausted), or ``None`` once
        the gathers are over (every rank at the end of its loader, or some rank stopped: see
        :attr:`peer_stopped`).

        Raises:
            DataError: the ranks' loaders have different lengths, or their slices differ in keys or sizes.
            SetupError: this rank stopped and its peers did not join within ``stop_timeout_s``.
        """
        if self.finished:
            return None
        status = GatherStatus.BATCH if kjt is not None else GatherStatus.END
        statuses, payloads = self._exchange(status, None if kjt is None else pickle.dumps(_local_part(kjt)))
        n = self.count - 1
        if all(s == GatherStatus.BATCH for s in statuses):
            return _merge_parts([pickle.loads(p) for p in payloads])
        self.finished = True
        self.peer_stopped = [r for r, s in enumerate(statuses) if s == GatherStatus.STOP]
        if self.peer_stopped:
            return None
        ended = [r for r, s in enumerate(statuses) if s == GatherStatus.END]
        if len(ended) == self.world_size:
            return None
        raise DataError(
            f"the ranks' training loaders have different lengths: ranks {ended} have no batch {n} while ranks "
            f"{[r for r in range(self.world_size) if r not in ended]} have one (a ragged or empty final slice); "
            "every rank must read the same number of batches: use drop_last=True (the default of this "
            "package's DataModules with several ranks) or pad the data"
        )

    def _exchange(self, status: GatherStatus, payload: Optional[bytes]) -> Tuple[List[int], List[bytes]]:
        statuses, sizes = self._statuses(status, 0 if payload is None else len(payload))
        if any(s != GatherStatus.BATCH for s in statuses):
            return statuses, []
        size = max(sizes)
        buf = torch.zeros(size, dtype=torch.uint8)
        assert payload is not None
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        bufs = [torch.empty(size, dtype=torch.uint8) for _ in range(self.world_size)]
        self.wait(dist.all_gather(bufs, buf, group=self.group, async_op=True), "ids")
        return statuses, [b[:n].numpy().tobytes() for b, n in zip(bufs, sizes)]


class StageGathers(LockstepGathers):
    """The row gathers of one epoch of the lookahead loader's stager thread over collective stores (a
    :class:`~torchrec_lookahead.store.RowShardedStore`), kept in lockstep.

    Before the store collectives of each plan, every rank's stager exchanges a status (:meth:`begin`): when
    every rank brings ``BATCH``, all of them run the plan's store gathers (the same tables, in the same order),
    waited for with :meth:`wait` (pass it to :func:`~torchrec_lookahead.store.collective_channel`); the first
    exchange in which some rank brings ``STOP`` (its training stopped) or ``END`` (its plan stream ended) is the
    last one for every rank, so no stager is left inside a store gather its peers never join. A stager that
    stops or runs out of plans calls :meth:`stop`. The waits are bounded once this rank has stopped training,
    as for the planner's :class:`IdGatherer`.

    Args:
        world_size: ranks of the stores' stager group.
        group: the process group the stores run the stager's collectives on (their ``STAGE_CHANNEL`` group).
        stopped: tells whether this rank's training has stopped.
        stop_timeout_s: bound of the wait once stopped.
    """

    what = "row gather of the lookahead stager"

    def begin(self) -> bool:
        """Before one plan's store gathers: ``True`` when every rank gathers it, ``False`` once the gathers are
        over (some rank stopped or ran out of plans: see :attr:`peer_stopped`; this rank then gathers no more).

        Raises:
            SetupError: this rank stopped and its peers did not join within ``stop_timeout_s``.
        """
        if self.finished:
            return False
        statuses, _ = self._statuses(GatherStatus.BATCH, 0)
        if all(s == GatherStatus.BATCH for s in statuses):
            return True
        self.finished = True
        self.peer_stopped = [r for r, s in enumerate(statuses) if s != GatherStatus.BATCH]
        return False
