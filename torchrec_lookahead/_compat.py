"""What differs between the versions of the stack the package runs on, in one place.

The project's environment is torch 2.13, fbgemm-gpu 1.8 and torchrec 1.8; GPU machines may carry older builds
(torch 2.11 with CUDA 13, fbgemm-gpu 1.6, torchrec 1.6).

* fbgemm-gpu 1.6 checks its version against a table of torch versions that has no entry for itself and logs a
  multi-line warning (on the root logger, coloured) for each of its 14 libraries at import; every command's
  output, its short error messages included, then opened with 70 lines of it. :func:`install` drops that one
  notice (only it: a real version mismatch is still reported).
* torch 2.13's ``DistributedDataParallel`` takes ``forward_sync_buffers`` and deprecates ``broadcast_buffers``
  (with a warning on every run); torch 2.11 knows only ``broadcast_buffers``. :func:`ddp_no_buffer_sync` gives
  the one the installed torch takes.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Dict

__all__ = ["install", "ddp_no_buffer_sync"]

_FBGEMM_NO_ENTRY = "_fbgemm_torch_compat_table has no entry"


class _FbgemmVersionNotice(logging.Filter):
    """Drops fbgemm-gpu's "no entry in the compatibility table" notice; passes every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _FBGEMM_NO_ENTRY not in str(record.msg)


def install() -> None:
    """Install the shims (idempotent); the package's ``__init__`` calls it before anything imports FBGEMM.

    Example:
        >>> install()
        >>> logging.getLogger().filter(logging.makeLogRecord({"msg": _FBGEMM_NO_ENTRY + " for 1.6.0"}))
        False
        >>> bool(logging.getLogger().filter(logging.makeLogRecord({"msg": "another warning"})))
        True
    """
    root = logging.getLogger()
    if not any(isinstance(f, _FbgemmVersionNotice) for f in root.filters):
        root.addFilter(_FbgemmVersionNotice())


def ddp_no_buffer_sync() -> Dict[str, Any]:
    """``DistributedDataParallel`` keyword arguments for "synchronise no buffer in forward":
    ``forward_sync_buffers=False`` where torch has it (2.12 and later; buffers are still broadcast from rank 0
    once, at construction), else ``broadcast_buffers=False`` (no broadcast at all; the dense buffers start
    equal on every rank either way).

    Example:
        >>> ddp_no_buffer_sync() in ({"forward_sync_buffers": False}, {"broadcast_buffers": False})
        True
    """
    from torch.nn.parallel import DistributedDataParallel

    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}
