import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import REPO, shared_data

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def clean_env() -> dict:
    """The environment without the launcher variables an in-process Trainer of an earlier test may have set
    (a child would otherwise try to listen on this process's MASTER_PORT)."""
    drop = {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def run_cli(*args: str, cwd: Path = REPO, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "torchrec_lookahead", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean_env(),
    )


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_config_loads(config):
    out = run_cli("fit", "--config", str(config), "--print_config")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "class_path" in out.stdout


@pytest.mark.slow
def test_default_config_fits_a_few_steps_and_writes_tensorboard_logs(tmp_path):
    out = run_cli(
        "fit",
        "--config",
        "configs/dlrm_synthetic.yaml",
        "--trainer.max_steps=3",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.limit_val_batches=1",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    events = list(tmp_path.rglob("events.out.tfevents.*"))
    assert events, f"no TensorBoard event files under {tmp_path}"
    assert "TensorBoard logs:" in out.stdout and "Final metrics:" in out.stdout


def test_tiny_validate_and_test_subcommands(tmp_path):
    for cmd in ("validate", "test"):
        out = run_cli(cmd, "--config", "configs/dlrm_tiny.yaml", f"--trainer.default_root_dir={tmp_path}")
        assert out.returncode == 0, out.stderr[-3000:]
        assert f"{'val' if cmd == 'validate' else 'test'}/auc" in out.stdout


def test_bad_config_values_fail_with_typed_errors(tmp_path):
    out = run_cli(
        "fit", "--config", "configs/dlrm_tiny.yaml", "--model.init_args.embedding_optimizer.name=adamw"
    )
    assert out.returncode != 0 and "ConfigError" in out.stderr and "adamw" in out.stderr
    out = run_cli(
        "fit",
        "--config",
        "configs/dlrm_tiny.yaml",
        "--data.init_args.num_embeddings=[0,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]",
    )
    assert out.returncode != 0 and "must be a positive integer" in out.stderr


def test_criteo_tsv_config_with_a_missing_file_names_it(tmp_path):
    shared_data("criteo_kaggle_head")
    out = run_cli(
        "fit", "--config", "configs/criteo_tsv.yaml", f"--data.init_args.train_files={tmp_path}/missing.tsv"
    )
    assert out.returncode != 0 and "DataError" in out.stderr and "missing.tsv" in out.stderr


def test_help_lists_the_project_s_commands(capsys):
    from torchrec_lookahead.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "fit" in out and "verify" in out and "export" in out


def test_a_cached_fit_shows_the_cache_plan_and_the_capacity_check(tmp_path):
    out = run_cli(
        "fit",
        "--config",
        "configs/dlrm_tiny_lookahead.yaml",
        "--trainer.max_steps=2",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.limit_val_batches=0",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "Lookahead cache: t_cat_11 120 rows, t_cat_15 110 rows, t_cat_2 140 rows" in text, text[-3000:]
    assert "Lookahead capacity check: 12 batches read ahead" in text
