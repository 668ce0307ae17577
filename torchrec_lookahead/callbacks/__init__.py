"""Lightning callbacks: cache statistics."""

from torchrec_lookahead.callbacks.cache_monitor import CacheMonitor

__all__ = ["CacheMonitor"]
