"""Criteo feature layout and published table sizes.

The Kaggle cardinalities are the per-column distinct counts of DLRM's preprocessing over the full Kaggle
``train.txt`` (``facebookresearch/dlrm`` ``tools/visualize.py``); 33,762,577 rows in all.

Example:
    >>> from torchrec_lookahead.data.criteo_spec import CRITEO_KAGGLE_CARDINALITIES, scaled_cardinalities
    >>> sum(CRITEO_KAGGLE_CARDINALITIES)
    33762577
    >>> scaled_cardinalities(0.001, min_rows=2)[:3]
    [2, 2, 10132]
"""

from __future__ import annotations

import math
from typing import List, Sequence

from torchrec.datasets.criteo import (
    CAT_FEATURE_COUNT,
    DEFAULT_CAT_NAMES,
    DEFAULT_INT_NAMES,
    INT_FEATURE_COUNT,
)

from torchrec_lookahead.errors import ConfigError

__all__ = [
    "CRITEO_KAGGLE_CARDINALITIES",
    "CRITEO_MULTI_HOT_SIZES",
    "CAT_FEATURE_COUNT",
    "INT_FEATURE_COUNT",
    "DEFAULT_CAT_NAMES",
    "DEFAULT_INT_NAMES",
    "scaled_cardinalities",
]

CRITEO_KAGGLE_CARDINALITIES: List[int] = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]  # fmt: skip
"""Rows per table (``cat_0`` .. ``cat_25``) of Criteo Kaggle as preprocessed by DLRM."""

CRITEO_MULTI_HOT_SIZES: List[int] = [
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
]  # fmt: skip
"""Pooling factor per table of MLPerf DLRM-DCNv2's synthetic multi-hot Criteo."""


def scaled_cardinalities(
    scale: float, min_rows: int = 1, base: Sequence[int] = CRITEO_KAGGLE_CARDINALITIES
) -> List[int]:
    """Scale published table sizes by ``scale``, keeping every table at least ``min_rows`` rows.

    A table never shrinks below ``min_rows`` (nor grows above its published size), so with a large
    ``min_rows`` the small tables keep their published size and only the large ones shrink.

    Args:
        scale: factor in (0, 1] applied to each table.
        min_rows: lower bound on a scaled table (never above its published size).
        base: the published sizes.

    Returns:
        The scaled sizes, in table order.

    Raises:
        ConfigError: ``scale`` outside (0, 1] or ``min_rows`` < 1.
    """
    if not (0.0 < scale <= 1.0):
        raise ConfigError(f"Expected scale in (0, 1] but got {scale}; use 1.0 for the published sizes")
    if min_rows < 1:
        raise ConfigError(f"Expected min_rows >= 1 but got {min_rows}")
    return [min(n, max(min_rows, math.ceil(n * scale))) for n in base]
