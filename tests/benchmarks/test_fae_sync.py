"""benchmarks/fae_sync.py runs two gloo ranks in a tiny variant and reports its headline figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import fae_sync

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def test_fae_sync_benchmark_quick_variant(tmp_path: Path) -> None:
    out = tmp_path / "fae_sync.json"
    fae_sync.main(["--quick", "--steps", "8", "--batch-size", "128", "--json", str(out)])
    figures = json.loads(out.read_text())
    la, fae = figures["runs"]["lookahead"], figures["runs"]["fae"]
    assert la["steps"] == fae["steps"] == 8
    # the pinned rows sit in the same caches on top of the dynamic slots, and both runs exchange gradients
    assert fae["device_cache_rows"] > la["device_cache_rows"]
    assert la["grad_bytes_per_step"] > 0 and fae["grad_bytes_per_step"] > 0
    assert figures["fae_over_lookahead_rows_fetched"] > 0 and figures["fae_over_lookahead_grad_bytes"] > 0
