"""Typed errors raised by torchrec_lookahead.

Every error the library raises on bad input derives from :class:`LookaheadError`, so a user can catch the
whole family with one ``except`` clause, and each message names the argument, the value received, the
allowed values and the fix.

Example:
    >>> from torchrec_lookahead import LookaheadError, ConfigError
    >>> try:
    ...     raise ConfigError("num_embeddings for table 't0' must be > 0 but got 0; set a positive size")
    ... except LookaheadError as e:
    ...     print(type(e).__name__)
    ConfigError
"""

from __future__ import annotations

import collections
from typing import Any, Deque, List

__all__ = [
    "LookaheadError",
    "ConfigError",
    "DataError",
    "InvalidIdError",
    "CapacityError",
    "SetupError",
    "CheckpointError",
]


_RECENT: Deque[LookaheadError] = collections.deque(maxlen=16)


class LookaheadError(Exception):
    """Base class of every error raised by torchrec_lookahead on bad input or bad configuration."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        # jsonargparse keeps only the text of an error raised while it tries a Union's subtypes; the CLI finds
        # the error itself here to report it with its own type (see torchrec_lookahead.cli)
        _RECENT.append(self)


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


class CapacityError(LookaheadError, ValueError):
    """A cache capacity is below the working set of one prefetch window."""


class SetupError(LookaheadError, RuntimeError):
    """The runtime environment does not match the configuration (device count, launcher, call order)."""


class CheckpointError(LookaheadError, RuntimeError):
    """A checkpoint cannot be written or restored."""
