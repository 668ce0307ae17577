"""benchmarks/fae.py runs in a tiny variant and reports its headline figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import fae
from benchmarks._fae_calibration import DATA


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
    # the box is measured on at least 8 sampled batches (here all 8 of 4,096), FAE's fixed box beside it
    assert figures["details"]["synthetic"]["accuracy_sampled_samples"] == 8 * 4096
    assert 0.0 <= figures["fixed_box_estimate_max_rel_error"]


@pytest.mark.slow
def test_fae_cache_comparison_quick_variant(tmp_path: Path) -> None:
    out = tmp_path / "fae_cache.json"
    fae.main(
        [
            "--quick",
            "--skip-calibration",
            "--train-batches",
            "0",
            "--cache-batches",
            "12",
            "--cache-epochs",
            "2",
        ]
        + ["--repeats", "1", "--json", str(out)]
    )
    figures = json.loads(out.read_text())
    details = figures["details"]["cache"]
    runs = details["runs"]
    assert [sorted(r) for r in details["rounds"]] == [sorted(fae.CACHE_RUNS)]
    assert runs["resident"]["rows_fetched_per_sample"] == 0.0
    # FAE's caches hold the lookahead-only slots plus the pinned rows, which it fetches (once) on top of the cold
    # rows: on 12 batches that can exceed the lookahead-only traffic, so the ratio's value is not checked here
    # (hot batches moving nothing is tested in tests/fae/test_lookahead.py).
    assert runs["fae"]["device_cache_rows"] == runs["lookahead_same_memory"]["device_cache_rows"]
    assert runs["fae"]["device_cache_rows"] > runs["lookahead"]["device_cache_rows"]
    floor = figures["compulsory_rows_per_sample"]
    for kind in ("lookahead", "lookahead_same_memory", "fae"):
        # a cache that starts empty fetches every distinct row of the first epoch at least once
        assert runs[kind]["fetched_epoch_1"] >= floor > 0
        assert runs[kind]["rows_fetched_per_sample"] > 0 and runs[kind]["fetched_epoch_2"] >= 0
    assert figures["fae_over_lookahead_rows_fetched"] > 0 and figures["fae_over_resident_step_time"] > 0
    assert figures["fae_over_resident_cpu_time"] > 0


@pytest.mark.slow
def test_fae_recalibration_quick_variant(tmp_path: Path) -> None:
    if not (DATA / "taobao_userbehavior_head").exists():
        pytest.skip(f"the Taobao sample is absent ({DATA})")
    out = tmp_path / "recal.json"
    fae.main(["--recalibrate", "--quick", "--json", str(out)])
    figures = json.loads(out.read_text())
    rows = figures["details"]["rows"]
    assert [(r["hot_set"], r["epoch"]) for r in rows] == [
        ("fixed", 1),
        ("fixed", 2),
        ("recalibrated", 1),
        ("recalibrated", 2),
    ]
    assert rows[3]["promoted"] > 0 and rows[0]["hot_access_share"] == rows[2]["hot_access_share"]
    assert figures["recalibrated_hot_access_share"] > figures["fixed_hot_access_share"]
