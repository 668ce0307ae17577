"""Lightning callbacks: cache statistics, FAE's hot/cold shuffle scheduler (defined in
:mod:`torchrec_lookahead.fae` with the rest of FAE), the predictions of ``predict``, a model summary that counts
embedding tables where they live, a progress bar that keeps the epoch's length after a mid-epoch resume."""

from torchrec_lookahead.callbacks.cache_monitor import TENSORBOARD_LAYOUT, CacheMonitor
from torchrec_lookahead.callbacks.model_summary import EmbeddingModelSummary, use_embedding_summary
from torchrec_lookahead.callbacks.prediction_writer import PredictionWriter
from torchrec_lookahead.callbacks.progress_bar import ResumingProgressBar, use_resuming_progress_bar
from torchrec_lookahead.fae.scheduler import HotColdScheduler, RateRule

__all__ = [
    "CacheMonitor",
    "TENSORBOARD_LAYOUT",
    "EmbeddingModelSummary",
    "HotColdScheduler",
    "PredictionWriter",
    "ResumingProgressBar",
    "RateRule",
    "use_embedding_summary",
    "use_resuming_progress_bar",
]
