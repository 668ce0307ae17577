"""A configuration value of the wrong type, as one :class:`~torchrec_lookahead.errors.ConfigError`.

jsonargparse refuses a value whose type does not match its argument's annotation (``host_budget_bytes: lots``
where an int or a per-table mapping belongs) with the whole usage text and a report of every Union member it
tried, and exits with status 2. The CLI's parser (:class:`LookaheadArgumentParser`) finds the innermost setting
of that report, the class it belongs to, the types it takes and the value given, and raises a ``ConfigError``
naming them instead; the CLI prints it as one line. Errors of another kind (an unknown key, a missing
argument) keep jsonargparse's report.

Example:
    >>> report = (
    ...     'Parser key "data":\\n'
    ...     "  - Problem with given class_path 'torchrec_lookahead.data.LookaheadDataModule':\\n"
    ...     '      Parser key "horizon":\\n'
    ...     "        Expected a <class 'int'>. Got value: lots\\n"
    ... )
    >>> print(type_error(report))
    horizon of LookaheadDataModule must be an integer but got 'lots'; set horizon to an integer
"""

from __future__ import annotations

import re
from typing import List, NoReturn, Optional

from lightning.pytorch.cli import LightningArgumentParser

from torchrec_lookahead.errors import ConfigError

__all__ = ["LookaheadArgumentParser", "type_error"]

_KEY = re.compile(r'^(\s*)(?:- )?Parser key "([^"]+)":')
_CLASS = re.compile(r"Problem with given class_path '([^']+)'")
_EXPECTED = re.compile(r"Expected a (<class '([^']+)'>|typing\.(\w+)|\S+?)(?:\.|$)")
_GIVEN = re.compile(r"(?:Given value|Got value): (.*)$")
_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "str": "a string",
    "dict": "a mapping",
    "Dict": "a mapping",
    "Mapping": "a mapping",
    "list": "a list",
    "List": "a list",
    "Sequence": "a list",
    "NoneType": "null",
}


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def type_error(message: str) -> Optional[ConfigError]:
    """The :class:`~torchrec_lookahead.errors.ConfigError` for jsonargparse's report ``message`` of a value of the
    wrong type: its innermost ``Parser key``, the class it belongs to, the types it takes and the value given.
    ``None`` when the report is of another kind (no type expected there, or no value given)."""
    lines = message.splitlines()
    keys = [(i, m) for i, line in enumerate(lines) if (m := _KEY.match(line))]
    if not keys:
        return None
    start, key = max(keys, key=lambda k: len(k[1].group(1)))
    depth = len(key.group(1))
    owner = next(
        (
            m.group(1)
            for line in reversed(lines[:start])
            if (m := _CLASS.search(line)) and _indent(line) < depth
        ),
        None,
    )
    expected: List[str] = []
    given: Optional[str] = None
    for line in lines[start + 1 :]:
        if line.strip() and _indent(line) <= depth:
            break
        if _CLASS.search(line):  # a class was tried and failed for another reason (an unknown key, ...)
            return None
        for m in _EXPECTED.finditer(line):
            word = _WORDS.get(m.group(2) or m.group(3) or "")
            if word is not None and word not in expected:
                expected.append(word)
        g = _GIVEN.search(line)
        if g is not None and given is None:
            given = g.group(1).strip()
    if given is None or given.startswith("NestedArg(") or not set(expected) - {"null"}:
        return None
    setting = key.group(2)
    where = f" of {owner.rsplit('.', 1)[-1]}" if owner else ""
    types = expected[0] if len(expected) == 1 else ", ".join(expected[:-1]) + " or " + expected[-1]
    return ConfigError(f"{setting}{where} must be {types} but got {given!r}; set {setting} to {types}")


class LookaheadArgumentParser(LightningArgumentParser):
    """Lightning's argument parser, reporting a value of the wrong type as a
    :class:`~torchrec_lookahead.errors.ConfigError` (:func:`type_error`) instead of the usage text."""

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        if not self.exit_on_error:  # a nested parser: the outermost one reports, with the class it belongs to
            super().error(message, ex)
        error = type_error(message)
        if error is not None:
            raise error from None
        super().error(message, ex)
