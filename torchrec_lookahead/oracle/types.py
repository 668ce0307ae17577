"""Plan types shared by the oracle (which produces them) and the cache (which applies them).

A plan for step ``t`` is applied in order: write back ``evict_ids`` from ``evict_slots``, load ``fetch_ids``
into ``fetch_slots``, then run the step on the batch with every id replaced by its entry in ``slots``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

__all__ = ["TablePlan", "BatchPlan", "RankAnnotation", "describe_window"]


def describe_window(lo: int, hi: int, prefetch_depth: int) -> str:
    """Words for the prefetch window ``lo..hi`` whose rows must be in the cache together (error messages).

    Example:
        >>> describe_window(0, 0, 1)
        'batch 0'
        >>> describe_window(3, 5, 2)
        'batches 3..5 (batch 5 and the prefetch_depth=2 batches before it, whose rows are in the cache together)'
    """
    if lo == hi:
        return f"batch {hi}"
    return (
        f"batches {lo}..{hi} (batch {hi} and the prefetch_depth={prefetch_depth} batch"
        f"{'es' if hi - lo > 1 else ''} before it, whose rows are in the cache together)"
    )


@dataclass(frozen=True)
class RankAnnotation:
    """Which ranks read each planned id of one table at one step (for LRPP synchronisation).

    Attributes:
        unique_ids: (U,) the distinct ids of the table in the global batch, sorted ascending.
        reader_mask: (U,) int64 bit mask, bit r set when rank r's slice reads the id.
        single_rank: (U,) bool, read by exactly one rank (updated locally, never synchronised).
        shared_next: (U,) bool, read by several ranks and needed again at the next step (critical path);
            with horizon 0 the next step is unknown when a step is planned, and every shared id is labelled so.
        shared_delayed: (U,) bool, read by several ranks and not needed at the next step (delayed sync).
    """

    unique_ids: torch.Tensor
    reader_mask: torch.Tensor
    single_rank: torch.Tensor
    shared_next: torch.Tensor
    shared_delayed: torch.Tensor


@dataclass(frozen=True)
class TablePlan:
    """What to do for one cached table at one step.

    Attributes:
        evict_ids: (E,) ids to write back to the store before the step.
        evict_slots: (E,) the cache slots those ids occupy.
        fetch_ids: (F,) ids to load from the store before the step.
        fetch_slots: (F,) the cache slots to load them into.
        slots: (N,) the cache slot of every input id, in input order.
        ranks: optional multi-rank annotation.
    """

    evict_ids: torch.Tensor
    evict_slots: torch.Tensor
    fetch_ids: torch.Tensor
    fetch_slots: torch.Tensor
    slots: torch.Tensor
    ranks: Optional[RankAnnotation] = None


@dataclass(frozen=True)
class BatchPlan:
    """The plan of one step: a :class:`TablePlan` per cached table.

    Attributes:
        step: index of the batch in the stream (0-based).
        tables: table name -> plan.
    """

    step: int
    tables: Dict[str, TablePlan] = field(default_factory=dict)
