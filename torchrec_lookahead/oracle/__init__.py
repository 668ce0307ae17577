"""The lookahead oracle: plans a bounded embedding cache over a stream of future batches.

Pure tensor code (torch and numpy); no TorchRec, no Lightning.

Example:
    >>> import torch
    >>> from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig
    >>> oracle = LookaheadOracle(OracleConfig(capacity={"t0": 8}, horizon=2))
    >>> plans = list(oracle.plan_stream([{"t0": torch.tensor([5, 6])}, {"t0": torch.tensor([6])}]))
    >>> plans[1].tables["t0"].slots.tolist()
    [6]
"""

from torchrec_lookahead.oracle.batch_ids import UnknownFeatures, table_ids
from torchrec_lookahead.oracle.config import (
    DEFAULT_HORIZON,
    LookaheadSettings,
    OracleConfig,
    PastHorizon,
    Policy,
)
from torchrec_lookahead.oracle.oracle import LookaheadOracle, min_capacity, window_working_sets
from torchrec_lookahead.oracle.types import BatchPlan, RankAnnotation, TablePlan

__all__ = [
    "LookaheadOracle",
    "OracleConfig",
    "LookaheadSettings",
    "DEFAULT_HORIZON",
    "Policy",
    "PastHorizon",
    "BatchPlan",
    "TablePlan",
    "RankAnnotation",
    "min_capacity",
    "window_working_sets",
    "table_ids",
    "UnknownFeatures",
]
