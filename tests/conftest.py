"""Shared fixtures: tiny models and data, the real-data folder, a free port; the fast tier's time guard."""

from __future__ import annotations

import functools
import importlib.util
import os
import resource
import socket
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("TORCHREC_LOOKAHEAD_DATA", REPO.parent / "shared" / "data"))


def shared_data(*parts: str) -> Path:
    """A path under ../shared/data, skipping the test with a reason when it is absent."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"real data sample {path} is absent (expected ../shared/data beside the repository)")
    return path


#: What a test's own processes (``torch.multiprocessing``) import before they start, once per test process.
PRELOAD = ["torch", "torch.distributed", "torchrec", "torchrec_lookahead", "torchrec_lookahead.distributed"]


def start_method() -> str:
    """How tests start ranks with ``torch.multiprocessing``: ``"forkserver"``, whose server imports torch,
    TorchRec and this package once (``PRELOAD``) and forks each rank from there, single-threaded, instead of
    an interpreter per rank that imports them again (``"spawn"``, about 3 s of CPU each)."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(PRELOAD)  # no effect once this process's server runs
    return "forkserver"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


TINY_TABLES = [
    50,
    20,
    300,
    100,
    7,
    3,
    40,
    30,
    2,
    60,
    25,
    200,
    15,
    5,
    35,
    150,
    4,
    22,
    18,
    3,
    120,
    6,
    5,
    45,
    9,
    55,
]


def tiny_data_args(**overrides: Any) -> Dict[str, Any]:
    args: Dict[str, Any] = dict(
        batch_size=64,
        num_train_batches=12,
        num_val_batches=3,
        num_test_batches=2,
        num_embeddings=list(TINY_TABLES),
        seed=0,
    )
    args.update(overrides)
    return args


@pytest.fixture(scope="session")
def _resident_runs() -> Dict[str, Any]:
    return {}


@pytest.fixture
def shared_resident(_resident_runs: Dict[str, Any]) -> Iterator[None]:
    """``verify`` in this test trains each resident job once per session: a later test that compares another
    cached run with the same resident job (the same model, data, seed and steps) reuses the kept run."""
    from .verify_runs import shared_resident_runs

    with shared_resident_runs(_resident_runs):
        yield


def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker (``make test`` runs two on two cores) runs torch's operators on one thread, and so do the
    processes its tests start: two workers with a team of two OpenMP threads each would oversubscribe the cores,
    and spinning threads inflate every test's time."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")


#: The longest a test's call may take (seconds) without the ``slow`` or ``distributed`` marker: ``make test-fast``
#: runs what is unmarked and stays within its 5 minutes only while each such test is short. ``TRL_FAST_LIMIT_S``
#: moves the bound (0 turns the guard off).
FAST_LIMIT_S = float(os.environ.get("TRL_FAST_LIMIT_S", "10"))
_CPU_S = pytest.StashKey[float]()


def _cpu_seconds() -> float:
    """CPU seconds of this process (all its threads) and of its children that have ended."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    start = _cpu_seconds()
    yield
    item.stash[_CPU_S] = _cpu_seconds() - start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Fail an unmarked test whose call took longer than ``FAST_LIMIT_S``. Only the call counts (a shared
    fixture's work is set-up, counted once wherever it lands), and only the shorter of its wall-clock and CPU
    time: other jobs on the machine stretch the wall clock, a test's own threads add CPU time, neither is the
    test's length."""
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.passed or FAST_LIMIT_S <= 0:
        return
    if item.get_closest_marker("slow") or item.get_closest_marker("distributed"):
        return
    took = min(call.duration, item.stash.get(_CPU_S, call.duration))
    if took > FAST_LIMIT_S:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {took:.1f} s (wall clock {call.duration:.1f} s), over the fast tier's "
            f"{FAST_LIMIT_S:g} s per test: mark it @pytest.mark.slow (or make it shorter) so that `make test-fast` "
            "stays within 5 minutes"
        )


@functools.cache  # the scheduler asks once per test; a module's text is read once
def _launches(path: Path) -> bool:
    """Whether a test module has tests marked ``distributed`` and is not marked ``beside_launches`` (read from its
    text: the controller of an xdist run does not import the tests)."""
    if path.suffix != ".py":
        return False
    text = path.read_text()
    return "mark.distributed" in text and "mark.beside_launches" not in text


if importlib.util.find_spec("xdist") is not None:

    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        """``make test`` runs two pytest-xdist workers. Each module's tests run on one worker, so a module-scoped
        run is made once and shared as it is in a serial run; and every module with ``distributed`` tests runs on
        one worker, one module after another: a torchrun launch already uses every core, and its timing-sensitive
        tests (signals, kill -9, restarts) see the machine as they do serially, while the other worker runs the
        single-process modules beside it, and the modules marked ``beside_launches`` (a few short ranks started
        with ``torch.multiprocessing``: they load the machine as a single-process module does)."""
        from xdist.scheduler import LoadScopeScheduling

        root = config.rootpath

        class ModuleScheduling(LoadScopeScheduling):  # type: ignore[misc]
            def _split_scope(self, nodeid: str) -> str:
                module = nodeid.split("::", 1)[0]
                return "launches" if _launches(root / module) else module

        return ModuleScheduling(config, log)
