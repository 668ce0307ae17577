"""The command line, built in-process (``torchrec_lookahead.cli.main``) except for one real subprocess smoke
test (``test_default_config_fits_a_few_steps_and_writes_tensorboard_logs``; ``tests/cli/test_errors.py`` has
another for the one-line error a user sees)."""

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest

from torchrec_lookahead.cli import main

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


def cli_in_process(capsys: pytest.CaptureFixture, args: List[str]) -> Tuple[int, str, str]:
    """Run ``python -m torchrec_lookahead <args>`` in this process, from the repository root: (exit status,
    stdout, stderr)."""
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.chdir(cwd)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_config_loads(capsys, config):
    code, out, err = cli_in_process(capsys, ["fit", "--config", str(config), "--print_config"])
    assert code == 0, err[-3000:]
    assert "class_path" in out


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


def test_tiny_validate_and_test_subcommands(capsys, tmp_path):
    for cmd in ("validate", "test"):
        code, out, err = cli_in_process(
            capsys, [cmd, "--config", "configs/dlrm_tiny.yaml", f"--trainer.default_root_dir={tmp_path}"]
        )
        assert code == 0, err[-3000:]
        assert f"{'val' if cmd == 'validate' else 'test'}/auc" in out


def test_bad_config_values_fail_with_typed_errors(capsys):
    code, _, err = cli_in_process(
        capsys,
        ["fit", "--config", "configs/dlrm_tiny.yaml", "--model.init_args.embedding_optimizer.name=adamw"],
    )
    assert code != 0 and "ConfigError" in err and "adamw" in err
    code, _, err = cli_in_process(
        capsys,
        [
            "fit",
            "--config",
            "configs/dlrm_tiny.yaml",
            "--data.init_args.num_embeddings=[0,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]",
        ],
    )
    assert code != 0 and "must be a positive integer" in err


def test_criteo_tsv_config_with_a_missing_file_names_it(capsys, tmp_path):
    shared_data("criteo_kaggle_head")
    code, _, err = cli_in_process(
        capsys,
        [
            "fit",
            "--config",
            "configs/criteo_tsv.yaml",
            f"--data.init_args.train_files={tmp_path}/missing.tsv",
        ],
    )
    assert code != 0 and "DataError" in err and "missing.tsv" in err


def test_help_lists_the_project_s_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "fit" in out and "verify" in out and "export" in out and "calibrate" in out


def test_a_cached_fit_shows_the_cache_plan_and_the_capacity_check(capsys, caplog, tmp_path):
    caplog.set_level(logging.INFO)
    args = ["fit", "--config", "configs/dlrm_tiny_lookahead.yaml", "--trainer.max_steps=2",
            f"--trainer.default_root_dir={tmp_path}", "--trainer.limit_val_batches=0"]  # fmt: skip
    code, out, err = cli_in_process(capsys, args)
    assert code == 0, err[-3000:]
    text = out + err + caplog.text
    assert "Lookahead cache: t_cat_11 120 rows, t_cat_15 110 rows, t_cat_2 140 rows" in text, text[-3000:]
    assert "Lookahead capacity check: 12 batches read ahead" in text
    # the three tables share one cache (the pooled layout): its need against the sum of their capacities; each
    # table's own need is no overflow of its share (it printed as "t_cat_15: 3,160 of 2,800 cache rows")
    assert "tables t_cat_2, t_cat_11, t_cat_15 (one shared cache): 182 of 370 cache rows" in text
    assert "each table's own windows: t_cat_2 68, t_cat_11 63, t_cat_15 64" in text
    assert "t_cat_2: 68 of 140" not in text
    assert "Lookahead capacity check: 100%" in err and "12/12" in err  # the pre-scan's progress bar
    assert "args parameter" not in err  # no warning about the CLI's own argument passing
    # ... and both as text in the TensorBoard logs
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = {p.parent for p in tmp_path.rglob("events.out.tfevents.*")}
    events = EventAccumulator(str(run), size_guidance={"tensors": 0})
    events.Reload()
    texts = {
        tag: events.Tensors(tag)[0].tensor_proto.string_val[0].decode()
        for tag in events.Tags()["tensors"]
        if tag.startswith("lookahead/")
    }
    assert "t_cat_2 140 rows" in texts["lookahead/cache/text_summary"], texts
    assert "182 of 370 cache rows" in texts["lookahead/capacity_check/text_summary"]


def test_ctrl_c_while_the_libraries_import_is_one_line_and_status_130(capsys, monkeypatch):
    """Ctrl-C in the first seconds (torch, TorchRec and Lightning importing) printed a 35-line KeyboardInterrupt
    traceback through the libraries' imports."""
    import importlib.abc
    import runpy

    class Interrupted(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torchrec_lookahead.cli":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "torchrec_lookahead.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Interrupted(), *sys.meta_path])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("torchrec_lookahead", run_name="__main__")
    assert exit_.value.code == 130
    assert capsys.readouterr().err == "Interrupted while starting up\n"
