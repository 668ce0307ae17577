"""benchmarks/plots.py draws every figure from the committed JSON under benchmarks/results/, and the figures the
documentation links exist."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks import plots

from ..conftest import REPO

PNG = b"\x89PNG\r\n\x1a\n"


def test_plots_from_the_committed_results(tmp_path: Path) -> None:
    written = plots.main(["--out", str(tmp_path)])
    assert sorted(p.name for p in written) == sorted(f"{name}.png" for name in plots.PLOTS)
    for path in written:
        data = path.read_bytes()
        assert data.startswith(PNG) and 5_000 < len(data) < 250_000, (path.name, len(data))


def test_a_missing_figure_is_an_error(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(plots.RESULTS, results)
    data = json.loads((results / "sync_volume.json").read_text())
    del data["rows_per_step"]
    (results / "sync_volume.json").write_text(json.dumps(data))
    with pytest.raises(KeyError):
        plots.main(["--results", str(results), "--out", str(tmp_path / "img")])


def test_the_documentation_links_every_figure_and_it_is_committed() -> None:
    linked = set()
    for doc in (REPO / "README.md", REPO / "docs" / "benchmarks.md"):
        linked |= set(re.findall(r"img/(\w+)\.png", doc.read_text()))
    assert linked == set(plots.PLOTS)
    for name in plots.PLOTS:
        assert (plots.OUT / f"{name}.png").read_bytes().startswith(PNG)
