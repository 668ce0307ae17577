"""Errors a user reads: a LookaheadError from the CLI reaches the user first and short, with its own type."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from torchrec_lookahead.cli import main
from torchrec_lookahead.errors import ConfigError

from ..conftest import REPO, free_port
from .test_cli import clean_env, run_cli

TINY = "configs/dlrm_tiny_lookahead.yaml"
SHARDERS = "--trainer.strategy.init_args.sharders=" + (
    '[{"class_path": "torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder",'
    ' "init_args": {"capacity": {"t_cat_2": CAP}}}]'
)


def _tsv_config(tmp_path: Path, train: Path) -> str:
    path = tmp_path / "tsv.yaml"
    path.write_text(
        "trainer: {accelerator: cpu, devices: 1, max_steps: 1, logger: false}\n"
        "model: {class_path: torchrec_lookahead.models.DLRMModule, init_args: {embedding_dim: 8, "
        "dense_arch_layer_sizes: [8]}}\n"
        "data:\n  class_path: torchrec_lookahead.data.CriteoTSVDataModule\n"
        f"  init_args: {{train_files: {train}, batch_size: 4, num_embeddings: 10}}\n"
    )
    return str(path)


def _short_error(capsys: pytest.CaptureFixture, args: List[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Does not validate" not in err, err[-2000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) <= 3, err[-2000:]  # the error (and Lightning's seed line)
    return lines[-1]


@pytest.mark.parametrize(
    "override, expected",
    [
        (SHARDERS.replace("CAP", "0"), "ConfigError: capacity of table 't_cat_2' must be a positive number"),
        (SHARDERS.replace("CAP", "-5"), "ConfigError: capacity of table 't_cat_2' must be a positive number"),
        ("--data.init_args.prefetch_depth=9", "ConfigError: horizon must be >= prefetch_depth=9"),
        (
            "--data.init_args.policy=fifo",
            "ConfigError: policy must be one of 'belady', 'ttl', 'window', 'lru'",
        ),
    ],
)
def test_invalid_cli_values_end_in_their_own_short_error(capsys, override, expected):
    line = _short_error(capsys, ["fit", "--config", TINY, override])
    assert line.startswith(expected), line


def test_a_missing_or_empty_training_file_is_a_data_error(tmp_path, capsys):
    line = _short_error(capsys, ["fit", "--config", _tsv_config(tmp_path, tmp_path / "missing.tsv")])
    assert line.startswith("DataError: Data file not found") and "missing.tsv" in line, line
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    line = _short_error(capsys, ["fit", "--config", _tsv_config(tmp_path, empty)])
    assert line.startswith("DataError: the train split would have no batches") and "hold no data rows" in line


def test_verify_refuses_a_config_that_caches_nothing():
    from torchrec_lookahead.verify import verify

    with pytest.raises(ConfigError, match="caches no table"):
        verify("configs/dlrm_tiny.yaml", steps=1)


def test_the_short_error_is_what_a_user_sees():
    out = run_cli("fit", "--config", TINY, SHARDERS.replace("CAP", "0"))
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("ConfigError: capacity of table 't_cat_2'"), out.stderr[-2000:]
    assert len(lines) <= 3, out.stderr[-2000:]


@pytest.mark.distributed
@pytest.mark.slow
def test_under_torchrun_each_rank_prints_the_error_at_most_once_and_ranks_other_than_zero_prefixed():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "torchrec_lookahead", "fit", "--config", TINY, "--trainer.devices=2",
           "--data.init_args.policy=fifo"]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=clean_env())
    assert out.returncode != 0
    # every rank reports at once; torchrun may end one before it does, so each rank's line is there at most once
    lines = [line for line in out.stderr.splitlines() if "ConfigError: policy must be one of" in line]
    assert 1 <= len(lines) <= 2, out.stderr[-3000:]
    assert sorted(line.split("ConfigError: ")[0] for line in lines) in (
        ["", "[rank 1] "],
        [""],
        ["[rank 1] "],
    ), lines
    assert "Does not validate" not in out.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["fit"],
        ["verify"],
        ["calibrate"],
        ["export", "--ckpt", "missing.ckpt", "--out", "out.ckpt"],
    ],
)
def test_a_missing_config_file_is_one_short_config_error_for_every_command(capsys, tmp_path, command):
    missing = str(tmp_path / "nope.yaml")
    line = _short_error(capsys, [*command, "--config", missing])
    assert line == (
        f"ConfigError: Config file not found: {missing!r}; give the path to a YAML file or a bundled config's name"
    ), line
    line = _short_error(capsys, [*command, f"--config={tmp_path}"])
    assert line.startswith(f"ConfigError: Config file {str(tmp_path)!r} is a directory"), line


def test_inline_yaml_and_bundled_names_still_pass_as_configs():
    from torchrec_lookahead.bundled import resolve_config_args

    inline = "--config=trainer: {max_steps: 1}"
    assert resolve_config_args(["fit", inline, "--config", TINY]) == ["fit", inline, "--config", TINY]
    assert resolve_config_args(["fit", "--config", "dlrm_tiny"])[2].endswith("dlrm_tiny.yaml")


def test_calibrate_refuses_a_directory_to_save_to_before_calibrating(capsys, tmp_path, monkeypatch):
    import torchrec_lookahead.calibrate as calibrate_command

    def never(*args, **kwargs):
        raise AssertionError("calibrated before checking where to save")

    monkeypatch.setattr(calibrate_command, "calibrate", never)
    fae = "configs/dlrm_tiny_fae.yaml"
    line = _short_error(capsys, ["calibrate", "--config", fae, "--save", str(tmp_path)])
    assert line.startswith(f"ConfigError: --save {str(tmp_path)!r} is a directory; name the file to write"), (
        line
    )
    line = _short_error(capsys, ["calibrate", "--config", fae, "--json", str(tmp_path)])
    assert line.startswith(f"ConfigError: --json {str(tmp_path)!r} is a directory"), line
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = _short_error(capsys, ["calibrate", "--config", fae, "--save", str(blocker / "hot.pt")])
    assert line.endswith(f"{str(blocker)!r} is a file, not a directory"), line
    line = _short_error(capsys, ["calibrate", "--config", fae, f"--data.init_args.hot_set={tmp_path}"])
    assert line.startswith(f"ConfigError: hot_set {str(tmp_path)!r} is a directory"), line


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint directory of two steps of the tiny cached config."""
    from torchrec_lookahead.launch import build_cli

    root = tmp_path_factory.mktemp("ckpt")
    cli = build_cli(["--config", TINY, "--trainer.max_steps=2", "--trainer.logger=false",
                     "--trainer.enable_checkpointing=false", "--trainer.limit_val_batches=0",
                     f"--trainer.default_root_dir={root}"])  # fmt: skip
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    cli.trainer.save_checkpoint(root / "tiny.ckpt")
    cli.trainer.strategy.teardown()
    return root / "tiny.ckpt"


def _damaged_copy(tmp_path: Path, ckpt: Path, name: str, data: bytes) -> Path:
    import shutil

    copy = tmp_path / "damaged.ckpt"
    shutil.copytree(ckpt, copy)
    (copy / name).write_bytes(data)
    return copy


def test_export_of_a_checkpoint_with_a_damaged_meta_pt_is_a_checkpoint_error_naming_it(
    capsys, tmp_path, tiny_checkpoint
):
    damaged = _damaged_copy(tmp_path, tiny_checkpoint, "meta.pt", b"hello\n")
    line = _short_error(capsys, ["export", "--ckpt", str(damaged), "--out", str(tmp_path / "o.pt")])
    assert line.startswith(f"CheckpointError: checkpoint {damaged}: meta.pt could not be read"), line
    assert not (tmp_path / "o.pt").exists()


@pytest.mark.parametrize("command", ["export", "fit"])
def test_a_damaged_metadata_file_is_the_first_and_only_error_line(tmp_path, tiny_checkpoint, command):
    damaged = _damaged_copy(tmp_path, tiny_checkpoint, ".metadata", bytes(range(200)))
    args = (
        ["export", "--ckpt", str(damaged), "--out", str(tmp_path / "o.pt")]
        if command == "export"
        else [
            "fit",
            "--config",
            TINY,
            f"--ckpt_path={damaged}",
            "--trainer.logger=false",
            "--trainer.enable_checkpointing=false",
            "--trainer.enable_model_summary=false",
        ]  # fmt: skip
    )
    out = run_cli(*args)  # a subprocess: torch logs through handlers set up before any capture
    assert out.returncode == 1, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.strip() and not line.startswith("Seed set")]
    assert "WARNING" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
    error = [line for line in lines if line.startswith("CheckpointError: ")]
    assert error == [
        f"CheckpointError: checkpoint {damaged}: torch.distributed.checkpoint's .metadata could not be read "
        "(UnpicklingError: invalid load key, '\\x00'.); the file is damaged, use another checkpoint"
    ], out.stderr[-3000:]
    assert lines.index(error[0]) == (0 if command == "export" else len(lines) - 1), lines


@pytest.mark.parametrize("command", ["fit", "validate"])
def test_a_ckpt_path_file_that_is_not_a_checkpoint_is_a_checkpoint_error(capsys, tmp_path, command):
    garbage = tmp_path / "g.ckpt"
    garbage.write_bytes(bytes(range(256)) * 4)
    line = _short_error(capsys, [command, "--config", TINY, f"--ckpt_path={garbage}"])
    assert line == (
        f"CheckpointError: cannot read the checkpoint {garbage} (UnpicklingError: Weights only load failed): the "
        "file is damaged or not a checkpoint; pass one ModelCheckpoint wrote"
    ), line


@pytest.mark.parametrize("command", ["fit", "test"])
def test_a_ckpt_path_that_does_not_exist_is_one_checkpoint_error_under_any_strategy(
    capsys, tmp_path, command
):
    """README's export then `test --ckpt_path <export> --trainer.strategy=auto`: a wrong path was Lightning's
    FileNotFoundError traceback, after the model and data were built."""
    missing = tmp_path / "dlrm.ckpt"
    line = _short_error(
        capsys, [command, "--config", TINY, f"--ckpt_path={missing}", "--trainer.strategy=auto"]
    )
    assert line.startswith(f"CheckpointError: checkpoint {missing} does not exist; check ckpt_path"), line


def test_a_ckpt_path_under_home_is_read_as_lightning_reads_it(capsys, tmp_path, monkeypatch):
    """`--ckpt_path=~/...` (a YAML config, or quoted): Lightning reads it (fsspec expands the ~), but the CLI's
    check refused it as a checkpoint that 'does not exist'."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "g.ckpt").write_bytes(bytes(range(256)) * 4)
    line = _short_error(capsys, ["test", "--config", TINY, "--ckpt_path=~/g.ckpt", "--trainer.strategy=auto"])
    assert line.startswith(f"CheckpointError: cannot read the checkpoint {tmp_path / 'g.ckpt'} ("), line
