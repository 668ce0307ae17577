"""ShardedLookaheadCollection's flush on the exception path over row-sharded stores."""

import logging
from types import SimpleNamespace

from torchrec_lookahead.distributed._rank_sync import StepState
from torchrec_lookahead.distributed.sharded_collection import ShardedLookaheadCollection


def test_the_exception_path_says_once_that_rows_since_the_last_checkpoint_are_not_written_back(caplog):
    """The strategy and the session both flush without a barrier when a peer is gone: the warning that the
    row-sharded stores are not written is one line, not one per flush."""
    collection = SimpleNamespace(
        world_size=2,
        collective_stores=True,
        step_state=StepState(dirty=True),
        land_delayed=lambda timeout=None: None,
    )
    with caplog.at_level(logging.WARNING, logger="torchrec_lookahead.distributed.sharded_collection"):
        ShardedLookaheadCollection.flush(collection, barrier=False)  # type: ignore[arg-type]
        ShardedLookaheadCollection.flush(collection, barrier=False)  # type: ignore[arg-type]
    said = [r for r in caplog.records if "not flushing the lookahead cache" in r.getMessage()]
    assert len(said) == 1
    assert collection.step_state.dirty  # nothing was written: the cache is still ahead of its stores
