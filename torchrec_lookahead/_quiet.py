"""Known-harmless messages of the libraries underneath, kept out of the command line's default output.

Each entry says whose message it is and why it does not concern a run of this package; ``--verbose`` on the
command line shows them all. Only the CLI installs these filters (:func:`quiet_known_messages`); the library
leaves the process's warning and logging configuration alone.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import warnings
from typing import Any, Iterator, List, Tuple, Type

__all__ = [
    "VERBOSE_FLAG",
    "KNOWN_WARNINGS",
    "KNOWN_LOG_MESSAGES",
    "KNOWN_THREAD_ERRORS",
    "KNOWN_EVALUATION_WARNINGS",
    "quiet_evaluation_warnings",
    "quiet_known_messages",
    "pop_verbose_flag",
]

VERBOSE_FLAG = "--verbose"
"""The command-line flag that shows the messages below."""

KNOWN_WARNINGS: List[Tuple[Type[Warning], str, str]] = [
    (
        FutureWarning,
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        "Lightning 2.6's pytree helper on torch 2.13; nothing to change on our side",
    ),
    (
        UserWarning,
        r"Your `IterableDataset` has `__len__` defined",
        "Lightning warns of duplicated data with several loader workers; the bundled batch loaders are one "
        "process (num_workers=0) and their length is exact, which Lightning needs to resume mid-epoch",
    ),
    (
        FutureWarning,
        r"Please use DTensor instead and we are deprecating ShardedTensor",
        "torch's notice to TorchRec, whose sharded tables are saved and loaded as ShardedTensors; nothing to change "
        "on our side (shown where a checkpoint is read: resume, predict, not by fit)",
    ),
    (
        UserWarning,
        r"Couldn't infer the batch indices fetched from your dataloader",
        "Lightning's predict loop finds no sampler indices in the package's batch loaders; PredictionWriter writes "
        "the predictions in batch order and never reads the indices (shown by predict, not by fit)",
    ),
]
"""(category, message regex, why) of the warnings the CLI hides by default."""

KNOWN_LOG_MESSAGES: List[Tuple[str, str, str]] = [
    (
        "torch.fx._symbolic_trace",
        r"is_fx_tracing will return true for both",
        "torch's notice to TorchRec, which calls is_fx_tracing() in its modules' forward",
    ),
    (
        "lightning.pytorch.utilities.rank_zero",
        r"Tip: For seamless cloud",
        "Lightning's advertisement of its cloud services",
    ),
]
"""(logger, message regex, why) of the log records the CLI hides by default."""

KNOWN_EVALUATION_WARNINGS: List[Tuple[Type[Warning], str, str]] = [
    (
        UserWarning,
        r"The dirpath has changed from",
        "Lightning's ModelCheckpoint, restored from the checkpoint `validate`/`test`/`predict` read, will not keep "
        "its best-k list under the new run's directory; these commands write no checkpoint (shown where fit "
        "resumes, where it is news)",
    ),
    (
        UserWarning,
        r"Be aware that when using `ckpt_path`, callbacks used to create the checkpoint",
        "Lightning lists the callbacks of the run that wrote the checkpoint (ModelCheckpoint, CacheMonitor) "
        "missing from this one; `validate`/`test`/`predict` resume nothing they would restore (shown where fit "
        "resumes, where it is news)",
    ),
]
"""(category, message regex, why) of the warnings the CLI hides in ``validate``, ``test`` and ``predict``."""

_quiet = False  # quiet_known_messages() was called: the CLI without --verbose

KNOWN_THREAD_ERRORS: List[Tuple[str, str]] = [
    (
        "_AsyncWriterThread",
        "TensorBoard's event writer thread prints the error that ends it (a full disk), which the training thread "
        "raises again at its next flush: the CLI reports it there, once, as one line",
    ),
]
"""(thread class name, why) of the threads whose ending error the CLI does not print: another thread raises it."""


class _DropMatching(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def quiet_known_messages() -> None:
    """Hide :data:`KNOWN_WARNINGS` and :data:`KNOWN_LOG_MESSAGES` in this process (and
    :data:`KNOWN_EVALUATION_WARNINGS` inside :func:`quiet_evaluation_warnings`)."""
    global _quiet
    _quiet = True
    for category, message, _ in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for logger, message, _ in KNOWN_LOG_MESSAGES:
        logging.getLogger(logger).addFilter(_DropMatching(message))
    threading.excepthook = _quiet_thread_errors(threading.excepthook)


@contextlib.contextmanager
def quiet_evaluation_warnings() -> Iterator[None]:
    """Hide :data:`KNOWN_EVALUATION_WARNINGS` inside (``validate``, ``test``, ``predict``) where the CLI hides the
    known messages (:func:`quiet_known_messages`, not ``--verbose``)."""
    with warnings.catch_warnings():
        if _quiet:
            for category, message, _ in KNOWN_EVALUATION_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=category)
        yield


def _quiet_thread_errors(previous: Any) -> Any:
    """``threading.excepthook`` without the errors of :data:`KNOWN_THREAD_ERRORS`'s threads."""
    if getattr(previous, "_quiet", False):
        return previous
    names = {name for name, _ in KNOWN_THREAD_ERRORS}

    def hook(args: Any) -> None:
        if type(args.thread).__name__ not in names or not isinstance(args.exc_value, Exception):
            previous(args)

    hook._quiet = True  # type: ignore[attr-defined]
    return hook


def pop_verbose_flag(argv: List[str]) -> Tuple[List[str], bool]:
    """``argv`` without :data:`VERBOSE_FLAG`, and whether it was there.

    Example:
        >>> pop_verbose_flag(["fit", "--verbose", "--config", "x.yaml"])
        (['fit', '--config', 'x.yaml'], True)
    """
    rest = [a for a in argv if a != VERBOSE_FLAG]
    return rest, len(rest) != len(argv)
