"""Gathering the rows a plan fetches, ahead of the step (the stager's work)."""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch

from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.modules.types import StagedRows, StagedTable
from torchrec_lookahead.oracle.types import BatchPlan
from torchrec_lookahead.store.types import EmbeddingStore

__all__ = ["stage_rows"]


def stage_rows(
    plan: BatchPlan,
    stores: Mapping[str, EmbeddingStore],
    pin_memory: bool = False,
    spaces: Optional[Mapping[str, Sequence[str]]] = None,
) -> StagedRows:
    """Gather the rows a plan fetches, from the stores (safe to call from a background thread).

    The caller must make sure every write-back that could change those rows (evictions of earlier steps) has
    landed before calling: the oracle never evicts an id needed within the prefetch window, so gathering for
    step ``t`` after applying plan ``t - P - 1`` suffices.

    Args:
        plan: the step's plan.
        stores: table name -> store, for every table the plan names.
        pin_memory: copy the rows into pinned memory (for asynchronous host-to-device copies).
        spaces: the cache's slot spaces (``slot_spaces``): the rows are also gathered as one per space
            (:attr:`StagedRows.spaces`), so that the cache loads each space with one scatter.

    Returns:
        The staged rows.

    Raises:
        ConfigError: the plan names a table without a store.
        InvalidIdError: a fetch id is out of range.

    Example:
        >>> import torch
        >>> from torchrec_lookahead.oracle.types import TablePlan
        >>> from torchrec_lookahead.store import TensorStore
        >>> e = torch.empty(0, dtype=torch.long)
        >>> plan = BatchPlan(0, {"t0": TablePlan(e, e, torch.tensor([4]), torch.tensor([0]), torch.tensor([0]))})
        >>> staged = stage_rows(plan, {"t0": TensorStore(10, 4, {"momentum1": 1}, name="t0")})
        >>> staged.tables["t0"].weights.shape
        torch.Size([1, 4])
    """
    tables: Dict[str, StagedTable] = {}
    for name, table_plan in plan.tables.items():
        if name not in stores:
            raise ConfigError(
                f"plan step {plan.step} names table '{name}' but no store was given; known: {sorted(stores)}"
            )
        stores[name].at_step(plan.step)
        if table_plan.fetch_ids.numel() == 0:
            continue
        weights, states = stores[name].gather(table_plan.fetch_ids)
        if pin_memory:
            weights = weights.contiguous().pin_memory()
            states = {k: v.contiguous().pin_memory() for k, v in states.items()}
        tables[name] = StagedTable(ids=table_plan.fetch_ids, weights=weights, states=states)
    joined: Dict[str, StagedTable] = {}
    for members in (spaces or {}).values():
        named = [m for m in members if m in plan.tables]
        parts = [tables[m] for m in named if m in tables]
        if len(parts) > 1:
            joined["+".join(named)] = _joined(parts, pin_memory)
        elif parts:
            joined["+".join(named)] = parts[0]
    return StagedRows(step=plan.step, tables=tables, spaces=joined)


def _joined(parts: Sequence[StagedTable], pin_memory: bool) -> StagedTable:
    """The rows of ``parts`` as one, concatenated in order (in pinned memory with ``pin_memory``)."""
    names: Tuple[str, ...] = tuple(parts[0].states)
    weights = torch.cat([p.weights for p in parts])
    states = {k: torch.cat([p.states[k] for p in parts]) for k in names}
    if pin_memory:
        weights, states = weights.pin_memory(), {k: v.pin_memory() for k, v in states.items()}
    return StagedTable(ids=torch.cat([p.ids for p in parts]), weights=weights, states=states)
