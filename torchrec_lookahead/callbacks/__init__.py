"""Lightning callbacks: cache statistics, FAE's hot/cold shuffle scheduler."""

from torchrec_lookahead.callbacks.cache_monitor import CacheMonitor
from torchrec_lookahead.callbacks.hotcold_scheduler import HotColdScheduler, RateRule

__all__ = ["CacheMonitor", "HotColdScheduler", "RateRule"]
