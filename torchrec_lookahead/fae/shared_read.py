"""One read of a loader's epoch shared by several consumers that move at different paces.

FAE with the lookahead cache reads the training data twice in an epoch: the planner thread reads the cold
batches ahead of training, and the training thread reads the stream to regroup it. Both read the same source
batches in the same order, so :class:`SharedRead` reads each source batch once and hands it to both: whichever
consumer is ahead reads the next batch from the loader and keeps it until every consumer has passed it.

The batches kept are bounded (``bound``). When the leader would keep more, the consumer furthest behind is
detached: it goes on from its position on a read of its own (a fresh iterator of the source, advanced past the
batches it already has), which is what reading twice costs; nothing else changes, and the order each consumer
sees is the source's order either way.

Example:
    >>> shared = SharedRead(lambda: iter(range(5)), consumers=2, bound=8)
    >>> a, b = shared.readers()
    >>> first, second = a(), b()
    >>> [next(first), next(first), next(second), next(first), next(second)]
    [0, 1, 0, 2, 1]
    >>> list(first), list(second), shared.source_reads, shared.detached
    ([3, 4], [2, 3, 4], 5, 0)
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import deque
from typing import Callable, Deque, Dict, Generic, Iterator, List, Optional, TypeVar

from torchrec_lookahead._rng import preserved_rng
from torchrec_lookahead.errors import ConfigError

__all__ = ["SharedRead"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class _End(Exception):
    """The source has no more items."""


_DETACHED = object()


class SharedRead(Generic[T]):
    """A source read once for ``consumers`` readers (see the module docstring).

    Args:
        source: returns a fresh iterator over the epoch (called once, and again for each detached reader).
        consumers: how many readers share the read; each of :meth:`readers` is one of them, starting at the
            first item (items are kept from the start until every reader has passed them).
        bound: items kept at most before the reader furthest behind is detached (>= 1).
    """

    def __init__(self, source: Callable[[], Iterator[T]], consumers: int = 2, bound: int = 64) -> None:
        if consumers < 1:
            raise ConfigError(f"Expected at least one consumer but got {consumers}")
        if bound < 1:
            raise ConfigError(f"Expected a bound of at least one item but got {bound}")
        self.source = source
        self.bound = bound
        self._it: Optional[Iterator[T]] = None
        self._kept: Deque[T] = deque()
        self._base = 0  # the index of the first item kept
        self._pos: Dict[int, int] = {c: 0 for c in range(consumers)}  # readers still on the shared read
        self._ended = False
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()  # the kept items and positions
        self._read_lock = threading.Lock()  # one read of the source at a time
        self._started = [False] * consumers
        self._detached_at: Dict[int, int] = {}  # detached reader -> the index of the next item it needs
        #: items read from the shared iterator (each once, whatever the number of readers)
        self.source_reads = 0
        #: readers detached onto a read of their own because the others were more than ``bound`` items ahead
        self.detached = 0
        #: the most items kept at once
        self.max_kept = 0
        self._owner: Optional[int] = None  # the thread that started the read (see start())

    def start(self) -> None:
        """Create the shared iterator and read its first item now, on the calling thread (the training thread):
        a ``DataLoader`` draws its base seed from torch's global random stream when its iterator is created,
        and a shuffling sampler its order at the first item, and a resident loop does both on the training
        thread before its first step. A reader detached later starts its own read under
        :class:`~torchrec_lookahead._rng.preserved_rng` when it runs on this thread."""
        self._owner = threading.get_ident()
        with self._read_lock:
            if self._it is None and not self._ended:
                self._read_one()

    def readers(self) -> List[Callable[[], Iterator[T]]]:
        """One callable per consumer, each returning that consumer's iterator (call each at most once)."""
        return [functools.partial(self._read, c) for c in range(len(self._started))]

    def _read(self, consumer: int) -> Iterator[T]:
        if self._started[consumer]:
            raise ConfigError(f"reader {consumer} of a shared read was iterated twice")
        self._started[consumer] = True
        try:
            while True:
                try:
                    item = self._next(consumer)
                except _End:
                    return
                if item is _DETACHED:  # on a read of its own from here
                    yield from self._own_read(self._detached_at[consumer])
                    return
                yield item  # type: ignore[misc]
        finally:
            with self._lock:
                self._pos.pop(consumer, None)
                self._trim()

    def _next(self, consumer: int) -> object:
        while True:
            with self._lock:
                if consumer not in self._pos:
                    return _DETACHED
                p = self._pos[consumer]
                if p < self._base + len(self._kept):
                    item = self._kept[p - self._base]
                    self._pos[consumer] = p + 1
                    self._trim()
                    return item
                if self._ended:
                    if self._error is not None:
                        raise self._error
                    raise _End
            with self._read_lock:
                with self._lock:  # another reader may have read it meanwhile
                    if self._ended or self._base + len(self._kept) > p or consumer not in self._pos:
                        continue
                self._read_one()

    def _read_one(self) -> None:
        """Read the next item of the shared iterator (under the read lock) and keep it."""
        try:
            if self._it is None:
                self._it = self.source()
            item = next(self._it)
        except StopIteration:
            with self._lock:
                self._ended = True
            return
        except BaseException as e:  # every reader meets it where the item would have been
            with self._lock:
                self._ended, self._error = True, e
            raise
        with self._lock:
            self._kept.append(item)
            self.source_reads += 1
            self.max_kept = max(self.max_kept, len(self._kept))
            if len(self._kept) > self.bound:
                self._detach_last()
            self._trim()

    def _detach_last(self) -> None:
        if len(self._pos) < 2:
            return
        last = min(self._pos, key=lambda c: self._pos[c])
        self._detached_at[last] = self._pos.pop(last)
        self.detached += 1
        log.info(
            "shared read: reader %d fell more than %d items behind and reads the source on its own from item %d",
            last,
            self.bound,
            self._detached_at[last],
        )

    def _trim(self) -> None:
        """Forget the items every reader still on the shared read has passed."""
        keep_from = min(self._pos.values()) if self._pos else self._base + len(self._kept)
        while self._kept and self._base < keep_from:
            self._kept.popleft()
            self._base += 1

    def _own_read(self, position: int) -> Iterator[T]:
        if threading.get_ident() == self._owner:
            with preserved_rng():  # a second iterator: its seed draw is no draw of the resident loop's
                it = self.source()
        else:
            it = self.source()
        for _ in range(position):
            if next(it, _DETACHED) is _DETACHED:
                return
        yield from it
