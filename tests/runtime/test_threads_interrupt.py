"""Ctrl-C (KeyboardInterrupt) while the lookahead reader thread is blocked inside the wrapped loader's ``next()``:
the stop waits briefly for that thread (it cannot be interrupted), says in one line that it is left behind (a
daemon thread), and returns, instead of waiting ``stop_timeout_s + 30`` seconds. A stop that is no interrupt still
waits for it."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from torchrec_lookahead.runtime._threads import _END, _Run

from ..cli.test_cli import clean_env
from ..conftest import REPO


def _blocked_run(release: threading.Event, join_timeout_s: float) -> _Run:
    """A run whose reader thread is blocked in the loader's ``next()`` until ``release`` (at its second batch),
    with a planner and a stager that end once the run stops."""

    def source() -> Any:
        yield 0
        release.wait(60)
        yield 1

    def read(run: _Run) -> None:
        for b in source():
            if not run.put_read(b):
                return
        run.put_read(_END)

    def plan(run: _Run) -> None:
        for _ in run.read_ahead():
            pass

    def stage(run: _Run) -> None:
        while not run.stopped:
            time.sleep(0.02)

    run = _Run(2, join_timeout_s=join_timeout_s)
    run.start(plan, stage, read)
    time.sleep(0.3)  # the reader took batch 0 and is inside next()
    return run


def test_an_interrupt_leaves_a_reader_blocked_in_the_loader_at_once(caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()
    run = _blocked_run(release, join_timeout_s=90.0)
    try:
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING):
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                run.stop()
        took = time.monotonic() - t0
        assert took < 10, took
        assert run.reader is not None and run.reader.is_alive() and run.reader.daemon
        lines = [r.getMessage() for r in caplog.records if "lookahead" in r.getMessage()]
        assert len(lines) == 1 and "left behind" in lines[0], lines
        assert all(not t.is_alive() for t in run.threads if t is not run.reader)  # planner and stager joined
    finally:
        release.set()


def test_a_stop_that_is_no_interrupt_still_waits_for_the_reader() -> None:
    release = threading.Event()
    run = _blocked_run(release, join_timeout_s=30.0)
    threading.Timer(3.0, release.set).start()
    t0 = time.monotonic()
    run.stop()
    assert time.monotonic() - t0 >= 2.5
    assert all(not t.is_alive() for t in run.threads)


SCRIPT = r"""
import sys, time, signal, threading, torch.distributed as dist
from tests.conftest import free_port
from tests.pipeline_runs import build
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
dmp, p, data = build(True, steps=6)
def slow():
    for i, b in enumerate(data):
        if i == 3:
            time.sleep(60)
        yield b
def intr(*a):
    raise KeyboardInterrupt
signal.signal(signal.SIGALRM, intr)
t0 = time.time()
try:
    with p:
        it = slow()
        signal.alarm(3)
        while True:
            p.progress(it)
except KeyboardInterrupt:
    print("interrupted; exit took %.1f s" % (time.time() - t0 - 3), flush=True)
print("threads", sorted(t.name for t in threading.enumerate()), flush=True)
"""


def test_ctrl_c_of_a_pipeline_whose_loader_blocks_exits_promptly() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=200
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    took = float(out.split("exit took ")[1].split(" s")[0])
    assert took < 15, out[-3000:]
    assert out.count("left behind") == 1, out[-3000:]


@pytest.mark.slow
def test_ctrl_c_of_a_lightning_run_whose_loader_blocks_exits_promptly(tmp_path: Any) -> None:
    cmd = [sys.executable, "-m", "torchrec_lookahead", "fit", "--config", "configs/dlrm_tiny_lookahead.yaml",
           f"--trainer.default_root_dir={tmp_path}",
           "--data.init_args.datamodule.class_path=tests.runtime.slow_loader.SlowCriteo"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=200)
    end = time.time()
    out = proc.stdout + proc.stderr
    assert "blocked at " in out, out[-3000:]
    took = end - float(out.split("blocked at ")[1].split()[0]) - 2.0  # after the SIGINT
    assert took < 30, (took, out[-3000:])  # 90 s (stop_timeout_s + 30) waited for the reader before
    assert out.count("left behind") == 1, out[-3000:]
