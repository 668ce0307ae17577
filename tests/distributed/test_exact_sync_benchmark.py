"""benchmarks/exact_sync.py: its volume recount on a hand-made step, and a short --quick run end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import exact_sync

from ..cli.test_cli import clean_env
from ..conftest import REPO

pytestmark = pytest.mark.beside_launches  # its ranks: torch.multiprocessing, not torchrun


def _step(shared, delayed):
    """A global batch of 4 bags per feature (2 ranks x 2), one id per bag except an empty and a 2-id bag."""
    lengths = torch.ones(len(exact_sync.FEATURES), 4, dtype=torch.int64)
    lengths[0, 1], lengths[0, 2] = 0, 2
    values = (
        torch.arange(int(lengths.sum())) % 5
    )  # feature 0: bags [0], [], [1, 2], [3]; feature 1: [4],[0],...
    empty = torch.zeros(0, dtype=torch.int64)
    pad = [empty] * (len(exact_sync.FEATURES) - len(shared))
    return {"values": values, "lengths": lengths.reshape(-1), "shared": list(shared) + pad,
            "delayed": list(delayed) + pad}  # fmt: skip


def test_volumes_count_the_bags_holding_shared_rows_per_rank():
    # feature 0 shares slots 2 and 3 (rank 1's bags 2 and 3); feature 1 (ids 4, 0, 1, 2) shares slot 0 (rank 0's
    # bag 1), delayed
    step = _step(
        [torch.tensor([2, 3]), torch.tensor([0])], [torch.zeros(0, dtype=torch.int64), torch.tensor([0])]
    )
    v = exact_sync.volumes(step, 2)
    d = exact_sync.DIM
    assert v["payload_off"] == [d, 2 * d] and v["payload_on"] == [d, 2 * d]
    assert v["payload_critical"] == [0, 2 * d] and v["payload_delayed"] == [d, 0]
    assert v["rows_shared"] == 3 and v["rows_delayed"] == 1
    assert v["wire_exact_off"] == 2 * d  # (W - 1) x the largest payload
    assert v["wire_exact_on"] == 2 * d + d  # the critical all-gather, then the delayed one
    assert v["wire_partial"] == pytest.approx(2 * 1 / 2 * 3 * d)


@pytest.mark.parametrize("argv", [["--ranks", "3"], ["--ranks", "1"], ["--steps", "0"]])
def test_bad_arguments_stop_before_any_work(argv):
    with pytest.raises(SystemExit):
        exact_sync.main(argv)


@pytest.mark.slow
@pytest.mark.distributed
def test_quick_run_writes_its_figures(tmp_path: Path):
    out = tmp_path / "exact_sync.json"
    cmd = [sys.executable, "benchmarks/exact_sync.py", "--quick", "--steps", "2", "--warmup", "1",
           "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=clean_env())
    assert done.returncode == 0, done.stderr[-4000:]
    figures = json.loads(out.read_text())
    assert {"config", "results", "machine", "seconds"} <= set(figures)
    r = figures["results"]["2"]
    assert r["timed_steps"] == 2 and r["local_batch"] == 1024
    for k in (
        "exact_off",
        "exact_on",
        "exact_on_land",
        "partial",
        "partial_all_reduce",
        "partial_torch_update",
        "exact_off_cpu",
        "partial_cpu",
    ):
        assert r["ms"][k] > 0, k
    assert r["ratio_exact_off_over_partial"] == pytest.approx(r["ms"]["exact_off"] / r["ms"]["partial"])
    assert r["ratio_cpu_exact_off_over_partial"] > 0
    m = r["mean"]
    assert m["rows_shared"] > m["rows_delayed"] > 0
    assert m["payload_critical"] + m["payload_delayed"] == pytest.approx(m["payload_off"])
    assert m["wire_exact_off"] >= m["payload_off"] > 0 and m["wire_partial"] == pytest.approx(
        m["rows_shared"] * 16
    )
    # the first step's check: delayed sync changes nothing; the partial sums round differently, but barely
    assert r["check"]["exact_on_vs_off_max_abs"] == 0.0
    assert 0.0 <= r["check"]["partial_vs_exact_max_abs"] < 1e-5
