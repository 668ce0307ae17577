"""A disk store's host-tier refusal sets ``needed`` to the number its message names: the largest window of the
batches checked, not the first window that does not fit (as the device caches' refusal does,
tests/runtime/test_scan_largest_need.py), so a user who raises the host tier to ``needed`` rows is not refused
again at a later, larger window."""

from typing import Dict, List

import pytest
import torch

from torchrec_lookahead import CapacityError
from torchrec_lookahead.runtime.capacity import check_stream
from torchrec_lookahead.store.types import HostWindow


def _growing() -> List[Dict[str, torch.Tensor]]:
    """Batches of 3, 5 and 8 distinct ids (host windows of depth 0 and policy lru: 3, 5, 8 rows)."""
    return [{"f": torch.tensor(list(range(k * 10, k * 10 + n)))} for k, n in enumerate((3, 5, 8))]


def test_a_host_refusal_sets_needed_to_the_largest_window_it_names() -> None:
    window = HostWindow(0, (0, 100), (4,), "lru", row_bytes=10)
    with pytest.raises(CapacityError) as info:
        check_stream(_growing(), {"t": 20}, {"f": "t"}, {"t": 100}, 1, {"t": window})
    msg = str(info.value)
    assert msg.startswith("table 't': batch 1 needs 5 rows in the host tier"), msg  # the first short window
    assert "holds at least 8 rows (80 bytes)" in msg and "need {'t': 8} rows" in msg, msg
    assert (info.value.needed, info.value.available, info.value.batch) == (8, 4, 1), info.value.facts
    # a host tier of ``needed`` rows passes
    raised = HostWindow(0, (0, 100), (int(info.value.needed or 0),), "lru", row_bytes=10)
    assert check_stream(_growing(), {"t": 20}, {"f": "t"}, {"t": 100}, 1, {"t": raised}) == {"t": 13}
