"""benchmarks/gpu_suite.py runs every part on the CPU (``--cpu-smoke``) and records each in its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ..cli.test_cli import clean_env
from ..conftest import REPO

PARTS = (
    "env",
    "cuda_tests",
    "sync_checks",
    "verify_default",
    "verify_fae_adam",
    "two_ranks",
    "bench_default",
    "bench_kaggle",
)


@pytest.mark.slow
def test_gpu_suite_cpu_smoke(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "benchmarks/gpu_suite.py", "--cpu-smoke", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env=clean_env(),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    saved = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert saved["mode"] == "cpu-smoke" and tuple(saved["parts"]) == PARTS
    failed = {k: v.get("output_tail", v) for k, v in saved["parts"].items() if not v.get("ok")}
    assert not failed, failed
    assert saved["parts"]["env"]["info"]["fbgemm_cumsum"] == [0, 1, 3, 6]
    tests = saved["parts"]["cuda_tests"]["tests"]
    assert tests and all(t["outcome"] in ("passed", "skipped") for t in tests.values()), tests
    assert any("max_abs_weight_diff" in t.get("properties", {}) for t in tests.values())
    syncs = saved["parts"]["sync_checks"]["syncs"]["test_no_synchronisation_by_the_cache_in_a_steady_step"]
    assert (
        json.loads(syncs["syncs_by_the_cache_on_the_training_thread"]) == {}
    )  # the CPU has none: the harness ran
    assert min(json.loads(syncs["rows_written_back_per_step"])) > 0  # steady steps, every one evicting
    for part in ("verify_default", "verify_fae_adam"):
        assert saved["parts"][part]["max_abs_weight_diff"] == 0.0
    assert [r["max_dw"] for r in saved["parts"]["two_ranks"]["runs"]["pipeline_gloo"]["ranks"]] == [0.0, 0.0]
    assert saved["parts"]["bench_default"]["figures"]["cached_step_ms"] > 0
    # the UVM anchor needs CUDA: skipped with the reason, its plan checked; the summary picks the runs up
    summary = saved["parts"]["bench_default"]["summary"]
    assert summary["complete"] and summary["step_ms"]["cached"] > 0
    assert "needs CUDA" in summary["runs"]["uvm_lru"]["skipped"]
    assert summary["runs"]["cached"]["hit_rate"] >= 0
    kaggle = saved["parts"]["bench_kaggle"]["figures"]
    assert kaggle["capacity"] and kaggle["uvm_plan"]["fbgemm_cache_slots"] > 0
    assert kaggle["uvm_plan_5pct"]["fbgemm_cache_slots"] > kaggle["uvm_plan"]["fbgemm_cache_slots"]
    assert (tmp_path / "gpu_suite.log").stat().st_size > 0
