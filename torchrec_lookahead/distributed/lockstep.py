"""Collectives of background threads kept in lockstep across ranks, and the id gather of a global batch.

The lookahead loader's planner thread all-gathers every rank's sparse ids (:class:`IdGatherer`) and, over
row-sharded stores, its stager thread runs row gathers (:class:`StageGathers`). Both are collectives issued by a
background thread, so a rank whose training stops (``max_steps``, an exception, a signal) must not leave its peers
inside a collective it never joins: :class:`LockstepGathers` exchanges a :class:`GatherStatus` before each one, and
the first exchange in which some rank does not bring a batch is the last one for every rank.

:func:`gather_global_kjt` is the plain (blocking) form of the id gather, used where every rank calls it for every
batch from its training thread.
"""

from __future__ import annotations

import enum
import pickle
import time
from datetime import timedelta
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.errors import DataError, SetupError

__all__ = [
    "gather_global_kjt",
    "GatherStatus",
    "LockstepGathers",
    "IdGatherer",
    "StageGathers",
]


def _local_part(kjt: KeyedJaggedTensor) -> Tuple[Any, ...]:
    """This rank's slice to all-gather as a pickled object: NumPy arrays, which pickle about ten times faster
    than tensors (those go through ``torch.save``), copied to the host (the planner thread's, off the step);
    :func:`_merge_parts` takes them back as tensors."""
    weights = kjt.weights_or_none()
    return (
        list(kjt.keys()),
        kjt.values().numpy(force=True),
        kjt.lengths().numpy(force=True),
        int(kjt.stride()),
        None if weights is None else weights.numpy(force=True),
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
    parts = [
        (
            p[0],
            torch.from_numpy(p[1]),
            torch.from_numpy(p[2]),
            p[3],
            None if p[4] is None else torch.from_numpy(p[4]),
        )
        for p in parts
    ]
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
        parts = self.gather_object(None if kjt is None else _local_part(kjt))
        return None if parts is None else _merge_parts(parts)

    def gather_object(self, obj: Any) -> Optional[List[Any]]:
        """Every rank's ``obj`` (picklable; ``None``: this rank's loader is exhausted), in rank order, under the
        same lockstep as :meth:`gather`, whose exchanges it may interleave with on the same thread (a loader
        whose own reading needs collectives, such as the cold pass of a hot/cold stream, gathers through it).

        Returns ``None`` once the gathers are over; raises as :meth:`gather`.
        """
        if self.finished:
            return None
        status = GatherStatus.BATCH if obj is not None else GatherStatus.END
        statuses, payloads = self._exchange(status, None if obj is None else pickle.dumps(obj))
        n = self.count - 1
        if all(s == GatherStatus.BATCH for s in statuses):
            return [pickle.loads(p) for p in payloads]
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
    waited for with :meth:`wait` (pass it to
    :func:`~torchrec_lookahead.store.channels.collective_channel`); the first
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
