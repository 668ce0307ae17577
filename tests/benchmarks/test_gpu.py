"""benchmarks/gpu.py runs its four code paths on the CPU (``--device cpu``) and reports both resident anchors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import gpu


@pytest.mark.slow
def test_gpu_benchmark_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    figures = gpu.main(
        ["--device", "cpu", "--quick", "--steps", "3", "--warmup", "1", "--rounds", "1", "--json", str(out)]
    )
    saved = json.loads(out.read_text())
    assert saved["cached_over_resident"] == pytest.approx(saved["cached_step_ms"] / saved["resident_step_ms"])
    assert figures["capacity"] == saved["capacity"]
    for kind in ("resident", "resident_bg", "cached", "host"):
        assert saved[f"{kind}_step_ms"] > 0
    assert saved["cached_over_resident_background_loading"] == pytest.approx(
        saved["cached_step_ms"] / saved["resident_bg_step_ms"]
    )
