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

import dataclasses
import enum
import numbers
import os
from typing import Any, Dict, Mapping, Type, TypeVar, Union, cast

import numpy as np

from torchrec_lookahead.errors import ConfigError, first_line

__all__ = [
    "is_int",
    "check_int",
    "check_number",
    "check_bytes",
    "check_choice",
    "check_output_file",
    "check_dir",
    "check_bool",
    "check_dataclass",
]

E = TypeVar("E", bound=enum.Enum)
D = TypeVar("D")


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


def check_number(name: str, value: object, minimum: float, fix: str) -> float:
    """``value`` as a ``float``: a real number (not ``bool``, not NaN) at least ``minimum``.

    Raises:
        ConfigError: ``value`` is not such a number; the message names ``name``, the value and ``fix``.

    Example:
        >>> check_number("scale", 0.5, 0.0, "give the fraction of the Criteo table sizes")
        0.5
    """
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not float(value) >= minimum:
        raise ConfigError(f"{name} must be a number >= {minimum} but got {value!r}; {fix}")
    return float(value)


def check_bytes(name: str, value: object, fix: str) -> Union[int, Dict[str, int]]:
    """``value`` as a positive number of bytes, or a mapping of names to positive numbers of bytes.

    Raises:
        ConfigError: ``value`` is neither (a string, a float, a non-positive number); the message names ``name``,
            the value and ``fix``.

    Example:
        >>> check_bytes("host_budget_bytes", {"t": 4096}, "give the host tier's bytes")
        {'t': 4096}
    """
    if isinstance(value, Mapping):
        return {str(k): check_int(f"{name}[{k!r}]", v, 1, fix) for k, v in value.items()}
    if not is_int(value) or int(cast(numbers.Integral, value)) < 1:
        raise ConfigError(
            f"{name} must be positive: an integer, or a mapping of table names to integers, but got {value!r}; {fix}"
        )
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
    """``path`` as a file that can be written: not a directory, no component of its directory a file, and in a
    directory this process can create files in. Run it before the work whose result goes there.

    Raises:
        ConfigError: ``path`` is a directory, a parent of it is a file, or its directory cannot be written (no
            permission, or a read-only filesystem); the message names ``name`` and the path.

    Example:
        >>> check_output_file("--save", "/tmp")
        Traceback (most recent call last):
        ...
        torchrec_lookahead.errors.ConfigError: --save '/tmp' is a directory; name the file to write, e.g. '/tmp/...'
    """
    if os.path.isdir(path):
        example = os.path.join(path, "...")
        raise ConfigError(f"{name} {path!r} is a directory; name the file to write, e.g. {example!r}")
    parent = _nearest_existing(os.path.dirname(os.path.abspath(path)))
    if os.path.islink(parent) and not os.path.exists(parent):
        raise ConfigError(f"{name} {path!r} cannot be written: {parent!r} is a broken symbolic link")
    if not os.path.isdir(parent):
        raise ConfigError(f"{name} {path!r} cannot be written: {parent!r} is a file, not a directory")
    _check_writable(name, path, parent)
    return path


def _nearest_existing(path: str) -> str:
    """``path`` or its nearest ancestor that exists."""
    path = os.path.abspath(path)
    while not os.path.lexists(path):  # a broken link exists (and is no directory to make)
        path = os.path.dirname(path)
    return path


def share_as_created(path: str) -> None:
    """Give ``path``, a ``tempfile.mkstemp`` file (the owner's only), the mode ``open`` would have given it
    (``0o666`` less the umask), before it replaces the file it is written for."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def _check_writable(name: str, path: str, existing: str) -> None:
    """Refuse ``path`` when this process cannot create files in ``existing``, the directory it would go in."""
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise ConfigError(
            f"{name} {path!r} is on a read-only filesystem ({existing!r}); name a path on a writable one"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{name} {path!r}: no permission to create files in {existing!r}; name a path this user can write"
        )


def check_dir(name: str, path: object) -> str:
    """``path`` as a directory to create files in: an existing directory files can be created in, or one that can
    be made (its nearest existing ancestor such a directory). Makes and writes nothing; run it before the work
    that writes there.

    Raises:
        ConfigError: ``path`` is not a path, is a file, lies under a file, or under a directory this process
            cannot write (no permission, or a read-only filesystem); the message names ``name`` and the path.

    Example:
        >>> check_dir("store_dir", "/tmp/stores")
        '/tmp/stores'
        >>> check_dir("store_dir", 3)
        Traceback (most recent call last):
        ...
        torchrec_lookahead.errors.ConfigError: store_dir must be a directory's path but got 3; name a directory ...
    """
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ConfigError(
            f"{name} must be a directory's path but got {path!r}; name a directory (it is made if missing)"
        )
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(
            f"{name} {path!r} is a file, not a directory; name a directory (it is made if missing)"
        )
    existing = _nearest_existing(path)
    if not os.path.isdir(existing):
        raise ConfigError(
            f"{name} {path!r} cannot be made: {existing!r} is a file, not a directory; name a directory"
        )
    _check_writable(name, path, existing)
    return path


def check_bool(name: str, value: object, fix: str) -> bool:
    """``value`` as a ``bool``: ``True`` or ``False`` (or a NumPy bool). A string such as ``"false"`` is refused,
    not read as true.

    Raises:
        ConfigError: ``value`` is anything else; the message names ``name``, the value and ``fix``.

    Example:
        >>> check_bool("keep_stores", False, "give True or False")
        False
        >>> check_bool("keep_stores", "false", "give True or False")
        Traceback (most recent call last):
        ...
        torchrec_lookahead.errors.ConfigError: keep_stores must be True or False but got 'false'; give True or False
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ConfigError(f"{name} must be True or False but got {value!r}; {fix}")


def check_dataclass(name: str, value: object, cls: Type[D]) -> D:
    """``value`` as a ``cls`` (a dataclass): an instance as it is, or a mapping of its fields to values, built
    the way a config file's ``{key: value}`` is (``cls(**value)``).

    Raises:
        ConfigError: ``value`` is neither, a key is no field of ``cls``, a ``float`` field is given no number,
            or ``cls`` refuses the values; the message names ``name``, the value and the allowed keys.

    Example:
        >>> from torchrec_lookahead.optim import DenseOptimizerSpec
        >>> check_dataclass("dense_optimizer", {"name": "sgd", "lr": 0.1}, DenseOptimizerSpec)
        DenseOptimizerSpec(name='sgd', lr=0.1, kwargs={})
        >>> check_dataclass("dense_optimizer", {"name": "sgd", "learning_rate": 0.1}, DenseOptimizerSpec)
        Traceback (most recent call last):
        ...
        torchrec_lookahead.errors.ConfigError: dense_optimizer has unknown keys ['learning_rate']; its keys are ...
    """
    if isinstance(value, cls):
        return value
    fields = [f for f in dataclasses.fields(cast(Any, cls)) if f.init]
    allowed = [f.name for f in fields]
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{name} must be {cls.__name__}(...) or a dict of its keys {allowed} but got {value!r}; "
            f"e.g. {name}={{{allowed[0]!r}: ...}}"
        )
    unknown = sorted(repr(k) if not isinstance(k, str) else k for k in value if k not in allowed)
    if unknown:
        raise ConfigError(f"{name} has unknown keys {unknown}; its keys are {allowed} ({cls.__name__})")
    for f in fields:
        given = value.get(f.name)
        if f.name in value and f.type in (float, "float"):
            if not isinstance(given, numbers.Real) or isinstance(given, bool):
                raise ConfigError(f"{name} {f.name} must be a number but got {given!r}; e.g. {f.default!r}")
    try:
        return cls(**value)
    except ConfigError as e:
        raise ConfigError(f"{name}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name} {dict(value)!r} is not a valid {cls.__name__}: {first_line(e)}") from None
