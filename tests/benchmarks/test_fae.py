"""benchmarks/fae.py runs in a tiny variant and reports its headline figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import fae


@pytest.mark.slow
def test_fae_benchmark_quick_variant(tmp_path: Path) -> None:
    out = tmp_path / "fae.json"
    fae.main(
        [
            "--quick",
            "--scale",
            "0.005",
            "--batches",
            "8",
            "--train-batches",
            "0",
            "--cache-batches",
            "0",
            "--json",
            str(out),
        ]
    )
    figures = json.loads(out.read_text())
    assert 0.0 <= figures["estimate_max_rel_error"] and figures["calibration_speedup"] > 0
    assert figures["details"]["synthetic"]["budgets"][0]["hot_rows"] > 0


@pytest.mark.slow
def test_fae_cache_comparison_quick_variant(tmp_path: Path) -> None:
    out = tmp_path / "fae_cache.json"
    fae.main(
        ["--quick", "--skip-calibration", "--train-batches", "0", "--cache-batches", "12", "--json", str(out)]
    )
    figures = json.loads(out.read_text())
    runs = figures["details"]["cache"]["runs"]
    assert runs["resident"]["rows_fetched_per_sample"] == 0.0 and runs["fae"]["steps"] >= 12
    # Hot batches fetch nothing and cold ones only their cold ids: fewer rows than the lookahead-only cache.
    assert 0.0 < figures["fae_over_lookahead_rows_fetched"] < 1.0
    assert figures["fae_over_resident_step_time"] > 0
