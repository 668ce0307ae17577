"""``benchmarks/disk_tier.py --replay``: the rows-read figures of the four disk runs from the plans replayed
through the disk stores, consistent with each other (every policy computes the same rows, those fetched for the
first time, and reads none of them; every row read is a first read or a re-read; the offline optimum reads no
more than any policy)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._common import clean_env

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_replay_figures_are_consistent(tmp_path: Path) -> None:
    out = tmp_path / "replay.json"
    env = {**clean_env(), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    args = ["--replay", "--scale", "0.001", "--steps", "6", "--warmup", "1", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, "benchmarks/disk_tier.py", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    f = json.loads(out.read_text())
    assert f["replay"] is True and f["machine"] and "random_reads_per_s" not in f
    runs = {r["run"]: r for r in f["runs"]}
    assert set(runs) == {"disk_25", "disk_10", "disk_25_lookahead", "disk_10_lookahead"}
    computed = {r["initialised_per_step"] for r in runs.values()}
    assert (
        len(computed) == 1 and computed.pop() > 0
    )  # first fetches: never written, computed under any policy
    for r in runs.values():
        assert r["first_reads_per_step"] == 0, r  # every row read was written before, and so held before
        assert math.isclose(r["first_reads_per_step"] + r["rereads_per_step"], r["rows_read_per_step"])
        assert r["host_hits_per_step"] >= 0 and r["units_read_per_step"] >= 0
    for pct in ("25", "10"):
        lru, ahead = runs[f"disk_{pct}"], runs[f"disk_{pct}_lookahead"]
        assert math.isclose(
            f["lookahead_over_lru_rows_read"][pct],
            ahead["rows_read_per_step"] / max(lru["rows_read_per_step"], 1e-9),
        )
        # the offline optimum computes the same rows and reads no more rows than any policy
        best = f["offline_optimum"][pct]
        assert math.isclose(best["initialised_per_step"], lru["initialised_per_step"])
        assert (
            best["rows_read_per_step"] <= min(lru["rows_read_per_step"], ahead["rows_read_per_step"]) + 1e-9
        )
        assert math.isclose(
            f["optimum_over_lru_rows_read"][pct],
            best["rows_read_per_step"] / max(lru["rows_read_per_step"], 1e-9),
        )
