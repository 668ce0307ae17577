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
from typing import Type, TypeVar

from torchrec_lookahead.errors import ConfigError

__all__ = ["is_int", "check_int", "check_choice"]

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
    if not is_int(value) or int(value) < minimum:  # type: ignore[call-overload]
        raise ConfigError(f"{name} must be an integer >= {minimum} but got {value!r}; {fix}")
    return int(value)  # type: ignore[call-overload]


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
