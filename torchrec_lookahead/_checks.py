"""The checks configuration values go through: one definition of "an integer" (Python and NumPy integers, not
``bool``), so that ``True`` is refused as a size or a step everywhere alike, and one for a choice among an
enum's values.

Example:
    >>> import numpy as np
    >>> is_int(3), is_int(np.int64(3)), is_int(True), is_int(3.0)
    (True, True, False, False)
    >>> check_int("horizon", 4, 0, "set a non-negative lookahead in batches")
    4
"""

from __future__ import annotations

import enum
import numbers
import os
from typing import Type, TypeVar, cast

from torchrec_lookahead.errors import ConfigError

__all__ = ["is_int", "check_int", "check_choice", "check_output_file"]

E = TypeVar("E", bound=enum.Enum)


def is_int(value: object) -> bool:
    """``value`` is an integer (``numbers.Integral``) and not a ``bool``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: object, minimum: int, fix: str) -> int:
    """``value`` as an ``int``.

    Raises:
        ConfigError: ``value`` is not an integer (:func:`is_int`) or is below ``minimum``; the message names
            ``name``, the value and ``fix``.
    """
    if not is_int(value) or int(cast(numbers.Integral, value)) < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum} but got {value!r}; {fix}")
    return int(cast(numbers.Integral, value))


def check_choice(name: str, value: object, choices: Type[E]) -> E:
    """``value`` as a member of the enum ``choices`` (a member or its value).

    Raises:
        ConfigError: ``value`` is none of them; the message names ``name``, the value and the valid values.

    Example:
        >>> from torchrec_lookahead.oracle import Policy
        >>> check_choice("policy", "lru", Policy) is Policy.LRU
        True
    """
    try:
        return choices(value)
    except ValueError:
        valid = ", ".join(repr(c.value) for c in choices)
        raise ConfigError(f"{name} must be one of {valid} but got {value!r}; pick one of them") from None


def check_output_file(name: str, path: str) -> str:
    """``path`` as a file that can be written: not a directory, and no component of its directory a file. Run it
    before the work whose result goes there.

    Raises:
        ConfigError: ``path`` is a directory, or a parent of it is a file; the message names ``name`` and the path.

    Example:
        >>> check_output_file("--save", "/tmp")
        Traceback (most recent call last):
        ...
        torchrec_lookahead.errors.ConfigError: --save '/tmp' is a directory; name the file to write, e.g. '/tmp/...'
    """
    if os.path.isdir(path):
        example = os.path.join(path, "...")
        raise ConfigError(f"{name} {path!r} is a directory; name the file to write, e.g. {example!r}")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{name} {path!r} cannot be written: {parent!r} is a file, not a directory")
    return path
