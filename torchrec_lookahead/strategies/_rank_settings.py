"""Every rank of a job must run the same settings: the parsed configs, compared once the process group exists.

Under ``torchrun`` every rank parses its own command line. A setting that differs between ranks (an override that
depends on the rank's environment, a config file that differs between hosts, a different ``seed_everything``) is
not seen by any collective: the ranks train together with, say, different learning rates or data seeds, and their
replicas of shared cache rows drift apart; some differences (a horizon) break a collective later with gloo's size
mismatch. :func:`check_ranks_agree` refuses them before anything is built, on every rank with the same
:class:`~torchrec_lookahead.errors.ConfigError`.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch.distributed as dist

from torchrec_lookahead.errors import ConfigError

__all__ = [
    "flat_settings",
    "settings_disagreement",
    "check_ranks_agree",
    "remember_settings",
    "remembered_settings",
]

#: settings shown in the error (the rest counted)
_SHOWN = 3

#: settings that may differ between hosts: rank 0 alone writes the logs there, and the checkpoint directory
#: every rank writes in is rank 0's (Lightning broadcasts it)
_MAY_DIFFER = frozenset({"trainer.default_root_dir"})
#: settings naming files or directories (``train_files``, ``movies_file``, ``store_dir``): a host's own copy of the
#: data or its own local disk is a location, not a setting; what the files hold is the user's to keep equal
_LOCATIONS = ("_dir", "_file", "_files")

#: this process's command-line settings (:func:`remember_settings`), compared by every TorchRecStrategy it sets up
#: (``verify`` builds Trainers of its own from the command line's)
_REMEMBERED: Optional[Dict[str, str]] = None


def remember_settings(settings: Mapping[str, str]) -> None:
    """Keep the settings this process was started with (the CLI's parsed config, :func:`flat_settings`): every
    ``TorchRecStrategy`` compares them across the ranks once its process group exists."""
    global _REMEMBERED
    _REMEMBERED = dict(settings)


def remembered_settings() -> Optional[Dict[str, str]]:
    """The settings :func:`remember_settings` kept (``None``: none, as in a Trainer built in Python)."""
    return None if _REMEMBERED is None else dict(_REMEMBERED)


def flat_settings(config: Mapping[str, Any], prefix: str = "") -> Dict[str, str]:
    """``config`` (nested mappings, as the CLI parsed them) as ``{dotted.key: repr(value)}``, without the
    ``config`` entries (the files' paths: their contents are the other settings), ``trainer.default_root_dir``
    and the settings that name files or directories (``*_dir``, ``*_file``, ``*_files``: each host may read its own
    copy of the data and write its own local disk).

    Example:
        >>> flat_settings({"config": ["a.yaml"], "data": {"init_args": {"horizon": 8}}, "seed_everything": 0})
        {'data.init_args.horizon': '8', 'seed_everything': '0'}
    """
    out: Dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if name == "config" or key == "__path__" or name in _MAY_DIFFER or str(key).endswith(_LOCATIONS):
            continue
        if isinstance(value, Mapping):
            out.update(flat_settings(value, f"{name}."))
        else:
            out[name] = repr(_plain(value))
    return out


def _plain(value: Any) -> Any:
    """``value`` with paths as the strings given (jsonargparse's path types print the working directory, which may
    differ between hosts), in lists and mappings too."""
    relative = getattr(value, "relative", None)  # jsonargparse's Path: the path as given
    if isinstance(relative, str):
        return relative
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def settings_disagreement(gathered: Sequence[Mapping[str, str]]) -> Optional[str]:
    """The message for ranks whose settings (``gathered[r]``: rank ``r``'s :func:`flat_settings`) differ from rank
    0's; ``None`` when they all agree.

    Example:
        >>> settings_disagreement([{"a": "1"}, {"a": "1"}]) is None
        True
        >>> settings_disagreement([{"a": "1"}, {"a": "2"}]).split(";")[0]
        'the ranks were given different settings: a is 1 on rank 0 but 2 on rank 1'
    """
    reference = gathered[0]
    differences: List[str] = []
    for rank, settings in enumerate(gathered[1:], 1):
        for key in sorted(set(reference) | set(settings)):
            ours, theirs = reference.get(key, "unset"), settings.get(key, "unset")
            if ours != theirs:
                differences.append(f"{key} is {ours} on rank 0 but {theirs} on rank {rank}")
    if not differences:
        return None
    shown = "; ".join(differences[:_SHOWN])
    more = f" (and {len(differences) - _SHOWN} more)" if len(differences) > _SHOWN else ""
    return (
        f"the ranks were given different settings: {shown}{more}; every rank must run the same config (the same "
        "files and overrides on every rank and host)"
    )


def check_ranks_agree(settings: Optional[Mapping[str, str]] = None) -> None:
    """Refuse, on every rank, settings that differ between the ranks of the default process group (a
    collective: every rank calls it once the group exists; one rank alone returns at once). ``settings``: by
    default the command line's (:func:`remember_settings`; none kept, as in a Trainer built in Python: nothing to
    compare)."""
    settings = remembered_settings() if settings is None else settings
    if settings is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    gathered: List[Optional[Dict[str, str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(settings))
    message = settings_disagreement([g or {} for g in gathered])
    if message is not None:
        raise ConfigError(message)
