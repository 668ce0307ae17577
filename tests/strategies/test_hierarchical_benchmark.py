"""benchmarks/hierarchical.py without training: the traffic model's figures are consistent (compression and
co-partitioning never add bytes to the tagger's choice, HT's critical path is below synchronous data parallel's
for a wide model) and land in the JSON file."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import hierarchical


def test_traffic_model_without_training(tmp_path: Path) -> None:
    out = tmp_path / "ht.json"
    figures = hierarchical.main(["--quick", "--skip-quality", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["ht_over_sync_critical_bytes_wide"] == figures["ht_over_sync_critical_bytes_wide"]
    rows = {r["variant"]: r for r in figures["traffic_wide"]}
    full, plain = rows["HT 2x2, int8 + bf16"], rows["HT 2x2, no compression"]
    assert full["critical_bytes"] < plain["critical_bytes"] < rows["sync data parallel"]["critical_bytes"]
    # the refinement never makes the modelled step slower than the rules alone
    assert full["model_step_ms"] <= rows["HT 2x2, no refinement"]["model_step_ms"]
    assert "machine" in saved and "quality" not in saved
