import json

import pytest

from .test_cli import run_cli


@pytest.mark.slow
def test_verify_passes_on_the_tiny_cached_config_and_fails_on_an_impossible_tolerance():
    out = run_cli("verify", "--config", "configs/dlrm_tiny_lookahead.yaml", "--steps", "20")
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["passed"] and result["steps"] == 20
    assert result["max_abs_weight_diff"] <= result["tolerance"] == 1e-5
    assert {"max_abs_loss_diff", "tensors"} <= result.keys()
    out = run_cli(
        "verify", "--config", "configs/dlrm_tiny_lookahead.yaml", "--steps", "3", "--tolerance", "-1"
    )
    assert out.returncode == 1 and json.loads(out.stdout.strip().splitlines()[-1])["passed"] is False


def test_verify_refuses_a_config_without_the_torchrec_strategy(tmp_path):
    cfg = tmp_path / "plain.yaml"
    cfg.write_text("trainer:\n  strategy: auto\n")
    out = run_cli("verify", "--config", "configs/dlrm_tiny.yaml", "--config", str(cfg), "--steps", "1")
    assert out.returncode != 0 and "strategy='torchrec'" in out.stderr
