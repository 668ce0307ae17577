"""Private: a plan as the cache applies it, one move per slot space (:class:`PreparedPlan`), the write-backs
that leave the training thread (:class:`WriteBacks`), and the rows a rank writes to stores several ranks share
(:data:`Writes`, an argument of every write: :func:`write_rows`).

The tables of a slot space share one storage in their kernel (``modules/_spaces.py``), so a step moves each
space's rows with one gather of its evicted slots and one scatter into its fetched slots, weights and every
optimizer state, whatever the number of tables in it. :func:`prepare` builds those moves from a validated plan;
it reads only what is fixed when the cache is built (layout, sizes, stores' row widths), so the planning
thread can call it for a plan of the cache's own oracle, and it counts the step's lookups, hits and traffic
there as well. :func:`move` applies them on the training thread.

Example:
    >>> import torch
    >>> from torchrec import EmbeddingBagConfig
    >>> from torchrec_lookahead.modules import CachedEmbeddingBagCollection
    >>> from torchrec_lookahead.oracle.types import BatchPlan, TablePlan
    >>> tables = [EmbeddingBagConfig(name=n, embedding_dim=4, num_embeddings=100, feature_names=[n + "_f"])
    ...           for n in ("a", "b")]
    >>> ebc = CachedEmbeddingBagCollection(tables, capacity={"a": 4, "b": 4})
    >>> e = torch.empty(0, dtype=torch.long)
    >>> plan = BatchPlan(0, {"a": TablePlan(e, e, torch.tensor([7]), torch.tensor([0]), torch.tensor([0, 0])),
    ...                      "b": TablePlan(e, e, torch.tensor([9]), torch.tensor([5]), torch.tensor([5]))})
    >>> prepared = ebc.prepare_plan(plan)
    >>> [(s.tables, s.fetch_slots.tolist()) for s in prepared.spaces]
    [(('a', 'b'), [0, 5])]
    >>> prepared.counts.tolist()  # per cached table: steps, lookups, hits, fetched, written back, flushed, bytes
    [[1, 2, 0, 1, 0, 0, 20], [1, 1, 0, 1, 0, 0, 20]]
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from torchrec_lookahead.errors import SetupError
from torchrec_lookahead.modules._kernels import _CacheKernel
from torchrec_lookahead.modules._plans import COUNTERS, CheckedPlan, _Table, check_staged
from torchrec_lookahead.modules.config import CacheOptimizerConfig
from torchrec_lookahead.modules.types import StagedRows, StagedTable
from torchrec_lookahead.store import EmbeddingStore, MmapStore, TensorStore

__all__ = [
    "SpaceMove",
    "PreparedPlan",
    "WriteBacks",
    "Writes",
    "write_rows",
    "prepare",
    "move",
    "space_rows",
    "check_prepared_staged",
    "counted",
    "flush_rows",
]

#: a counter's column in the counts matrices (a step's :attr:`PreparedPlan.counts`, the cache's totals)
_COLUMN = {k: i for i, k in enumerate(COUNTERS)}
_STEP_COLUMNS = [
    _COLUMN[k] for k in ("steps", "lookups", "hits", "rows_fetched", "rows_written_back", "bytes_moved")
]

#: per cached table, the ids of the rows this rank writes to its store (a table absent: none); ``None``: every row.
#: With several ranks the stores are shared and each row is written by one rank holding its current value
#: (LRPP's writer, or rank 0 under cDLRM's averaging): the sharded collection names them for each write.
Writes = Optional[Mapping[str, torch.Tensor]]

_NOTHING = torch.empty(0, dtype=torch.int64)

#: stores whose write-backs may land on the stager thread: host memory written by index, no tier of their own
_DEFERRABLE = (TensorStore, MmapStore)


@dataclass(frozen=True)
class SpaceMove:
    """One slot space's rows moved by one plan (CPU int64 tensors; members in the space's order).

    Attributes:
        group: the kernel holding the space.
        local: the kernel table whose storage the space's members share.
        tables: the members the plan names.
        evict_ids: per member of ``tables``, the ids it writes back.
        evict_slots: (E,) every member's evicted slots, in ``tables`` order.
        fetch_ids: per member of ``tables``, the ids it loads.
        fetch_slots: (F,) every member's fetched slots, in ``tables`` order.
        slot_updates: per member of ``tables``, (evicted slots, fetched slots) of its slot map.
    """

    group: int
    local: int
    tables: Tuple[str, ...]
    evict_ids: Tuple[torch.Tensor, ...]
    evict_slots: torch.Tensor
    fetch_ids: Tuple[torch.Tensor, ...]
    fetch_slots: torch.Tensor
    slot_updates: Tuple[Tuple[torch.Tensor, torch.Tensor], ...]


@dataclass(frozen=True)
class PreparedPlan:
    """A plan ready to apply: one :class:`SpaceMove` per slot space it names, and its counts.

    Attributes:
        step: the plan's step.
        trusted: the plan came from the cache's own oracle (see ``apply_plan(trusted=True)``).
        spaces: the moves, one per slot space the plan names.
        counts: (cached tables, len(``COUNTERS``)) int64, what the step adds to each cached table's counters
            (the cache's cached tables in its order; ``rows_flushed`` is 0).
    """

    step: int
    trusted: bool
    spaces: Tuple[SpaceMove, ...]
    counts: np.ndarray


def _cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in pinned host memory (an empty one as is)."""
    return t.pin_memory() if t.numel() else t


def prepare(
    step: int,
    trusted: bool,
    checked: Mapping[str, CheckedPlan],
    tables: Mapping[str, _Table],
    spaces: Mapping[str, Tuple[str, ...]],
    cached: Sequence[str],
    pin_memory: bool = False,
) -> PreparedPlan:
    """The moves and counts of the validated per-table plans ``checked`` (see the module docstring).

    Args:
        step: the plan's step.
        trusted: whether the plan came from the cache's own oracle.
        checked: table -> its validated plan.
        tables: the cache's tables.
        spaces: slot space -> its tables (every cached table is in one).
        cached: the cached tables in the order of ``counts``' rows.
        pin_memory: the moves' slot indices in pinned memory (a CUDA cache: :func:`move` copies them to the
            device without waiting for the copy).
    """
    moves: List[SpaceMove] = []
    counts = np.zeros((len(cached), len(COUNTERS)), dtype=np.int64)
    row = {n: i for i, n in enumerate(cached)}
    for members in spaces.values():
        named = [m for m in members if m in checked]
        if not named:
            continue
        cs = [checked[m] for m in named]
        first = tables[members[0]]
        fetch_slots = _cat([c.fetch_slots for c in cs])
        evict_slots = _cat([c.evict_slots for c in cs])
        moves.append(
            SpaceMove(
                group=first.group,
                local=first.local,
                tables=tuple(named),
                evict_ids=tuple(c.evict_ids for c in cs),
                evict_slots=_pinned(evict_slots) if pin_memory else evict_slots,
                fetch_ids=tuple(c.fetch_ids for c in cs),
                fetch_slots=_pinned(fetch_slots) if pin_memory else fetch_slots,
                slot_updates=tuple((c.evict_slots, c.fetch_slots) for c in cs),
            )
        )
        # lookups of a slot loaded at this step are misses (the members' fetched slots are distinct)
        loaded = np.zeros(first.rows, dtype=bool)
        loaded[fetch_slots.numpy()] = True
        for name, c in zip(named, cs):
            slots = c.slots.numpy()
            misses = int(np.count_nonzero(loaded[slots])) if fetch_slots.numel() else 0
            store = tables[name].store
            assert store is not None
            f, e = c.fetch_ids.numel(), c.evict_ids.numel()
            counts[row[name], _STEP_COLUMNS] = (
                1,
                slots.size,
                slots.size - misses,
                f,
                e,
                (f + e) * store.row_width * 4,
            )
    return PreparedPlan(step, trusted, tuple(moves), counts)


def space_rows(
    step: int, space: SpaceMove, staged: Optional[StagedRows], stores: Mapping[str, EmbeddingStore]
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The rows ``space`` loads, in its fetched slots' order: the stager's rows of the space when it gathered
    them as one (:func:`~torchrec_lookahead.modules.staging.stage_rows` with ``spaces``), else each member's
    staged rows (or a gather from its store now), concatenated.

    Raises:
        SetupError: the staged rows of the space are not the plan's fetches.
    """
    key = "+".join(space.tables)
    rows = None if staged is None else staged.spaces.get(key)
    if rows is not None:
        if rows.ids.numel() != space.fetch_slots.numel():
            raise SetupError(
                f"plan step {step}: the staged rows of tables {list(space.tables)} hold {rows.ids.numel()} rows "
                f"but the plan fetches {space.fetch_slots.numel()}; stage with the same plan"
            )
        return rows.weights, rows.states
    parts: List[StagedTable] = []
    for name, ids in zip(space.tables, space.fetch_ids):
        if not ids.numel():
            continue
        table = None if staged is None else staged.tables.get(name)
        if table is None:
            w, s = stores[name].gather(ids)
            table = StagedTable(ids, w, s)
        parts.append(table)
    weights = _cat([p.weights for p in parts])
    return weights, {k: _cat([p.states[k] for p in parts]) for k in parts[0].states}


def _to_host(rows: torch.Tensor, later: bool) -> torch.Tensor:
    """``rows`` in host memory: as is on the CPU; from a device, copied at once, or (``later``: the copy is read
    on another thread, after the event :func:`move` records) into pinned memory without waiting for it."""
    if rows.device.type == "cpu":
        return rows
    if not later:
        return rows.cpu()
    out = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    return out.copy_(rows, non_blocking=True)


def write_rows(
    write: Callable[..., None],
    store: EmbeddingStore,
    ids: torch.Tensor,
    weights: torch.Tensor,
    states: Mapping[str, torch.Tensor],
    allowed: Optional[torch.Tensor],
) -> None:
    """``write`` (``store``'s ``scatter`` or ``write_back``) of the rows of ``ids`` in ``allowed`` (``None``: all).
    A collective store (row-sharded over the ranks) is written even with no rows, so that every rank joins.

    Example:
        >>> from torchrec_lookahead.store import TensorStore
        >>> store = TensorStore(4, 2, {}, name="t", seed=0)
        >>> write_rows(store.scatter, store, torch.tensor([0, 1]), torch.ones(2, 2), {}, torch.tensor([1]))
        >>> store.gather(torch.tensor([0, 1]))[0][:, 0].eq(1).tolist()
        [False, True]
    """
    if allowed is None:
        write(ids, weights, states)
        return
    if store.collective:
        keep = torch.isin(ids, allowed) if allowed.numel() else torch.zeros(ids.numel(), dtype=torch.bool)
        write(ids[keep], weights[keep], {k: v[keep] for k, v in states.items()})
        return
    if allowed.numel() == 0 or ids.numel() == 0:
        return
    keep = torch.isin(ids, allowed)
    if bool(keep.all()):
        write(ids, weights, states)
    elif bool(keep.any()):
        write(ids[keep], weights[keep], {k: v[keep] for k, v in states.items()})


def write_back_job(
    space: SpaceMove,
    stores: Mapping[str, EmbeddingStore],
    weights: torch.Tensor,
    states: Mapping[str, torch.Tensor],
    copied: Optional[Any] = None,
    writes: Writes = None,
) -> Callable[[], None]:
    """The store writes of ``space``'s evicted rows (``weights`` / ``states``, gathered from the cache in its
    evicted slots' order), one per member, of the rows ``writes`` names; ``copied``: a CUDA event the rows'
    copy to the host completes (waited for first)."""

    def run() -> None:
        if copied is not None:
            copied.synchronize()
        start = 0
        for name, ids in zip(space.tables, space.evict_ids):
            n = ids.numel()
            if n:
                end = start + n
                store = stores[name]
                allowed = None if writes is None else writes.get(name, _NOTHING)
                rows = {k: v[start:end] for k, v in states.items()}
                write_rows(store.write_back, store, ids, weights[start:end], rows, allowed)
                start = end

    return run


class WriteBacks:
    """Evicted rows on their way to the stores, in plan order: the training thread puts each step's write-backs
    here (:meth:`put`), and whoever reads a store next lands them first (:meth:`land`: the stager before it
    gathers, the cache before a flush or a gather of its own).

    Example:
        >>> out = []
        >>> wb = WriteBacks()
        >>> wb.put(lambda: out.append(1)); wb.put(lambda: out.append(2))
        >>> len(wb), out
        (2, [])
        >>> wb.land(); len(wb), out
        (0, [1, 2])
    """

    def __init__(self) -> None:
        self._jobs: Deque[Callable[[], None]] = collections.deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._jobs)

    def put(self, job: Callable[[], None]) -> None:
        """Queue ``job`` (one step's store writes), after the ones already queued."""
        self._jobs.append(job)

    def land(self) -> None:
        """Run every queued job, in order (the thread calling it waits for another one already landing)."""
        with self._lock:
            while self._jobs:
                self._jobs[0]()
                self._jobs.popleft()


def check_prepared_staged(
    prepared: PreparedPlan, staged: StagedRows, tables: Mapping[str, _Table], optimizer: CacheOptimizerConfig
) -> None:
    """Refuse staged rows of another step; check each table's rows where a space's were not gathered as one.

    Raises:
        SetupError: the rows are for another step or other ids.
        DataError: the rows' shapes do not match the table.
    """
    if staged.step != prepared.step:
        raise SetupError(f"staged rows are for step {staged.step} but the plan is for step {prepared.step}")
    for space in prepared.spaces:
        if "+".join(space.tables) in staged.spaces:
            continue
        for name, fe, ev in zip(space.tables, space.fetch_ids, space.evict_ids):
            if fe.numel():
                check_staged(prepared.step, tables[name], fe, ev, staged, optimizer, trusted=True)


def deferrable(stores: Mapping[str, EmbeddingStore], space: SpaceMove) -> bool:
    """Whether ``space``'s write-backs may land later, on another thread (see ``_DEFERRABLE``)."""
    return all(type(stores[n]) in _DEFERRABLE for n in space.tables)


@torch.no_grad()
def move(
    prepared: PreparedPlan,
    staged: Optional[StagedRows],
    tables: Mapping[str, _Table],
    kernels: Sequence[_CacheKernel],
    device: torch.device,
    write_backs: Optional[WriteBacks],
    writes: Writes = None,
) -> None:
    """Apply ``prepared``: per slot space, its evicted rows gathered from the cache and written back (those
    ``writes`` names; queued on ``write_backs`` where given and the stores allow it), then its fetched rows
    scattered into the cache; the slot maps updated. Every space's write-back leaves before its fetched rows
    come in (members share slots)."""
    stores = {n: t.store for n, t in tables.items() if t.store is not None}
    for space in prepared.spaces:
        kernel = kernels[space.group]
        weights, states = kernel.weights(space.local), kernel.states(space.local)
        if space.evict_slots.numel():
            # from pinned memory (a plan prepared for a CUDA cache) the copy does not wait; else it is synchronous
            dev = space.evict_slots.to(device, non_blocking=True)
            later = write_backs is not None and deferrable(stores, space)
            rows = _to_host(weights.index_select(0, dev), later)
            rows_states = {k: _to_host(v.index_select(0, dev), later) for k, v in states.items()}
            copied = None
            if later and device.type == "cuda":
                copied = torch.cuda.Event()
                copied.record()
            job = write_back_job(space, stores, rows, rows_states, copied, writes)
            if write_backs is not None and later:
                write_backs.put(job)
            else:
                job()
        for name, (evicted, _) in zip(space.tables, space.slot_updates):
            if evicted.numel():
                slot_to_id = tables[name].slot_to_id
                assert slot_to_id is not None
                slot_to_id.index_fill_(0, evicted, -1)
        if space.fetch_slots.numel():
            fw, fs = space_rows(prepared.step, space, staged, stores)
            dev = space.fetch_slots.to(device, non_blocking=True)
            weights.index_copy_(0, dev, fw.to(device, weights.dtype, non_blocking=True))
            for k, v in states.items():
                v.index_copy_(0, dev, fs[k].reshape(-1, v.shape[1]).to(device, v.dtype, non_blocking=True))
        for name, ids, (_, fetched) in zip(space.tables, space.fetch_ids, space.slot_updates):
            if fetched.numel():
                slot_to_id = tables[name].slot_to_id
                assert slot_to_id is not None
                slot_to_id.index_copy_(0, fetched, ids)


def counted(cached: Sequence[str], counts: np.ndarray) -> Dict[str, Dict[str, int]]:
    """Per cached table its counters: its row of ``counts`` (in ``cached``'s order), by name."""
    return {n: dict(zip(COUNTERS, row)) for n, row in zip(cached, counts.tolist())}


@torch.no_grad()
def flush_rows(
    tables: Mapping[str, _Table],
    kernels: Sequence[_CacheKernel],
    device: torch.device,
    counts: np.ndarray,
    cached: Sequence[str],
    writes: Writes = None,
) -> None:
    """Write every cached row (of those ``writes`` names) and its optimizer state back to its store, then flush
    the stores (after the write-backs left to another thread have landed); the rows flushed are added to
    ``counts``, the cache's counters (rows in ``cached``'s order)."""
    for t in tables.values():
        if t.store is None or t.slot_to_id is None:
            continue
        occupied = (t.slot_to_id >= 0).nonzero().flatten()
        if occupied.numel():
            kernel = kernels[t.group]
            dev = occupied.to(device)
            write_rows(
                t.store.scatter,
                t.store,
                t.slot_to_id.index_select(0, occupied),
                kernel.weights(t.local).index_select(0, dev).cpu(),
                {k: v.index_select(0, dev).cpu() for k, v in kernel.states(t.local).items()},
                None if writes is None else writes.get(t.config.name, _NOTHING),
            )
            row = counts[cached.index(t.config.name)]
            row[_COLUMN["rows_flushed"]] += occupied.numel()
            row[_COLUMN["bytes_moved"]] += occupied.numel() * t.store.row_width * 4
        t.store.flush()
