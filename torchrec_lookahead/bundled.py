"""The configs shipped inside the package, reachable by name from an installed wheel.

``python -m torchrec_lookahead fit --config dlrm_tiny_lookahead`` (or the ``torchrec-lookahead`` script) runs the
bundled ``dlrm_tiny_lookahead.yaml`` when no file of that name exists; :func:`config_path` gives the file itself,
to copy and edit.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import List, Sequence

import yaml

from torchrec_lookahead.errors import ConfigError

__all__ = ["CONFIG_DIR", "bundled_configs", "config_path", "resolve_config_args"]

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
"""Where the bundled LightningCLI YAML files are (package data of the wheel)."""

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def bundled_configs() -> List[str]:
    """The names of the bundled configs, sorted.

    Example:
        >>> {"dlrm_tiny", "dlrm_tiny_lookahead"} <= set(bundled_configs())
        True
    """
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def config_path(name: str) -> Path:
    """The file of the bundled config ``name`` (with or without ``.yaml``).

    Raises:
        ConfigError: no bundled config has that name; the message lists those that exist.

    Example:
        >>> config_path("dlrm_tiny").name
        'dlrm_tiny.yaml'
    """
    stem = name[: -len(".yaml")] if name.endswith(".yaml") else name
    path = CONFIG_DIR / f"{stem}.yaml"
    if not _NAME.match(stem) or not path.is_file():
        raise ConfigError(
            f"No config file or bundled config named {name!r}; give a path to a YAML file or one of "
            f"{bundled_configs()}"
        )
    return path


def resolve_config_args(argv: Sequence[str]) -> List[str]:
    """``argv`` with each ``--config NAME`` (or ``--config=NAME``) whose ``NAME`` is not an existing file but
    a bare name (no directory, no inline YAML) replaced by the bundled config's path; anything else unchanged.

    Every ``--config`` value is checked here, before any work: a value that is neither a file, nor a bundled
    config's name, nor inline YAML (a mapping) is refused, rather than left to the argument parser, whose
    message is its whole usage text.

    Raises:
        ConfigError: a bare name that is neither a file nor a bundled config; a path to no file.

    Example:
        >>> resolve_config_args(["fit", "--config", "dlrm_tiny"])[2].endswith("configs/dlrm_tiny.yaml")
        True
        >>> resolve_config_args(["fit", "--config=trainer: {max_steps: 1}"])
        ['fit', '--config=trainer: {max_steps: 1}']
    """

    def resolve(value: str) -> str:
        if Path(value).is_file():
            return value
        if _NAME.match(value):
            return str(config_path(value))
        if _is_inline_yaml(value):
            return value
        what = (
            f"Config file {value!r} is a directory"
            if Path(value).is_dir()
            else f"Config file not found: {value!r}"
        )
        raise ConfigError(f"{what}; give the path to a YAML file or a bundled config's name")

    out: List[str] = []
    after_flag = False
    for arg in argv:
        if after_flag:
            out.append(resolve(arg))
        elif arg.startswith("--config="):
            out.append("--config=" + resolve(arg[len("--config=") :]))
        else:
            out.append(arg)
        after_flag = arg == "--config"
    return out


def _is_inline_yaml(value: str) -> bool:
    """``value`` is a config written inline (a YAML mapping, or text the YAML parser refuses, which the CLI's
    parser then reports), not a path.

    Example:
        >>> _is_inline_yaml("trainer: {max_steps: 1}"), _is_inline_yaml("configs/nope.yaml")
        (True, False)
    """
    try:
        return isinstance(yaml.safe_load(value), dict)
    except yaml.YAMLError:
        return True
