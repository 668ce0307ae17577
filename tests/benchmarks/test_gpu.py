"""benchmarks/gpu.py runs its five code paths on the CPU (``--device cpu``) and reports both resident anchors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ..cli.test_cli import clean_env
from ..conftest import REPO


@pytest.mark.slow
def test_gpu_benchmark_on_cpu(tmp_path: Path) -> None:
    # its own interpreter: the script silences logging and warnings process-wide, as a benchmark should
    out = tmp_path / "gpu.json"
    args = [
        "--device",
        "cpu",
        "--quick",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--rounds",
        "1",
        "--json",
        str(out),
    ]
    run = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=clean_env(),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert saved["cached_over_resident"] == pytest.approx(saved["cached_step_ms"] / saved["resident_step_ms"])
    for kind in ("resident", "resident_bg", "cached", "fae", "host"):
        assert saved[f"{kind}_step_ms"] > 0
    assert saved["fae_over_resident"] == pytest.approx(saved["fae_step_ms"] / saved["resident_step_ms"])
    assert saved["cached_over_resident_background_loading"] == pytest.approx(
        saved["cached_step_ms"] / saved["resident_bg_step_ms"]
    )
