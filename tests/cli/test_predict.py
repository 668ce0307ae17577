"""``predict`` from a checkpoint: probabilities written by PredictionWriter; a cached run's checkpoint predicts
exactly what the resident run's does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .test_clean_output import _foreign_warnings, python_warnings_shown  # noqa: F401 (a fixture)
from .test_cli import run_cli


def _writer(tmp_path: Path, name: str) -> str:
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(
        "trainer:\n  callbacks:\n    - class_path: torchrec_lookahead.callbacks.PredictionWriter\n"
        f"      init_args: {{path: {tmp_path / name}.pt}}\n"
    )
    return str(cfg)


def _fit_and_predict(tmp_path: Path, config: str, name: str) -> torch.Tensor:
    root = tmp_path / name
    out = run_cli("fit", "--config", config, "--trainer.max_steps=4", f"--trainer.default_root_dir={root}")
    assert out.returncode == 0, out.stderr[-3000:]
    (ckpt,) = root.rglob("*.ckpt")
    out = run_cli(
        "predict", "--config", config, "--config", _writer(tmp_path, name), f"--ckpt_path={ckpt}",
        f"--trainer.default_root_dir={root}",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    # the libraries' known-harmless messages of a checkpoint read and of the predict loop are kept out (the others
    # left, Lightning's notes on this test's callbacks and directories, concern how the test layers its configs)
    known = ("Couldn't infer the batch indices", "deprecating ShardedTensor")
    assert not [w for w in _foreign_warnings(out.stdout + out.stderr) if any(k in w for k in known)], (
        out.stderr
    )
    return torch.load(tmp_path / f"{name}.pt")


@pytest.mark.slow
@pytest.mark.usefixtures("python_warnings_shown")
def test_predict_from_a_checkpoint_writes_probabilities_and_cached_equals_resident(tmp_path):
    resident = _fit_and_predict(tmp_path, "configs/dlrm_tiny.yaml", "resident")
    assert resident.shape == (2 * 64,)  # the two test batches of 64
    assert bool(((resident > 0) & (resident < 1)).all())
    cached = _fit_and_predict(tmp_path, "configs/dlrm_tiny_lookahead.yaml", "cached")
    assert torch.equal(cached, resident)  # the cached run's checkpoint serves the same model, bit for bit
    out = run_cli("predict", "--config", "configs/dlrm_tiny.yaml", "--config", _writer(tmp_path, "untrained"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert not torch.equal(torch.load(tmp_path / "untrained.pt"), resident)  # the checkpoint was loaded
