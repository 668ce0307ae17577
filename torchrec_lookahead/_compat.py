"""What differs between the versions of the stack the package runs on, in one place.

The project's environment is torch 2.13, fbgemm-gpu 1.8 and torchrec 1.8; GPU machines may carry older builds
(torch 2.11 with CUDA 13, fbgemm-gpu 1.6, torchrec 1.6).

* fbgemm-gpu 1.6 checks its version against a table of torch versions that has no entry for itself and logs a
  multi-line warning (on the root logger, coloured) for each of its 14 libraries at import; every command's
  output, its short error messages included, then opened with 70 lines of it. :func:`install` drops that one
  notice (only it: a real version mismatch is still reported).
"""

from __future__ import annotations

import logging

__all__ = ["install"]

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
