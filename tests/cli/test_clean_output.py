"""What a newcomer reads: a fit of the tiny config prints no warning that is not this package's; the libraries'
known-harmless ones are shown with ``--verbose``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import List

import pytest

from torchrec_lookahead._quiet import KNOWN_LOG_MESSAGES, KNOWN_WARNINGS

from .test_cli import run_cli

TINY = "configs/dlrm_tiny_lookahead.yaml"
# a warning as Python prints it ("FutureWarning: ..."), as Lightning prints it ("<file>.py:<line>: ..."), or a log
# record at level WARNING (Python's "WARNING:<logger>:", torch's "W<mmdd> <time> ...")
_WARNING_LINE = re.compile(r"Warning\b|WARNING|\bW\d{4} \d\d:|\.py:\d+: ")


def _foreign_warnings(output: str) -> List[str]:
    return [
        line
        for line in output.splitlines()
        if _WARNING_LINE.search(line) and "torchrec_lookahead" not in line
    ]


@pytest.fixture
def python_warnings_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    """The child prints Python's warnings as a user's shell would (the suite's children ignore them)."""
    monkeypatch.delenv("PYTHONWARNINGS", raising=False)


@pytest.mark.slow
@pytest.mark.usefixtures("python_warnings_shown")
def test_fit_of_the_tiny_config_prints_no_warning_that_is_not_ours(tmp_path: Path) -> None:
    out = run_cli("fit", "--config", TINY, f"--trainer.default_root_dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert _foreign_warnings(text) == [], text[-5000:]
    assert "Tip:" not in text  # Lightning's cloud advertisements
    assert "Lookahead cache: t_cat_11 120 rows" in text and "Final metrics:" in text


@pytest.mark.slow
@pytest.mark.usefixtures("python_warnings_shown")
def test_verbose_shows_the_known_harmless_messages(tmp_path: Path) -> None:
    out = run_cli("fit", "--config", TINY, "--verbose", f"--trainer.default_root_dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    shown = [
        pattern
        for _, pattern, why in KNOWN_WARNINGS + [(None, p, w) for _, p, w in KNOWN_LOG_MESSAGES]
        if "not by fit" not in why  # the predict loop's (tests/cli/test_predict.py)
    ]
    assert all(re.search(pattern, text) for pattern in shown), text[-5000:]


def test_tensorboard_writer_thread_errors_are_left_to_the_thread_that_raises_them_again(capsys) -> None:
    import threading

    from torchrec_lookahead._quiet import _quiet_thread_errors

    seen = []
    hook = _quiet_thread_errors(seen.append)

    class _AsyncWriterThread(threading.Thread):
        pass

    class Other(threading.Thread):
        pass

    def args(thread: threading.Thread) -> object:
        return threading.ExceptHookArgs((OSError, OSError(28, "No space left on device"), None, thread))

    hook(args(_AsyncWriterThread()))
    assert seen == []
    hook(args(Other()))
    assert len(seen) == 1
    assert _quiet_thread_errors(hook) is hook


@pytest.mark.slow
@pytest.mark.usefixtures("python_warnings_shown")
def test_validate_from_a_checkpoint_prints_no_note_on_the_callbacks_it_restores(tmp_path: Path) -> None:
    """Lightning's "The dirpath has changed from ..." (and "Be aware that when using `ckpt_path`, callbacks ...")
    are about resuming; validate, test and predict resume nothing. --verbose still shows them."""
    trained = run_cli(
        "fit", "--config", TINY, "--trainer.max_steps=2", f"--trainer.default_root_dir={tmp_path}/a"
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    (ckpt,) = (tmp_path / "a").glob("lightning_logs/version_0/checkpoints/*.ckpt")
    args = ["validate", "--config", TINY, f"--ckpt_path={ckpt}", f"--trainer.default_root_dir={tmp_path}/b"]
    out = run_cli(*args)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _foreign_warnings(out.stdout + out.stderr) == [], (out.stdout + out.stderr)[-5000:]
    verbose = run_cli(*args, "--verbose")
    assert "The dirpath has changed from" in verbose.stdout + verbose.stderr
