"""Refusals of the CLI's commands met once the Trainer exists: settings Lightning refuses with a traceback, a
``--ckpt_path=last`` that would miss existing checkpoints, a split a command would find no files for, and a full
disk under the run's logs, each turned into one :class:`~torchrec_lookahead.errors.LookaheadError` that
:func:`~torchrec_lookahead.launch.short_lookahead_errors` reports as a line."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import socket
from typing import Any, Iterator, List, Optional, Tuple

import lightning.pytorch as pl

from torchrec_lookahead._disk_space import free_bytes, out_of_space
from torchrec_lookahead._log_dirs import unreachable_checkpoints
from torchrec_lookahead.errors import CheckpointError, ConfigError, LookaheadError

__all__ = [
    "refuse_busy_master_port",
    "full_disk_refused",
    "missing_split_files",
    "refuse_unreachable_checkpoints",
    "setting_refused",
    "turned_off",
]


def refuse_unreachable_checkpoints(trainer: pl.Trainer) -> None:
    """``fit --ckpt_path=last`` when Lightning would find no last checkpoint though checkpoints exist (it would
    train from step 0, with only a warning): refused, naming the newest one (:func:`unreachable_checkpoints`)."""
    found = unreachable_checkpoints(trainer)
    if found is None:
        return
    newest, earlier_version = found
    if earlier_version:
        raise CheckpointError(
            "--ckpt_path=last finds no last checkpoint: ModelCheckpoint has no dirpath, so each run writes its "
            f"checkpoints under a new logger version_N, and the newest is {newest}; resume from it with --ckpt_path "
            f"{shlex.quote(str(newest))}, and give ModelCheckpoint a dirpath (--trainer.callbacks.dirpath=<dir>, "
            "or dirpath: in the config) so that --ckpt_path=last finds the last checkpoint of the next runs"
        )
    raise CheckpointError(
        f"--ckpt_path=last finds no last checkpoint in {newest.parent} (none written: save_last off, or a run "
        f"killed while writing the first one), but the checkpoint {newest.name} is there; resume from it with "
        f"--ckpt_path {shlex.quote(str(newest))}"
    )


def turned_off(trainer: Any, split: str) -> bool:
    """Whether the parsed trainer settings turn ``split`` off (``limit_<split>_batches`` 0)."""
    limit = trainer.get(f"limit_{split}_batches")
    return limit is not None and not isinstance(limit, bool) and float(limit) == 0


def missing_split_files(data: Any, split: str) -> Optional[Tuple[str, str]]:
    """(DataModule class name, ``<its setting's path>``) when the parsed ``data`` config reads files and gives
    none for ``split`` (``val_files`` / ``test_files`` unset); ``None`` otherwise (batches, or the files given)."""
    path = "data"
    while data is not None and hasattr(data, "get"):
        init_args = data.get("init_args")
        if init_args is None or not hasattr(init_args, "get"):
            return None
        if "train_files" in init_args:
            if init_args.get(f"{split}_files"):
                return None
            name = str(data.get("class_path", "DataModule")).rsplit(".", 1)[-1]
            return name, f"{path}.init_args.{split}_files"
        data, path = init_args.get("datamodule"), f"{path}.init_args.datamodule"
    return None


@contextlib.contextmanager
def full_disk_refused(trainer: pl.Trainer) -> Iterator[None]:
    """Turn a full disk met while the Trainer writes its config copy, logs or other files (``ENOSPC`` from
    fsspec, TensorBoard's writer, ``torch.save``) into one :class:`~torchrec_lookahead.errors.ConfigError` naming
    the file (or the run's log directory) and the bytes free there. Our own errors pass unchanged."""
    try:
        yield
    except BaseException as e:
        full = None if any(isinstance(c, LookaheadError) for c in _chain(e)) else _full_disk_cause(e)
        if full is None:
            raise
        where = getattr(full, "filename", None) or _log_dir(trainer)
        free = free_bytes(where)
        room = "" if free is None else f" ({free:,} bytes free there)"
        raise ConfigError(
            f"no space left on device writing {where}{room}: free space, or point --trainer.default_root_dir at a "
            "disk with room"
        ) from e


_VAL_CHECK = re.compile(
    r"`val_check_interval` \((?P<interval>\d+)\) must be less than or equal to the number of the training "
    r"batches \((?P<batches>\d+)\)"
)


@contextlib.contextmanager
def setting_refused() -> Iterator[None]:
    """Lightning's ``ValueError`` for a ``val_check_interval`` above the epoch's training batches (met once the
    loaders are built, before the first step) as one :class:`~torchrec_lookahead.errors.ConfigError`, so that
    the CLI reports it in a line and the refused run leaves no log version."""
    try:
        yield
    except ValueError as e:
        found = None if isinstance(e, LookaheadError) else _VAL_CHECK.search(str(e))
        if found is None:
            raise
        interval, batches = found["interval"], found["batches"]
        raise ConfigError(
            f"trainer.val_check_interval must be at most the {batches} training batches of an epoch but got "
            f"{interval}: pass --trainer.val_check_interval {batches} (or less), "
            "--trainer.check_val_every_n_epoch null to count batches across epochs, or "
            "--trainer.limit_val_batches 0 to turn validation off"
        ) from None


def _chain(error: BaseException) -> List[BaseException]:
    """``error`` and its chain of causes (``__cause__``, else ``__context__``)."""
    chain: List[BaseException] = []
    e: Optional[BaseException] = error
    while e is not None and all(e is not c for c in chain):
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


def _full_disk_cause(error: BaseException) -> Optional[BaseException]:
    """``error`` or an error in its chain of causes that is a write refused for lack of room, else ``None``."""
    return next((e for e in _chain(error) if out_of_space(e)), None)


def _log_dir(trainer: pl.Trainer) -> str:
    """Where the Trainer writes its logs: its logger's directory, or ``default_root_dir``."""
    try:
        log_dir = trainer.logger.log_dir if trainer.logger is not None else None
    except Exception:  # noqa: BLE001 - only for a message
        log_dir = None
    return str(log_dir or trainer.default_root_dir)


def refuse_busy_master_port(trainer: pl.Trainer) -> None:
    """A ``MASTER_PORT`` in use, on one machine whose processes Lightning starts itself (``--trainer.devices=2``
    without torchrun): rank 0 failed to bind its store there with a long ``DistNetworkError`` traceback, after
    starting the other ranks, which then waited for it forever. Refused before any other rank is started.

    Raises:
        ConfigError: the port cannot be bound on this machine.
    """
    port = os.environ.get("MASTER_PORT")
    env = getattr(trainer.strategy, "cluster_environment", None)
    if not port or env is None or env.creates_processes_externally or trainer.num_nodes != 1:
        return  # no port given (Lightning picks a free one), or processes started by torchrun / a scheduler
    if trainer.world_size < 2 or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(
            f"MASTER_PORT must be a port number but got {port!r}; unset it or give a free port"
        ) from None
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.bind(("", number))
    except OSError as e:
        raise ConfigError(
            f"MASTER_PORT {number} is in use on this machine ({e.strerror}): rank 0 could not serve the ranks' "
            "rendezvous there; unset MASTER_PORT (Lightning then picks a free port) or choose a free one"
        ) from None
    finally:
        probe.close()
