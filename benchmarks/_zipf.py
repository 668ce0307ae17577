"""Criteo-Kaggle-shaped synthetic ids for the oracle benchmarks (bounded Zipf per table, hashed ids)."""

from __future__ import annotations

import math
from typing import Dict, List, Sequence

import numpy as np
import torch

#: Criteo Kaggle table sizes (facebookresearch/dlrm tools/visualize.py, see ../shared/data/criteo_stats.md).
KAGGLE_ROWS: List[int] = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]  # fmt: skip


def table_names(n: int = 26) -> List[str]:
    return [f"t_cat_{i}" for i in range(n)]


def zipf_ids(rng: np.random.Generator, rows: int, size: int, alpha: float = 1.05) -> np.ndarray:
    """``size`` ids in ``[0, rows)``: bounded Zipf ranks (inverse CDF of the continuous law) through a bijection.

    Rank r (0 = hottest) maps to ``(a * r + b) % rows`` with ``gcd(a, rows) = 1``, so hot ids are spread over the
    table instead of being the smallest ids.
    """
    u = rng.random(size)
    e = 1.0 - alpha
    rank = np.floor((1.0 + u * ((rows + 1.0) ** e - 1.0)) ** (1.0 / e)).astype(np.int64) - 1
    np.clip(rank, 0, rows - 1, out=rank)
    a = 2654435761 % rows if rows > 1 else 1
    while math.gcd(a, rows) != 1:
        a += 1
    b = (rows * 7) // 13
    return (rank * a + b) % rows


def criteo_batches(
    steps: int, batch: int, rows: Sequence[int], seed: int = 0, alpha: float = 1.05
) -> List[Dict[str, torch.Tensor]]:
    """``steps`` batches of ``batch`` samples, one id per sample per table (tables ``t_cat_i``)."""
    rng = np.random.default_rng(seed)
    names = table_names(len(rows))
    per_table = [zipf_ids(rng, int(n), steps * batch, alpha).reshape(steps, batch) for n in rows]
    return [{name: torch.from_numpy(per_table[i][t]) for i, name in enumerate(names)} for t in range(steps)]
