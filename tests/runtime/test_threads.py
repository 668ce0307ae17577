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
    after = before + LoaderStats(stager_wait_s=0.5, planned=3, gathered_here=1, hot_batches=4)
    assert after == LoaderStats(stager_wait_s=0.75, planned=5, staged=1, gathered_here=1, hot_batches=4)
    assert after - before == LoaderStats(stager_wait_s=0.5, planned=3, gathered_here=1, hot_batches=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.planned = 0  # type: ignore[misc]
