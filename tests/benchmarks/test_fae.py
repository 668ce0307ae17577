"""benchmarks/fae.py runs in a tiny variant and reports its headline figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import fae


@pytest.mark.slow
def test_fae_benchmark_quick_variant(tmp_path: Path) -> None:
    out = tmp_path / "fae.json"
    fae.main(["--quick", "--scale", "0.005", "--batches", "8", "--train-batches", "0", "--json", str(out)])
    figures = json.loads(out.read_text())
    assert 0.0 <= figures["estimate_max_rel_error"] and figures["calibration_speedup"] > 0
    assert figures["details"]["synthetic"]["budgets"][0]["hot_rows"] > 0
