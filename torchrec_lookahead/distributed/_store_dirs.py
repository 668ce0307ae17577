"""Directories of the host stores' files: one fresh directory per run, owned by the process that made it (an
``flock`` held until the process ends) and removed at exit, and the sweep that removes the directories of
runs whose owner died without removing them."""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import shutil
import tempfile
import time
from typing import List, Optional

from torchrec_lookahead.errors import StoreError

__all__ = [
    "STORE_DIR_PREFIX",
    "KEPT_STORE_DIR_PREFIX",
    "StoreDirs",
    "hold_store_dir",
    "remove_orphaned_store_dirs",
]

log = logging.getLogger(__name__)

STORE_DIR_PREFIX = "torchrec_lookahead_stores_"
KEPT_STORE_DIR_PREFIX = "torchrec_lookahead_kept_stores_"
_OWNER_LOCK = ".owner.lock"
#: a directory younger than this may be between its creation and its owner's lock (a microsecond window): left alone
_ORPHAN_MIN_AGE_S = 10.0


def hold_store_dir(directory: str) -> int:
    """Take the owner lock of a fresh shared-store directory and return its descriptor (keep it open for the
    life of the process: the kernel releases the lock when the process ends, however it ends)."""
    fd = os.open(os.path.join(directory, _OWNER_LOCK), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def remove_orphaned_store_dirs(base: Optional[str]) -> List[str]:
    """Remove shared-store directories under ``base`` (default: the temp directory) whose owner died without
    removing them (a SIGKILLed rank 0 runs no atexit handler, and ``/dev/shm`` is memory): a directory is an
    orphan when its owner lock can be taken, i.e. no live process, in any PID namespace, holds it. Directories
    without a lock file, or younger than ten seconds (being set up), are left alone. Returns the removed paths."""
    base = base or tempfile.gettempdir()
    removed: List[str] = []
    try:
        names = [n for n in os.listdir(base) if n.startswith(STORE_DIR_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(base, name)
        lock = os.path.join(path, _OWNER_LOCK)
        try:
            if time.time() - os.stat(path).st_mtime < _ORPHAN_MIN_AGE_S or not os.path.exists(lock):
                continue
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live owner holds it
            os.close(fd)
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            log.warning("removed the shared stores %s left by a process that ended without cleaning up", path)
        finally:
            os.close(fd)
    return removed


class StoreDirs:
    """The store directories one sharder makes, and the owner locks it holds on them."""

    def __init__(self) -> None:
        self._owner_locks: List[int] = []  # descriptors holding shared-store directories' owner locks
        self._run_dir: Optional[str] = None

    def new(self, base: Optional[str], tag: str, keep: bool) -> str:
        """A fresh store directory under ``base`` (default: the temp directory), after removing the directories of
        runs whose owner died. Unless ``keep``, this one is owned by the process (its lock held until the
        process ends) and removed at exit."""
        try:
            if base is not None:
                os.makedirs(base, exist_ok=True)
            remove_orphaned_store_dirs(base)
            prefix = KEPT_STORE_DIR_PREFIX if keep else STORE_DIR_PREFIX
            directory = tempfile.mkdtemp(prefix=f"{prefix}{tag}", dir=base)
        except OSError as e:
            where = base or tempfile.gettempdir()
            raise StoreError(
                f"cannot make the stores' directory in {where!r}: {e.strerror or e}; set store_dir to a "
                "directory this user can write, on a writable filesystem",
                path=where,
            ) from e
        if keep:
            log.info("the stores of this run stay in %s (keep_stores=True)", directory)
            return directory
        self._owner_locks.append(hold_store_dir(directory))
        atexit.register(shutil.rmtree, directory, True)
        return directory

    def run_dir(self, base: Optional[str], keep: bool) -> str:
        """The one-rank stores' directory under ``base``, made at the first call. A fresh directory per run:
        reopening an earlier run's files would silently continue its training."""
        if self._run_dir is None:
            self._run_dir = self.new(base, "", keep=keep)
        return self._run_dir
