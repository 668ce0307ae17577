"""Plan validation of :class:`~torchrec_lookahead.modules.CachedEmbeddingBagCollection`.

:func:`validate_plan` checks one table's part of a :class:`~torchrec_lookahead.oracle.types.BatchPlan` against
the cache without changing anything and returns a :class:`CheckedPlan`; ``modules/_moves.py`` then writes back
the evicted rows and loads the fetched ones, one slot space at a time. ``apply_plan`` validates every table
before it moves any, so a refused plan leaves cache and stores unchanged.

Example:
    >>> import torch
    >>> from torchrec import EmbeddingBagConfig
    >>> from torchrec_lookahead.oracle.types import TablePlan
    >>> cfg = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])
    >>> t = _Table(cfg, 0, 0, 2, None, torch.tensor([3, -1]))
    >>> e = torch.empty(0, dtype=torch.long)
    >>> c = validate_plan(0, t, TablePlan(e, e, torch.tensor([5]), torch.tensor([1]), torch.tensor([0, 1])),
    ...                   None, CacheOptimizerConfig("exact_sgd"))
    >>> c.after.tolist(), c.fetch_ids.tolist()
    ([3, 5], [5])
    >>> validate_plan(0, t, TablePlan(e, e, torch.tensor([3]), torch.tensor([1]), torch.tensor([1])),
    ...               None, CacheOptimizerConfig("exact_sgd"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    torchrec_lookahead.errors.SetupError: plan step 0, table 't': fetches id 3 which is already cached; plans must ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from torchrec_lookahead.errors import CapacityError, ConfigError, DataError, InvalidIdError, SetupError
from torchrec_lookahead.modules.config import CacheOptimizerConfig
from torchrec_lookahead.modules.types import StagedRows, StagedTable
from torchrec_lookahead.oracle.types import TablePlan
from torchrec_lookahead.store import EmbeddingStore

__all__ = [
    "COUNTERS",
    "AppliedPlan",
    "CheckedPlan",
    "validate_plan",
    "check_staged",
    "check_shared_slots",
    "cached_table",
]

#: the per-table counters of ``CachedEmbeddingBagCollection.stats()``, the columns of its counts matrix
COUNTERS = ("steps", "lookups", "hits", "rows_fetched", "rows_written_back", "rows_flushed", "bytes_moved")

_SYNC_HINT = "plans must be applied in order, each once, starting from an empty cache"


@dataclass(frozen=True)
class AppliedPlan:
    """The plan a cache applied last, until the next forward consumes it: each plan covers one forward.

    Attributes:
        step: the plan's step.
        trusted: the plan came from the cache's own oracle (``apply_plan(trusted=True)``), and the batch's
            cached features were remapped with it: the forward skips its checks of their slots (the resident
            tables' ids are still checked).

    Example:
        >>> AppliedPlan(step=3, trusted=True).skips_slot_checks, AppliedPlan(3, trusted=False).skips_slot_checks
        (True, False)
    """

    step: int
    trusted: bool

    @property
    def skips_slot_checks(self) -> bool:
        """Whether the forward this plan covers skips the checks of the cached features' slots."""
        return self.trusted


@dataclass
class _Table:
    """Bookkeeping of one table."""

    config: BaseEmbeddingConfig
    group: int
    local: int
    rows: int
    store: Optional[EmbeddingStore]
    slot_to_id: Optional[torch.Tensor]
    #: the slot space whose rows the (cached) table shares with its other members
    space: Optional[str] = None

    @property
    def cached(self) -> bool:
        return self.store is not None


@dataclass(frozen=True)
class CheckedPlan:
    """One table's part of a plan, validated against the cache and ready to move (CPU int64 tensors).

    Attributes:
        evict_ids: (E,) ids written back to the store.
        evict_slots: (E,) the slots they leave.
        fetch_ids: (F,) ids loaded from the store (or from ``staged``).
        fetch_slots: (F,) the slots they go to.
        slots: the slots the batch reads.
        after: the slot map after the plan, or ``None`` for a trusted plan (the map is updated in place).
        staged: the table's pre-gathered fetch rows, or ``None`` to gather them now.
    """

    evict_ids: torch.Tensor
    evict_slots: torch.Tensor
    fetch_ids: torch.Tensor
    fetch_slots: torch.Tensor
    slots: torch.Tensor
    after: Optional[torch.Tensor]
    staged: Optional[StagedTable]


def cached_table(tables: Mapping[str, _Table], step: int, name: str) -> _Table:
    """The cached table ``name`` a plan of step ``step`` names.

    Raises:
        ConfigError: the table is unknown or resident.
    """
    t = tables.get(name)
    if t is None or t.slot_to_id is None:
        what = "resident (it has no capacity)" if t is not None else "unknown"
        cached = sorted(n for n, t in tables.items() if t.cached)
        raise ConfigError(f"plan step {step} names table '{name}' which is {what}; cached tables: {cached}")
    return t


def _bounds(arr: np.ndarray) -> Tuple[int, int]:
    """``(min, max)`` of a non-empty array (the ufuncs' reductions, without the ndarray methods' wrappers: this
    runs for every field of every plan)."""
    return int(np.minimum.reduce(arr)), int(np.maximum.reduce(arr))


def _as_index(name: str, what: str, t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, torch.Tensor) and t.dtype is torch.int64 and t.is_cpu and t.dim() == 1:
        return t  # the oracle's own plans: nothing to convert
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_floating_point() or t.is_complex():
        raise DataError(f"plan field {what} of table '{name}' must be a 1-D integer tensor but got {t!r}")
    return t.to(device="cpu", dtype=torch.int64)


def validate_plan(
    step: int,
    t: _Table,
    tp: TablePlan,
    staged: Optional[StagedRows],
    optimizer: CacheOptimizerConfig,
    trusted: bool = False,
) -> CheckedPlan:
    """Check table ``t``'s plan ``tp`` for step ``step`` against the cache; nothing changes.

    Args:
        step: the plan's step.
        t: the (cached) table.
        tp: its part of the plan.
        staged: rows gathered ahead for the step, or ``None``.
        optimizer: the fused optimizer (the layout of staged optimizer state).
        trusted: run only the cheap checks (shapes, slot and id ranges, staged rows), not the O(capacity)
            consistency checks against the cache contents.

    Returns:
        The validated plan.

    Raises:
        DataError: a field is not a 1-D integer tensor, lengths differ, or staged rows have wrong shapes.
        CapacityError: a slot is not below the table's capacity.
        InvalidIdError: an id is out of the table's range.
        SetupError: the plan does not match the cache, or staged rows do not match the plan.
    """
    name, cap, n = t.config.name, t.rows, t.config.num_embeddings
    ev_ids, ev_slots = (
        _as_index(name, "evict_ids", tp.evict_ids),
        _as_index(name, "evict_slots", tp.evict_slots),
    )
    fe_ids, fe_slots = (
        _as_index(name, "fetch_ids", tp.fetch_ids),
        _as_index(name, "fetch_slots", tp.fetch_slots),
    )
    slots = _as_index(name, "slots", tp.slots)
    if ev_ids.numel() != ev_slots.numel() or fe_ids.numel() != fe_slots.numel():
        raise DataError(
            f"plan step {step}, table '{name}': evict_ids/evict_slots ({ev_ids.numel()}/{ev_slots.numel()}) and "
            f"fetch_ids/fetch_slots ({fe_ids.numel()}/{fe_slots.numel()}) must have equal lengths"
        )
    for what, s, limit in (
        ("evict_slots", ev_slots, cap),
        ("fetch_slots", fe_slots, cap),
        ("slots", slots, cap),
        ("evict_ids", ev_ids, n),
        ("fetch_ids", fe_ids, n),
    ):
        if not s.numel():
            continue
        arr = s.numpy()  # NumPy's reductions: no intra-op threads for a plan's few hundred entries
        low, high = _bounds(arr)
        if low >= 0 and high < limit:
            continue
        bad = low if low < 0 else high
        if what.endswith("slots"):
            raise CapacityError(
                f"plan step {step}, table '{name}': {what} holds slot {bad} outside [0, {cap}) (capacity "
                f"{cap}); plan with the capacity this cache was built with",
                table=name,
                batch=step,
                needed=bad + 1 if bad >= 0 else None,
                available=cap,
            )
        raise InvalidIdError(
            f"plan step {step}, table '{name}': {what} holds id {bad} outside [0, {n})",
            table=name,
            batch=step,
            id=bad,
            num_rows=n,
        )
    s2i = t.slot_to_id
    assert s2i is not None  # cached tables only (checked by the caller)
    if trusted:
        rows = (
            check_staged(step, t, fe_ids, ev_ids, staged, optimizer, trusted=True)
            if staged is not None and fe_ids.numel()
            else None
        )
        return CheckedPlan(ev_ids, ev_slots, fe_ids, fe_slots, slots, None, rows)
    if (
        torch.unique(ev_slots).numel() != ev_slots.numel()
        or torch.unique(fe_slots).numel() != fe_slots.numel()
    ):
        raise SetupError(f"plan step {step}, table '{name}': evict_slots or fetch_slots repeat a slot")
    if torch.unique(fe_ids).numel() != fe_ids.numel():
        raise SetupError(f"plan step {step}, table '{name}': fetch_ids repeat an id")
    held = s2i.index_select(0, ev_slots)
    if not torch.equal(held, ev_ids):
        i = int((held != ev_ids).nonzero()[0])
        raise SetupError(
            f"plan step {step}, table '{name}': evicts id {int(ev_ids[i])} from slot {int(ev_slots[i])} which "
            f"holds {int(held[i])}; {_SYNC_HINT}"
        )
    after = s2i.clone()
    after[ev_slots] = -1
    occupied = after.index_select(0, fe_slots)
    if bool((occupied >= 0).any()):
        i = int((occupied >= 0).nonzero()[0])
        raise SetupError(
            f"plan step {step}, table '{name}': fetches id {int(fe_ids[i])} into slot {int(fe_slots[i])} which "
            f"still holds id {int(occupied[i])}; {_SYNC_HINT}"
        )
    dup = torch.isin(fe_ids, after[after >= 0])
    if bool(dup.any()):
        raise SetupError(
            f"plan step {step}, table '{name}': fetches id {int(fe_ids[dup][0])} which is already cached; "
            f"{_SYNC_HINT}"
        )
    after[fe_slots] = fe_ids
    if slots.numel() and bool((after.index_select(0, slots) < 0).any()):
        raise SetupError(f"plan step {step}, table '{name}': the batch reads an empty slot; {_SYNC_HINT}")
    rows = None
    if staged is not None and fe_ids.numel():
        rows = check_staged(step, t, fe_ids, ev_ids, staged, optimizer)
    return CheckedPlan(ev_ids, ev_slots, fe_ids, fe_slots, slots, after, rows)


def check_staged(
    step: int,
    t: _Table,
    fe_ids: torch.Tensor,
    ev_ids: torch.Tensor,
    staged: StagedRows,
    optimizer: CacheOptimizerConfig,
    trusted: bool = False,
) -> StagedTable:
    """Table ``t``'s staged rows, checked against the plan's fetch ids and the optimizer's state layout.

    Raises:
        SetupError: the rows are for another step or other ids, or (untrusted) the plan fetches an id it also
            evicts, so rows staged before the step are stale.
        DataError: the rows' shapes do not match the table.
    """
    name = t.config.name
    if staged.step != step:
        raise SetupError(f"staged rows are for step {staged.step} but the plan is for step {step}")
    rows = staged.tables.get(name)
    if rows is None or not torch.equal(rows.ids.to("cpu", torch.int64), fe_ids):
        raise SetupError(
            f"plan step {step}, table '{name}': staged rows do not hold the plan's fetch ids; stage with the "
            "same plan"
        )
    # The oracle never fetches an id at the step that evicts it (trusted plans skip this O(n log n) check).
    if not trusted and bool(torch.isin(fe_ids, ev_ids).any()):
        raise SetupError(
            f"plan step {step}, table '{name}': fetches an id it also evicts, so rows staged before this step "
            "are stale; apply this plan without staged rows"
        )
    widths = optimizer.state_widths(t.config.embedding_dim)
    if tuple(rows.weights.shape) != (fe_ids.numel(), t.config.embedding_dim) or set(rows.states) != set(
        widths
    ):
        raise DataError(
            f"plan step {step}, table '{name}': staged weights {tuple(rows.weights.shape)} / states "
            f"{sorted(rows.states)} do not match ({fe_ids.numel()}, {t.config.embedding_dim}) / {sorted(widths)}"
        )
    for key, w in widths.items():
        if rows.states[key].numel() != fe_ids.numel() * w:
            raise DataError(f"plan step {step}, table '{name}': staged state '{key}' has a wrong shape")
    return rows


def check_shared_slots(step: int, tables: Mapping[str, _Table], checked: Mapping[str, CheckedPlan]) -> None:
    """Refuse a plan after which two tables of one slot space would hold the same slot (the untrusted check:
    each table's own plan was checked against its own slot map by :func:`validate_plan`).

    Raises:
        SetupError: a slot held by two tables after the plan.
    """
    spaces: Dict[str, List[str]] = {}
    for name, t in tables.items():
        if t.slot_to_id is not None and t.space is not None:
            spaces.setdefault(t.space, []).append(name)
    for members in spaces.values():
        if len(members) < 2 or not any(m in checked for m in members):
            continue
        held = torch.zeros(tables[members[0]].rows, dtype=torch.int64)
        for m in members:
            c = checked.get(m)
            after = tables[m].slot_to_id if c is None or c.after is None else c.after
            assert after is not None
            held += (after >= 0).to(torch.int64)
        if bool((held > 1).any()):
            slot = int((held > 1).nonzero()[0])
            raise SetupError(
                f"plan step {step}: slot {slot} of the cache shared by tables {members} would hold rows of two "
                "tables; plan a pooled cache with its slot spaces (cache.oracle_config(), or "
                f"OracleConfig(slot_spaces=cache.slot_spaces)), or build it with cache_layout='per_table'; {_SYNC_HINT}"
            )
