"""Aligned positional I/O and the header of a disk store file (:mod:`torchrec_lookahead.store._disk_file`)."""

from __future__ import annotations

import json
import mmap
import os
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

from torchrec_lookahead.errors import ConfigError, StoreError

__all__: List[str] = []

PAGE = 4096
MAGIC = b"TRLDISK\x00"
FORMAT = "torchrec_lookahead.disk_store"
MAX_RUN_BYTES = 1 << 20  # one request reads at most this many consecutive bytes


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory of at least ``nbytes`` (O_DIRECT needs aligned buffers)."""
    return mmap.mmap(-1, max(PAGE, -(-nbytes // PAGE) * PAGE))


def runs(units: np.ndarray, unit_bytes: int) -> List[Tuple[int, int]]:
    """(first index into ``units``, count) of the runs of consecutive units, each at most MAX_RUN_BYTES."""
    if units.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(units) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [units.size]))
    longest = max(1, MAX_RUN_BYTES // unit_bytes)
    out: List[Tuple[int, int]] = []
    for a, b in zip(starts.tolist(), stops.tolist()):
        for lo in range(a, b, longest):
            out.append((lo, min(longest, b - lo)))
    return out


def each(op: Callable[[memoryview, int], None], jobs: List[Tuple[memoryview, int]]) -> None:
    for view, offset in jobs:
        op(view, offset)


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def pread_all(fd: int, view: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise StoreError(f"disk store '{path}' ended at byte {offset + done}", path=path)
        done += n


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def free_bytes(path: str) -> int:
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(path)))
        return int(st.f_bavail * st.f_frsize)
    except OSError:
        return -1


def read_header(path: str) -> Dict[str, Any]:
    """The layout a disk store file records in its header.

    Raises:
        ConfigError: no file, or not a disk store's.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(PAGE)
    except OSError as e:
        raise ConfigError(f"no disk store at '{path}' ({e.strerror})") from None
    if not head.startswith(MAGIC):
        raise ConfigError(f"'{path}' is not a disk store file (no {FORMAT} header)")
    length = int.from_bytes(head[len(MAGIC) : len(MAGIC) + 4], "little")
    try:  # a file cut inside its header, or damaged there
        meta = json.loads(head[len(MAGIC) + 4 : len(MAGIC) + 4 + length].decode())
    except ValueError as e:  # JSON and UTF-8 errors
        raise ConfigError(
            f"'{path}' has a damaged {FORMAT} header ({type(e).__name__}): the file is truncated or damaged"
        ) from None
    if not isinstance(meta, dict):
        raise ConfigError(f"'{path}' has a damaged {FORMAT} header (not a mapping): the file is damaged")
    return meta
