"""LRPP: a logically replicated, physically partitioned cache over W data-parallel ranks (Bagpipe).

Every rank plans the *global* batch with the same oracle, so cache slots are laid out identically on every
rank without messages. What differs between ranks is which replicas of a slot hold the current row:

* a row read at step ``t`` by one rank only is updated by that rank alone; the other replicas become invalid;
* a row read by several ranks has the gradients of the other ranks' bags that read it brought to each reader
  in one compacted all-gather inside the backward pass, and every reader sums them in TorchRec's order and
  applies the same update (exactly what TorchRec's sharded tables compute;
  :mod:`~torchrec_lookahead.distributed.exact_sync`); with delayed synchronisation, the gradients of the shared
  rows no rank reads at the next step are all-gathered in the background instead, and their update lands
  before the next plan is applied;
* before step ``t``, rows that a reading rank holds only as an invalid replica are refreshed from a rank
  holding the current row (one compacted all-reduce on the critical path);
* a row leaving the cache (eviction, flush) is written to the shared host store by one rank holding it.

:class:`LRPPTracker` derives all of this from the plans (a pure function of the plan stream, identical on every
rank); the sharded collection hands each write-back and flush the rows this rank writes (``writes=``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.distributed.exact_sync import ExchangeIndex, ExchangeSpec, exchange_index
from torchrec_lookahead.errors import SetupError
from torchrec_lookahead.oracle.types import BatchPlan, RankAnnotation

__all__ = [
    "LRPPTablePlan",
    "LRPPPlan",
    "LRPPTracker",
    "lowest_rank",
    "slice_samples",
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
        shared_slots: (S,) slots read by two or more ranks, sorted: their gradients are all-gathered.
        delayed_slots: (D,) the shared slots no rank reads at the next step, sorted (a subset of
            ``shared_slots``): with delayed synchronisation their gradients are all-gathered in the background
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
        pinned: per cached table, the slots of its pinned rows as (first slot, rows) (FAE's hot rows,
            :class:`~torchrec_lookahead.fae.PinnedRows`): every rank holds them, so every rank updates every
            pinned row the global batch reads, from every bag that reads it.
        exchange: per cache kernel (keyed by its tables, in its order), the id part of its backward's exchange
            on this rank, built ahead by :meth:`with_exchanges` (the planner thread); a kernel without one
            builds it in its backward.
    """

    step: int
    tables: Dict[str, LRPPTablePlan] = field(default_factory=dict)
    features: Optional[KeyedJaggedTensor] = None
    pinned: Dict[str, Tuple[int, int]] = field(default_factory=dict)
    exchange: Dict[Tuple[str, ...], ExchangeIndex] = field(default_factory=dict)

    def with_exchanges(self, specs: Sequence[ExchangeSpec], rank: int, world_size: int) -> LRPPPlan:
        """This plan with the exchange index of every kernel of ``specs`` on ``rank``
        (:func:`~torchrec_lookahead.distributed.exact_sync.exchange_index`), built from :attr:`features` and the
        tables' shared, delayed and pinned slots, so that the backward only moves gradients. Kernels whose
        tables the plan does not cover are left out; without :attr:`features` the plan is returned as is.

        Raises:
            SetupError: a kernel's feature is missing from :attr:`features`.
        """
        if self.features is None or not specs:
            return self
        out = dict(self.exchange)
        for spec in specs:
            names = tuple(spec.layout.tables)
            if not all(t in self.tables for t in names):
                continue
            plans = [self.tables[t] for t in names]
            out[names] = exchange_index(
                spec,
                self.features,
                rank,
                world_size,
                [tp.shared_slots for tp in plans],
                [tp.delayed_slots for tp in plans],
                [self.pinned.get(t, (0, 0)) for t in names],
            )
        return replace(self, exchange=out)

    def counters(self, delayed_sync: bool = False) -> Dict[str, int]:
        """Rows synchronised on the critical path (refreshed, or gradient all-gathered inside the backward),
        delayed (gradient all-gathered in the background; 0 without ``delayed_sync``) and skipped (read by one
        rank only, never synchronised)."""
        shared = sum(int(t.shared_slots.numel()) for t in self.tables.values())
        refresh = sum(int(t.refresh_slots.numel()) for t in self.tables.values())
        read = sum(t.rows_read for t in self.tables.values())
        delayed = sum(int(t.delayed_slots.numel()) for t in self.tables.values()) if delayed_sync else 0
        return {
            "rows_synced_critical": shared - delayed + refresh,
            "rows_synced_delayed": delayed,
            "rows_refreshed": refresh,
            "rows_grad_synced": shared,
            "rows_skipped": read - shared,
        }


_E = torch.zeros(0, dtype=torch.int64)
_NO_READERS = RankAnnotation(_E, _E, _E.bool(), _E.bool(), _E.bool())


class LRPPTracker:
    """Replica validity per cached slot, advanced plan by plan (identical on every rank).

    Args:
        capacity: per cached table, the rows of the cache its slots index (its slot space's).
        num_ranks: W (at most 62).
        pinned: per cached table, the slots of its pinned rows as (first slot, rows): valid on every rank
            throughout (their updates are applied by every rank), written back by rank 0; the plans never move
            them.

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

    def __init__(
        self,
        capacity: Mapping[str, int],
        num_ranks: int,
        pinned: Optional[Mapping[str, Tuple[int, int]]] = None,
    ) -> None:
        if not 1 <= num_ranks <= 62:
            raise SetupError(f"LRPP supports 1 to 62 ranks but got {num_ranks}")
        self.num_ranks = num_ranks
        self._all = (1 << num_ranks) - 1
        self._valid = {t: np.zeros(int(c), dtype=np.int64) for t, c in capacity.items()}
        self.pinned = {t: (int(a), int(n)) for t, (a, n) in (pinned or {}).items() if n}
        for t, (a, n) in self.pinned.items():
            self._valid[t][a : a + n] = self._all

    def writers(self) -> Dict[str, torch.Tensor]:
        """Per cached table, the rank writing back each slot now (-1: empty), as in :attr:`LRPPTablePlan.writer`."""
        return {t: torch.from_numpy(lowest_rank(v).astype(np.int8)) for t, v in self._valid.items()}

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
            if (
                ann is None
                and self.pinned.get(name)
                and not (tp.fetch_slots.numel() or tp.evict_slots.numel())
            ):
                ann = (
                    _NO_READERS  # only pinned rows of this table at this step: nothing for the oracle to plan
                )
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
            order = np.argsort(ids)  # an id's lookups share its slot: whichever is found, the same slot
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
        return LRPPPlan(plan.step, out, features, dict(self.pinned))


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
