"""Typed errors raised by torchrec_lookahead.

Every error the library raises on bad input derives from :class:`LookaheadError`, so a user can catch the
whole family with one ``except`` clause, and each message names the argument, the value received, the
allowed values and the fix. Errors about a table's ids or its cache also carry those facts as attributes
(``table``, ``batch``, ``id``, ``num_rows``, ``needed``, ``available``; ``None`` where the raising code does not
know one), the way TorchRec's ``PlannerError`` carries its ``error_type``, so a caller can act on them without
parsing the message.

Example:
    >>> from torchrec_lookahead import CapacityError, ConfigError, LookaheadError
    >>> try:
    ...     raise ConfigError("num_embeddings for table 't0' must be > 0 but got 0; set a positive size")
    ... except LookaheadError as e:
    ...     print(type(e).__name__)
    ConfigError
    >>> e = CapacityError("table 't': batch 3 needs 9 cache rows but ...", table="t", batch=3, needed=9, available=8)
    >>> e.table, e.batch, e.needed - e.available
    ('t', 3, 1)
"""

from __future__ import annotations

import collections
from typing import Any, ClassVar, Deque, Dict, List, Optional, Tuple

__all__ = [
    "LookaheadError",
    "ConfigError",
    "DataError",
    "InvalidIdError",
    "CapacityError",
    "SetupError",
    "CheckpointError",
    "StoreError",
]


_RECENT: Deque[LookaheadError] = collections.deque(maxlen=16)


class LookaheadError(Exception):
    """Base class of every error raised by torchrec_lookahead on bad input or bad configuration.

    Args:
        args: the message (as for any exception).
        facts: keyword facts of the error, each set as an attribute; a subclass names those it takes in
            :attr:`FACTS` (any other raises ``TypeError``). The message is the caller's, unchanged.
    """

    #: names of the keyword facts this class takes (each an attribute, ``None`` unless given)
    FACTS: ClassVar[Tuple[str, ...]] = ()

    def __init__(self, *args: Any, **facts: Any) -> None:
        super().__init__(*args)
        unknown = sorted(set(facts) - set(self.FACTS))
        if unknown:
            raise TypeError(f"{type(self).__name__} takes the facts {list(self.FACTS)}, not {unknown}")
        for name, value in facts.items():
            setattr(self, name, value)
        # jsonargparse keeps only the text of an error raised while it tries a Union's subtypes; the CLI finds
        # the error itself here to report it with its own type (see torchrec_lookahead.launch)
        _RECENT.append(self)

    @property
    def facts(self) -> Dict[str, Any]:
        """The error's facts by name (those of :attr:`FACTS`; ``None`` where not given)."""
        return {name: getattr(self, name) for name in self.FACTS}


def first_line(error: BaseException, limit: Optional[int] = None, sentence: bool = False) -> str:
    """The first line of ``error``'s message (its first sentence with ``sentence``), cut at ``limit`` characters:
    how a typed error quotes the library error behind it, whose full text can run to paragraphs.

    Example:
        >>> first_line(ValueError("bad bytes. Re-run with weights_only=False\\nmore"), sentence=True)
        'bad bytes'
    """
    line = (str(error).strip().splitlines() or [""])[0]
    if sentence:
        line = line.split(". ")[0]
    return line if limit is None else line[:limit]


#: what gloo (and torch's TCP store) say when the other end of a collective is gone
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def peer_gone(error: BaseException) -> bool:
    """Whether ``error`` only says that another rank is gone (a collective whose peer ended: killed, or failed
    with its own error, which that rank reports).

    Example:
        >>> peer_gone(RuntimeError("[pair.cc:534] Connection closed by peer [127.0.0.1]:5431")), peer_gone(KeyError())
        (True, False)
    """
    return type(error).__name__ == "DistNetworkError" or any(m in str(error) for m in _PEER_GONE)


def recent_errors() -> List[LookaheadError]:
    """The last few :class:`LookaheadError` s created in this process, oldest first."""
    return list(_RECENT)


class ConfigError(LookaheadError, ValueError):
    """A configuration value is invalid (unknown name, non-positive size, unknown policy, ...)."""


class DataError(LookaheadError, ValueError):
    """Input data is malformed: a missing file, a malformed line, a wrong column count, NaN features."""


class UnevenBatchError(DataError):
    """The ranks of a group read batches of different sizes, which layers split across the group cannot
    combine (hierarchical training)."""


class InvalidIdError(DataError):
    """An embedding id is negative or not below its table's number of rows."""

    FACTS = ("table", "batch", "id", "num_rows")
    table: Optional[str] = None  #: the table the id is for
    batch: Optional[int] = None  #: the batch (step) holding it, where known
    id: Optional[int] = None  #: the offending id (the lowest negative one, else the highest)
    num_rows: Optional[int] = None  #: the table's number of rows (valid ids are ``0 .. num_rows - 1``)


class CapacityError(LookaheadError, ValueError):
    """A cache capacity is below the working set of one prefetch window: the device cache's (``tier="device"``),
    or the host tier's of a disk store (``tier="host"``)."""

    FACTS = ("table", "batch", "needed", "available", "tier")
    table: Optional[str] = None  #: the table whose cache is too small
    batch: Optional[int] = None  #: the (last) batch of the window that does not fit
    needed: Optional[int] = None  #: rows the window needs
    available: Optional[int] = None  #: rows the cache can give it (its capacity, or the evictable rows)
    tier: str = "device"  #: the tier too small: ``"device"`` (the cache) or ``"host"`` (a disk store's)


class SetupError(LookaheadError, RuntimeError):
    """The runtime environment does not match the configuration (device count, launcher, call order)."""


class CheckpointError(LookaheadError, RuntimeError):
    """A checkpoint cannot be written or restored."""


class StoreError(LookaheadError, OSError):
    """A host store's file cannot be written or read: the disk is full (``ENOSPC``) or an I/O error. The rows
    not yet written stay in host memory and the file is consistent as of its last flush."""

    FACTS = ("path",)
    path: Optional[str] = None  #: the store file
