"""FAE hot embeddings: the calibrator (sampled counts, Rand-Em Box, statistical optimizer) and its hot set."""

from torchrec_lookahead.hotcold.calibrator import calibrate, calibrate_counts, exact_hot_rows
from torchrec_lookahead.hotcold.config import CalibrationConfig, optimizer_state_floats
from torchrec_lookahead.hotcold.hotset import HotSet, HotTable, table_name
from torchrec_lookahead.hotcold.randembox import RandEmBox, RowEstimate
from torchrec_lookahead.hotcold.sampling import SampledAccesses, sample_batches

__all__ = [
    "CalibrationConfig",
    "optimizer_state_floats",
    "calibrate",
    "calibrate_counts",
    "exact_hot_rows",
    "HotSet",
    "HotTable",
    "table_name",
    "RandEmBox",
    "RowEstimate",
    "SampledAccesses",
    "sample_batches",
]
