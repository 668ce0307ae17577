"""ApplyProgress: the no-stale-read rule for one rank and for several; LoaderStats: the loader's counters."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from torchrec_lookahead.runtime._threads import ApplyProgress, LoaderStats


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_the_rule_depends_on_the_rank_count_only_here(num_ranks: int) -> None:
    progress = ApplyProgress(num_ranks)
    assert progress.last == -1
    progress.begin(3)
    # several ranks: beginning step 3 proves every rank's plan 2 landed; one rank knows nothing yet
    assert progress.last == (2 if num_ranks > 1 else -1)
    progress.applied(3)
    assert progress.last == (2 if num_ranks > 1 else 3)
    progress.begin(1)  # never goes back
    assert progress.last == (2 if num_ranks > 1 else 3)
    progress.reset()
    assert progress.last == -1


def test_wait_returns_once_applied_or_stopped() -> None:
    progress = ApplyProgress(1)
    done = threading.Event()

    def stager() -> None:
        progress.wait(5, lambda: False)
        done.set()

    thread = threading.Thread(target=stager)
    thread.start()
    progress.applied(4)
    assert not done.wait(0.2)  # plan 5 not applied: the stager still waits
    progress.applied(5)
    assert done.wait(10.0)
    thread.join()
    progress.wait(99, lambda: True)  # a stopped run does not wait
    assert progress.last == 5


def test_loader_stats_is_a_frozen_snapshot_with_field_wise_differences() -> None:
    before = LoaderStats(stager_wait_s=0.25, planned=2, staged=1)
    after = before + LoaderStats(stager_wait_s=0.5, planned=3, gathered_here=1, read=4)
    assert after == LoaderStats(stager_wait_s=0.75, planned=5, staged=1, gathered_here=1, read=4)
    assert after - before == LoaderStats(stager_wait_s=0.5, planned=3, gathered_here=1, read=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.planned = 0  # type: ignore[misc]


def test_the_planner_never_takes_a_reader_not_yet_started_for_one_that_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reader thread starts before the planner: on a loaded machine the planner could run for longer than
    its first wait before a reader started after it ran, and took it (not alive, nothing read) for a reader that
    ended without handing over the loader's end. Here every thread started after the planner is held back."""
    import time

    from torchrec_lookahead.runtime._threads import _END, _Run

    planner_started = threading.Event()
    real_start = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if planner_started.is_set():
            time.sleep(0.3)  # six of the planner's waits for a read
        real_start(self)
        if self.name == "lookahead-oracle":
            planner_started.set()

    monkeypatch.setattr(threading.Thread, "start", start)
    run, got, errors = _Run(queue_depth=2), [], []

    def plan(r: _Run) -> None:
        try:
            got.extend(r.read_ahead())
        except RuntimeError as e:
            errors.append(e)

    def read(r: _Run) -> None:
        for b in (1, 2, 3):
            r.put_read(b)
        r.put_read(_END)

    run.start(plan, lambda r: None, read)
    for t in run.threads:
        t.join(5)
    assert not errors and got == [1, 2, 3]
