"""Lightning callbacks: cache statistics, FAE's hot/cold shuffle scheduler, the predictions of ``predict``."""

from torchrec_lookahead.callbacks.cache_monitor import CacheMonitor
from torchrec_lookahead.callbacks.hotcold_scheduler import HotColdScheduler, RateRule
from torchrec_lookahead.callbacks.prediction_writer import PredictionWriter

__all__ = ["CacheMonitor", "HotColdScheduler", "PredictionWriter", "RateRule"]
