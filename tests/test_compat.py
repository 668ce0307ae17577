"""The shims of ``torchrec_lookahead._compat`` for the older stack of GPU machines (fbgemm-gpu 1.6, torch 2.11)."""

from __future__ import annotations

import logging
import subprocess
import sys

from torchrec_lookahead import _compat

from .cli.test_cli import clean_env
from .conftest import REPO


def test_fbgemm_version_notice_is_dropped_and_other_records_pass() -> None:
    _compat.install()
    _compat.install()  # idempotent
    root = logging.getLogger()
    assert sum(isinstance(f, _compat._FbgemmVersionNotice) for f in root.filters) == 1
    notice = "\n\x1b[33m\n_fbgemm_torch_compat_table has no entry for 1.6.0 of FBGEMM;\ncannot determine ..."
    assert not root.filter(logging.makeLogRecord({"msg": notice}))
    assert root.filter(logging.makeLogRecord({"msg": "FBGEMM_GPU version is 1.6.0, which is not guaranteed"}))


def test_importing_the_package_then_fbgemm_prints_no_version_notice() -> None:
    code = "import torchrec_lookahead, fbgemm_gpu, torchrec; import logging; logging.warning('kept')"
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, env=clean_env()
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "_fbgemm_torch_compat_table" not in run.stderr, run.stderr[-2000:]
    assert "kept" in run.stderr


def test_ddp_no_buffer_sync_names_the_argument_the_installed_torch_takes() -> None:
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    kwargs = _compat.ddp_no_buffer_sync()
    assert list(kwargs.values()) == [False]
    assert set(kwargs) <= set(inspect.signature(DistributedDataParallel.__init__).parameters)
