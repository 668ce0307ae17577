"""What a full disk looks like to the writers of this package (checkpoints, exports, predictions), for one-line
errors that give the bytes needed and free."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Optional, Union

__all__ = ["free_bytes", "out_of_space"]


def out_of_space(e: BaseException) -> bool:
    """Whether ``e`` is a write refused for lack of room: ``ENOSPC`` / ``EDQUOT``, or torch's zip writer finding
    fewer bytes in its file than it wrote (``unexpected pos``: what a full disk leaves of a ``torch.save``; a
    ``torch.distributed.checkpoint`` failure carries it in its text).

    >>> out_of_space(OSError(errno.ENOSPC, "No space left on device"))
    True
    >>> out_of_space(ValueError("bad value"))
    False
    """
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "unexpected pos" in str(e) or "No space left on device" in str(e)


def free_bytes(path: Union[str, Path]) -> Optional[int]:
    """The free bytes of the file system holding ``path`` (its nearest existing parent), or ``None`` if unknown."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None
