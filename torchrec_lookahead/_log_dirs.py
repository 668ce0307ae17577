"""The TensorBoard version directory of a run refused at start-up, removed when it holds nothing of the run's.

A ``fit`` refused before its first step (a :class:`~torchrec_lookahead.errors.LookaheadError` from the set-up or
the capacity pre-scan) has by then made ``lightning_logs/version_N`` with the CLI's ``config.yaml``, perhaps
``hparams.yaml``, and an event file holding only the hyperparameters and the set-up reports: a version a user
then finds empty in TensorBoard, beside the runs that trained. :func:`refused_run_logs` removes it, and only it:
a directory this run made (absent before), on the local filesystem, holding those files and nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Set, Tuple

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger

__all__: List[str] = []

log = logging.getLogger(__name__)

#: files a refused run leaves: the CLI's copy of its config and the logger's hyperparameters
_SETUP_FILES = ("config.yaml", "hparams.yaml")
#: event tags a run writes before its first step: the hyperparameters (and their placeholder metric)
_HPARAMS_TAGS = ("hp_metric",)
_HPARAMS_PREFIX = "_hparams_/"
#: this package's set-up reports (text, at step 0: the cache plan, the capacity check)
_REPORT_PREFIX = "lookahead/"


def _local_root(logger: TensorBoardLogger) -> Optional[Path]:
    root = str(logger.root_dir)
    return None if "://" in root else Path(root)


def _entries(root: Optional[Path]) -> Optional[Set[str]]:
    """The names under ``root`` (``None``: no such directory)."""
    if root is None or not root.is_dir():
        return None
    return {p.name for p in root.iterdir()}


def _setup_events_only(path: Path) -> bool:
    """Whether the event file ``path`` holds only what a run writes before its first step (``False`` where it
    cannot be read)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    try:
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                plugin = value.metadata.plugin_data.plugin_name
                setup = (
                    value.tag in _HPARAMS_TAGS
                    or value.tag.startswith(_HPARAMS_PREFIX)
                    or (plugin == "text" and value.tag.startswith(_REPORT_PREFIX))
                )
                if not setup or event.step != 0:
                    return False
    except Exception:  # noqa: BLE001 - an unreadable file is kept, whatever the reader raises
        return False
    return True


def unused_log_dir(path: Path) -> bool:
    """Whether the version directory ``path`` holds only what a run writes before its first step: ``config.yaml``,
    ``hparams.yaml`` and event files of the hyperparameters and set-up reports; no other file, no subdirectory.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = (Path(d) / "config.yaml").write_text("trainer: {}")
        ...     empty = unused_log_dir(Path(d))
        ...     _ = (Path(d) / "metrics.csv").write_text("step,loss")
        ...     empty, unused_log_dir(Path(d))
        (True, False)
    """
    for entry in path.iterdir():
        if entry.is_symlink() or not entry.is_file():
            return False
        if entry.name in _SETUP_FILES:
            continue
        if not (entry.name.startswith("events.out.tfevents.") and _setup_events_only(entry)):
            return False
    return True


@contextlib.contextmanager
def refused_run_logs(trainer: pl.Trainer, refused: Callable[[BaseException], bool]) -> Iterator[None]:
    """Run the block (a ``fit``); when it raises an error ``refused`` accepts before the first step, remove the
    TensorBoard version directory the run made if :func:`unused_log_dir` (and the loggers' root directory too,
    where the run made it and it is left empty). Only rank 0 removes; the error passes on unchanged."""
    before: List[Tuple[TensorBoardLogger, Path, Optional[Set[str]]]] = []
    for logger in trainer.loggers:
        if not isinstance(logger, TensorBoardLogger):
            continue
        root = _local_root(logger)
        if root is not None:
            before.append((logger, root, _entries(root)))
    try:
        yield
    except BaseException as e:
        if trainer.global_step == 0 and trainer.is_global_zero and refused(e):
            for logger, root, existed in before:
                _remove_unused(root, existed, Path(str(logger.log_dir)))
        raise


def _remove_unused(root: Path, existed: Optional[Set[str]], log_dir: Path) -> None:
    if log_dir.parent != root or (existed is not None and log_dir.name in existed) or not log_dir.is_dir():
        return  # a sub_dir layout, a version that was there before, or none made
    try:
        if not unused_log_dir(log_dir):
            return
        shutil.rmtree(log_dir)
        if existed is None and not any(root.iterdir()):
            root.rmdir()
    except OSError as e:  # the refusal is what the user needs to read: a failed removal is only logged
        log.warning("could not remove the refused run's log directory %s: %s", log_dir, e)


def _checkpoints_in(directory: Path) -> List[Path]:
    """The checkpoints (``*.ckpt`` files or directories, whole: not in writing) in ``directory``."""
    if not directory.is_dir():
        return []
    return [p for p in directory.iterdir() if p.suffix == ".ckpt" and not p.name.startswith(".")]


def _is_last(path: Path) -> bool:
    """Whether Lightning's ``ckpt_path="last"`` would pick ``path`` (``last.ckpt``, ``last-v1.ckpt``)."""
    return re.match(r"^last(-v?\d+)?$", path.stem) is not None


def unreachable_checkpoints(trainer: pl.Trainer) -> Optional[Tuple[Path, bool]]:
    """For ``fit --ckpt_path=last``: the newest checkpoint Lightning will not find, and whether it lies under an
    earlier logger version (the ModelCheckpoint has no ``dirpath``). ``None`` when Lightning finds a last
    checkpoint, or when none exists (a first run: it starts from the beginning).

    Lightning looks for ``last*.ckpt`` only in the ModelCheckpoint's directory: its ``dirpath``, or the logger's
    ``version_N/checkpoints``, a new version for each run whose logger has no fixed version, so that a run never
    finds the one before it; and a ``last.ckpt`` never written (a kill during its first write) leaves the
    epoch's checkpoints beside it unused."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    found: List[Tuple[Path, bool]] = []
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        logger = trainer.loggers[0] if trainer.loggers else None
        if callback.dirpath is not None:
            dirs, earlier = [Path(str(callback.dirpath))], False
        elif logger is None:
            dirs, earlier = [Path(str(trainer.default_root_dir)) / "checkpoints"], False
        else:
            root = Path(str(logger.save_dir or trainer.default_root_dir)) / str(logger.name)
            fixed = getattr(logger, "_version", None)
            if fixed is not None:  # the version a resumed run logs to again
                dirs = [root / (fixed if isinstance(fixed, str) else f"version_{fixed}") / "checkpoints"]
                earlier = False
            else:  # this run logs to a new version: every earlier one is out of Lightning's reach
                dirs = sorted(root.glob("version_*/checkpoints")) if root.is_dir() else []
                earlier = True
        if any("://" in str(d) for d in dirs):
            continue  # a remote directory: fsspec's
        ckpts = [p for d in dirs for p in _checkpoints_in(d)]
        if not earlier and any(_is_last(p) for p in ckpts):
            return None  # Lightning finds it
        found += [(p, earlier) for p in ckpts]
    if not found:
        return None
    return max(found, key=lambda pe: pe[0].stat().st_mtime)
