"""A configuration value of the wrong type, as one :class:`~torchrec_lookahead.errors.ConfigError`.

jsonargparse refuses a value whose type does not match its argument's annotation (``host_budget_bytes: lots``
where an int or a per-table mapping belongs) with the whole usage text and a report of every Union member it
tried, and exits with status 2. The CLI's parser (:class:`LookaheadArgumentParser`) finds the innermost setting
of that report, the class it belongs to, the types it takes and the value given, and raises a ``ConfigError``
naming them instead; the CLI prints it as one line. A setting that does not exist (a misspelt key) or a
``class_path`` that names nothing importable is one ``ConfigError`` too (:func:`unknown_error`), with the
closest existing name when one is close. Errors of another kind (a missing argument, ...) keep jsonargparse's
report.

Example:
    >>> report = (
    ...     'Parser key "data":\\n'
    ...     "  - Problem with given class_path 'torchrec_lookahead.data.LookaheadDataModule':\\n"
    ...     '      Parser key "horizon":\\n'
    ...     "        Expected a <class 'int'>. Got value: lots\\n"
    ... )
    >>> print(type_error(report))
    horizon of LookaheadDataModule must be an integer but got 'lots'; set horizon to an integer
    >>> report = (
    ...     'Parser key "data":\\n'
    ...     "  - Problem with given class_path 'torchrec_lookahead.data.LookaheadDataModule':\\n"
    ...     "      Option 'horizn' is not accepted\\n"
    ... )
    >>> print(unknown_error(report))
    'horizn' is not a setting of LookaheadDataModule; did you mean 'horizon'?
"""

from __future__ import annotations

import difflib
import inspect
import pydoc
import re
from typing import Any, List, NoReturn, Optional, Sequence

from lightning.pytorch.cli import LightningArgumentParser

from torchrec_lookahead.errors import ConfigError

__all__ = ["LookaheadArgumentParser", "type_error", "unknown_error", "nested_nulls"]

_KEY = re.compile(r'^(\s*)(?:- )?Parser key "([^"]+)":')
_CLASS = re.compile(r"Problem with given class_path '([^']+)'")
_EXPECTED = re.compile(r"Expected a (<class '([^']+)'>|typing\.(\w+)|\S+?)(?:\.|$)")
_GIVEN = re.compile(r"(?:Given value|Got value): (.*)$")
_UNKNOWN = re.compile(r"Option '([^']+)' is not accepted")
_SUBCOMMAND = re.compile(r"Subcommand '([^']+)' does not accept option '([^']+)'")
_NO_ATTRIBUTE = re.compile(r"module '([^']+)' has no attribute '([^']+)'")
_NO_MODULE = re.compile(r"No module named '([^']+)'")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: --([^\s=]+)", re.IGNORECASE)
#: the parser's own options, never a suggestion for a misspelt setting
_PARSER_OPTIONS = {"help", "config", "print_config", "subcommand", "print_shtab"}
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


def _owner(lines: Sequence[str], at: int) -> Optional[str]:
    """The ``class_path`` whose report holds line ``at`` (the nearest one above it, less indented)."""
    depth = _indent(lines[at])
    for line in reversed(lines[:at]):
        m = _CLASS.search(line)
        if m and _indent(line) < depth:
            return m.group(1)
    return None


def _import(path: str) -> Any:
    """The object that the dotted ``path`` names (``None`` when it names nothing importable)."""
    try:
        return pydoc.locate(path)
    except pydoc.ErrorDuringImport:  # a module that exists but fails to import
        return None


def _settings(class_path: str) -> List[str]:
    """The init parameters of the class ``class_path`` names, through the base classes its ``**kwargs`` reach."""
    cls = _import(class_path)
    out: List[str] = []
    bases: Sequence[Any] = (
        cls.__mro__[:-1] if inspect.isclass(cls) else ()
    )  # object's own init last, left out
    for klass in bases:
        try:
            params = inspect.signature(klass.__init__).parameters.values()
        except (TypeError, ValueError):
            break
        out += [
            p.name for p in params if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return list(dict.fromkeys(out))


def _closest(word: str, choices: Sequence[str]) -> Optional[str]:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def _not_a_setting(key: str, where: str, settings: Sequence[str]) -> ConfigError:
    """``key`` is not among ``settings`` (of ``where``): the closest one, or the list when none is close."""
    head = key.split(".")[0]
    close = _closest(key, settings) or _closest(head, sorted({s.split(".")[0] for s in settings}))
    if close is not None:
        hint = f"; did you mean {close!r}?"
    elif settings:
        listed = ", ".join(settings[:24]) + (", ..." if len(settings) > 24 else "")
        hint = f"; its settings: {listed}"
    else:
        hint = ""
    return ConfigError(f"{key!r} is not a setting of {where}{hint}")


def _no_such_class(class_path: str, module: str, attribute: str) -> ConfigError:
    """``class_path`` names nothing: ``module`` has no ``attribute`` (or no module ``module`` exists)."""
    owner = _import(module) if attribute else None
    names = [n for n in dir(owner) if not n.startswith("_")] if owner is not None else []
    close = _closest(attribute, names) if attribute else None
    hint = ""
    if close is not None:
        prefix, _, rest = class_path.partition(f"{module}.{attribute}")
        hint = f"; did you mean {prefix + module + '.' + close + rest!r}?"
    what = f"module {module!r} has no {attribute!r}" if attribute else f"there is no module {module!r}"
    return ConfigError(f"class_path {class_path!r} names no class: {what}{hint}")


def unknown_error(
    message: str, top_settings: Sequence[str] = (), where: str = "the command"
) -> Optional[ConfigError]:
    """The :class:`~torchrec_lookahead.errors.ConfigError` for jsonargparse's report ``message`` of a setting that
    does not exist (of the class its report is under; at the top level, one of ``top_settings``, the settings of
    ``where``) or of a ``class_path`` that names nothing importable. ``None`` when the report is of another kind.
    """
    lines = message.splitlines()
    m = _BAD_YAML.search(message)
    if m is not None:  # a config file that is not YAML
        problem = " ".join(line.strip() for line in m.group(1).splitlines() if line.strip())
        problem = problem.replace('in "<unicode string>", ', "at ")
        return ConfigError(f"a config is not valid YAML: {problem}; fix the file")
    m = _SUBCOMMAND.search(message)
    if m is not None:
        return _not_a_setting(m.group(2), m.group(1), top_settings)
    m = _UNRECOGNIZED.search(message)  # an option of the command line (``--key=value``)
    if m is not None and top_settings:
        return _not_a_setting(m.group(1), where, top_settings)
    for i, line in enumerate(lines):
        unknown = _UNKNOWN.search(line)
        if unknown is not None:
            owner = _owner(lines, i)
            if owner is None:
                return _not_a_setting(unknown.group(1), where, top_settings)
            # a mapping given to a setting that does not exist is reported key by key: name the setting
            setting = unknown.group(1).split(".")[0]
            return _not_a_setting(setting, owner.rsplit(".", 1)[-1], _settings(owner))
        missing = _NO_ATTRIBUTE.search(line) or _NO_MODULE.search(line)
        owner = _owner(lines, i) if missing is not None else None
        if missing is not None and owner is not None:
            attribute = missing.group(2) if missing.re is _NO_ATTRIBUTE else ""
            return _no_such_class(owner, missing.group(1), attribute)
    return None


_BAD_YAML = re.compile(r"Problems parsing config\s*:\s*(.*)", re.DOTALL)
_NULLS = {"null", "Null", "NULL", "~"}
#: settings that hold a list of classes: an override of one of their items cannot be written as a mapping
_CLASS_LISTS = {"sharders", "callbacks", "plugins", "logger"}


def nested_nulls(args: Sequence[str]) -> List[str]:
    """``args`` with each ``--<class key>.init_args.<name>=null`` (or ``--... null``) of a class nested inside
    another class's ``init_args`` written as ``--<class key>={init_args: {<name>: null}}``.

    jsonargparse (4.x) reads such an override as the string ``'None'``: ``store_dir=null`` would name a directory
    ``None``, ``hot_set=null`` a file ``None``, and ``capacity=null`` was refused as a string. The mapping form
    merges into the class's other settings as the dotted one does, with a real null.

    A null for an item of a list of classes (a sharder's setting) has no such form: it is refused.

    Raises:
        ConfigError: a null override of a setting of an item of a list of classes.

    Example:
        >>> nested_nulls(["--data.init_args.datamodule.init_args.hot_set=null", "--trainer.max_steps=2"])
        ['--data.init_args.datamodule={init_args: {hot_set: null}}', '--trainer.max_steps=2']
    """
    out: List[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        key, eq, value = arg.partition("=")
        spaced = not eq and i + 1 < len(args) and args[i + 1] in _NULLS
        if eq:
            null = value.strip() in _NULLS
        else:
            null = spaced
        prefix, sep, name = key.rpartition(".init_args.")
        if null and key.startswith("--") and sep and ".init_args." in prefix and name.isidentifier():
            if prefix.rsplit(".", 1)[-1] in _CLASS_LISTS:
                raise ConfigError(
                    f"{key[2:]}=null cannot be given on the command line (the parser would read the string "
                    f"'None'); set it in the YAML config, or give the whole list: "
                    f"{prefix}=[{{class_path: ..., init_args: {{...}}}}]"
                )
            out.append(f"{prefix}={{init_args: {{{name}: null}}}}")
            i += 2 if spaced else 1
            continue
        out.append(arg)
        i += 1
    return out


def _dests(parser: Optional[LightningArgumentParser]) -> List[str]:
    """The settings a parser takes, as dotted keys (none without a parser)."""
    if parser is None:
        return []
    return [a.dest for a in parser._actions if a.dest not in _PARSER_OPTIONS and not a.dest.endswith(".help")]


class LookaheadArgumentParser(LightningArgumentParser):
    """Lightning's argument parser, reporting a value of the wrong type (:func:`type_error`), a setting that does
    not exist or a ``class_path`` that names nothing (:func:`unknown_error`) as a
    :class:`~torchrec_lookahead.errors.ConfigError` instead of the usage text."""

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        if not self.exit_on_error:  # a nested parser: the outermost one reports, with the class it belongs to
            super().error(message, ex)
        error = type_error(message)
        if error is None:
            sub = _SUBCOMMAND.search(message)
            action = self._subcommands_action  # jsonargparse's (None without subcommands)
            subcommands = {} if action is None else action._name_parser_map
            top = _dests(subcommands.get(sub.group(1)) if sub is not None else self)
            prog = self.prog.split()
            error = unknown_error(message, top, prog[-1] if sub is None and len(prog) > 1 else "the command")
        if error is not None:
            raise error from None
        super().error(message, ex)
