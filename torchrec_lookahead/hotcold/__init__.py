"""FAE hot embeddings: the calibrator (sampled counts, Rand-Em Box, statistical optimizer), its hot set, and
the input processor that regroups training batches into all-hot and cold mini-batches."""

from torchrec_lookahead.hotcold.calibrator import calibrate, calibrate_counts, exact_hot_rows
from torchrec_lookahead.hotcold.config import CalibrationConfig, optimizer_state_floats
from torchrec_lookahead.hotcold.datamodule import HotColdDataModule, HotColdLoader, calibration_source
from torchrec_lookahead.hotcold.hotset import HotSet, HotTable, table_name
from torchrec_lookahead.hotcold.pinned import PinnedRows
from torchrec_lookahead.hotcold.randembox import RandEmBox, RowEstimate
from torchrec_lookahead.hotcold.samples import Samples, cold_ids_per_sample
from torchrec_lookahead.hotcold.sampling import SampledAccesses, sample_batches
from torchrec_lookahead.hotcold.stream import BatchKind, HotColdStream, count_hot_samples

__all__ = [
    "PinnedRows",
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
    "Samples",
    "cold_ids_per_sample",
    "BatchKind",
    "HotColdStream",
    "count_hot_samples",
    "HotColdDataModule",
    "HotColdLoader",
    "calibration_source",
]
