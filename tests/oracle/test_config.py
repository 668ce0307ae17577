"""The lookahead settings' checks: every part of the lookahead (oracle, loader, budget planner) applies them."""

from __future__ import annotations

import pytest

from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.oracle import LookaheadSettings
from torchrec_lookahead.oracle.config import MAX_HORIZON, check_lookahead


def test_a_horizon_past_the_bound_is_refused_before_anything_is_allocated() -> None:
    assert check_lookahead(MAX_HORIZON, 1) == (MAX_HORIZON, 1)
    with pytest.raises(
        ConfigError, match=r"horizon must be at most 1,000,000 batches but got 100,000,000,000"
    ):
        LookaheadSettings(horizon=10**11)
    with pytest.raises(ConfigError, match="horizon must be >= prefetch_depth=3"):
        check_lookahead(2, 3)
