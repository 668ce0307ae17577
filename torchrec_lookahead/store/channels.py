"""Collective channels: which process group the collectives of a
:class:`~torchrec_lookahead.store.RowShardedStore` call run on, chosen per thread.

Two threads of one rank may use a row-sharded store at the same time on disjoint rows (the lookahead stager
gathers while the training thread writes back) as long as their collectives never share a process group: a
call runs on the group the store has for the calling thread's channel (:func:`collective_channel`), its
default group otherwise, and is waited for by the channel's wait (:data:`CollectiveWait`), without bound when
there is none.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Optional

__all__ = ["collective_channel", "current_channel", "current_wait", "CollectiveWait", "STAGE_CHANNEL"]

STAGE_CHANNEL = "stage"
"""Channel of the lookahead stager thread (its gathers run on a process group of their own)."""

CollectiveWait = Callable[[Any, str], None]
"""Waits for an asynchronous collective (a ``torch.distributed`` work handle) and names it for errors."""


class _Channel(threading.local):
    """This thread's channel and wait (the class attributes are every thread's start)."""

    name: Optional[str] = None
    wait: Optional[CollectiveWait] = None


_local = _Channel()


@contextlib.contextmanager
def collective_channel(name: Optional[str], wait: Optional[CollectiveWait] = None) -> Iterator[None]:
    """Run the collectives of :class:`RowShardedStore` calls made by this thread, inside the block, on the
    process group the store has for ``name`` (the default group when it has none).

    Args:
        name: the channel (``None``: the default group).
        wait: called with each of those collectives, issued asynchronously, and a short description; it
            returns once the collective has completed, or raises (the lookahead stager's bounded wait after
            its rank stopped, :class:`~torchrec_lookahead.distributed.lockstep.StageGathers`). ``None``: wait
            without bound.

    Example:
        >>> with collective_channel(STAGE_CHANNEL):
        ...     current_channel()
        'stage'
        >>> current_channel() is None
        True
    """
    prev = _local.name, _local.wait
    _local.name, _local.wait = name, wait
    try:
        yield
    finally:
        _local.name, _local.wait = prev


def current_channel() -> Optional[str]:
    """The channel set by the innermost :func:`collective_channel` of this thread (``None`` outside)."""
    return _local.name


def current_wait() -> Optional[CollectiveWait]:
    """The wait set by the innermost :func:`collective_channel` of this thread (``None``: unbounded)."""
    return _local.wait
