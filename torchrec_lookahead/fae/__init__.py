"""FAE hot embeddings: the calibrator (sampled counts, Rand-Em Box, statistical optimizer), its hot set, the
input processor that regroups training batches into all-hot and cold mini-batches (:class:`HotColdDataModule`),
the shuffle scheduler that interleaves them (:class:`HotColdScheduler`), and the hot rows pinned in the
lookahead cache (:class:`PinnedRows`, :class:`HotColdLookaheadLoader`).

It plugs into the cached job's runtime through
:class:`~torchrec_lookahead.runtime.types.PinnedRowsSource`, which :class:`HotColdDataModule` implements: the
strategy and :class:`~torchrec_lookahead.data.LookaheadDataModule` import nothing of this package.
"""

from torchrec_lookahead.fae.calibrator import calibrate, calibrate_counts, exact_hot_rows
from torchrec_lookahead.fae.config import CalibrationConfig, optimizer_state_floats
from torchrec_lookahead.fae.datamodule import HotColdDataModule, calibration_source
from torchrec_lookahead.fae.hotset import HotSet, HotTable, table_name
from torchrec_lookahead.fae.loader import HotColdLoader
from torchrec_lookahead.fae.lookahead import ColdBatches, HotColdLookaheadLoader
from torchrec_lookahead.fae.pinned import PinnedRows
from torchrec_lookahead.fae.randembox import RandEmBox, RowEstimate
from torchrec_lookahead.fae.samples import Samples, cold_ids_per_sample
from torchrec_lookahead.fae.sampling import SampledAccesses, sample_batches
from torchrec_lookahead.fae.scheduler import HotColdScheduler, RateRule
from torchrec_lookahead.fae.stream import BatchKind, HotColdStream, count_hot_samples

__all__ = [
    "PinnedRows",
    "HotColdLookaheadLoader",
    "ColdBatches",
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
    "HotColdScheduler",
    "RateRule",
    "calibration_source",
]
