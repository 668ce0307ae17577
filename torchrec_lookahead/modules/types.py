"""Data types exchanged between the stager (background gathers) and the cache (which applies plans)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

__all__ = ["StagedTable", "StagedRows", "BackwardHook"]

BackwardHook = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]], None]
"""A kernel's backward handed elsewhere: (gradient of the output, indices, offsets, weights) -> None."""


@dataclass(frozen=True)
class StagedTable:
    """Rows of one table gathered ahead of the step that loads them.

    Attributes:
        ids: (F,) the ids, equal to the plan's ``fetch_ids``.
        weights: (F, D) their weights.
        states: per optimizer state name, (F, w) values.
    """

    ids: torch.Tensor
    weights: torch.Tensor
    states: Dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class StagedRows:
    """Pre-gathered fetch rows of one step, handed to ``CachedEmbeddingBagCollection.apply_plan``.

    Attributes:
        step: the plan's step.
        tables: table name -> rows (tables without fetches may be absent).
        spaces: the same rows by slot space, each space's gathered as one (its tables the plan names, joined by
            ``+``, in the space's order -> their fetched rows, concatenated in that order): the cache loads
            each with one scatter. Empty: the cache concatenates ``tables`` itself.
    """

    step: int
    tables: Dict[str, StagedTable] = field(default_factory=dict)
    spaces: Dict[str, StagedTable] = field(default_factory=dict)
