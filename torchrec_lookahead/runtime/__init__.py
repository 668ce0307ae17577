"""The cached job's runtime: the owner of the training step (:class:`CacheSession`), the loader that plans
the cache ahead of training (:class:`LookaheadLoader`), the batches it yields (:class:`LookaheadBatch`), the
capacity pre-scan (:func:`prescan`) and the adapters that read batches other than TorchRec's
(:class:`BatchAdapter`, :class:`DictBatchAdapter`). See :mod:`torchrec_lookahead.runtime.session` for one step,
top-down.
"""

from torchrec_lookahead.runtime._threads import LoaderStats, check_loader_options, check_nice
from torchrec_lookahead.runtime.adapter import BatchAdapter, DictBatchAdapter
from torchrec_lookahead.runtime.batch import LookaheadBatch
from torchrec_lookahead.runtime.capacity import CapacityCheck
from torchrec_lookahead.runtime.loader import LookaheadLoader
from torchrec_lookahead.runtime.scan import PreScan, prescan
from torchrec_lookahead.runtime.session import CacheHost, CacheSession, CacheStats
from torchrec_lookahead.runtime.target import CacheTarget, cached_modules

__all__ = [
    "CacheSession",
    "CacheStats",
    "CacheHost",
    "CacheTarget",
    "cached_modules",
    "LookaheadLoader",
    "LookaheadBatch",
    "LoaderStats",
    "CapacityCheck",
    "prescan",
    "PreScan",
    "BatchAdapter",
    "DictBatchAdapter",
    "check_loader_options",
    "check_nice",
]
