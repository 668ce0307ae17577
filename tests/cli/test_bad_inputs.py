"""Bad values of the settings a user writes, through the CLI: a string where a number belongs, a file where a
directory belongs and the reverse, no permission, a read-only filesystem, and two horizons. Each ends in one
short typed error naming the setting and the fix, before anything is trained or written."""

from __future__ import annotations

import errno
import os
import shlex
from pathlib import Path

import pytest
import torch
import yaml

from torchrec_lookahead._parse_errors import type_error, unknown_error
from torchrec_lookahead.cli import main

from .test_errors import SHARDERS, TINY, _short_error, _tsv_config

SHARDER = "torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder"
BUDGET = "configs/dlrm_lookahead_budget.yaml"


def _sharder_config(tmp_path: Path, **init_args: object) -> str:
    """A config file replacing the tiny config's sharder with one of ``init_args`` (a disk store of t_cat_2)."""
    sharder = {
        "class_path": SHARDER,
        "init_args": {"capacity": {"t_cat_2": 140}, "store": "disk", **init_args},
    }
    strategy = {
        "class_path": "torchrec_lookahead.strategies.TorchRecStrategy",
        "init_args": {"sharders": [sharder]},
    }
    path = tmp_path / "sharder.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"strategy": strategy, "logger": False, "max_steps": 1}}))
    return str(path)


def _fit(capsys: pytest.CaptureFixture, *args: str) -> str:
    return _short_error(capsys, ["fit", "--config", TINY, *args])


def test_a_string_for_the_host_budget_is_one_config_error_not_the_parser_usage(capsys, tmp_path):
    line = _fit(capsys, "--config", _sharder_config(tmp_path, host_budget_bytes="lots"))
    assert line == (
        f"ConfigError: host_budget_bytes of {SHARDER.rsplit('.', 1)[1]} must be an integer, a mapping or null but "
        "got 'lots'; set host_budget_bytes to an integer, a mapping or null"
    ), line


@pytest.mark.parametrize(
    "override, expected",
    [
        ("--data.init_args.horizon=lots", "horizon of LookaheadDataModule must be an integer but got 'lots'"),
        (
            "--data.init_args.datamodule.init_args.scale=big",
            "scale of CriteoSyntheticDataModule must be a number",
        ),
        (
            "--trainer.strategy.init_args.init_seed=x",
            "init_seed of TorchRecStrategy must be an integer or null but got 'x'",
        ),
        ("--trainer.max_steps=many", "trainer.max_steps must be an integer but got 'many'"),
    ],
)
def test_a_string_where_a_number_belongs_is_one_config_error_naming_the_setting(capsys, override, expected):
    line = _fit(capsys, override)
    assert line.startswith(f"ConfigError: {expected}"), line


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "--trainer.max_epochz=2",
            "'trainer.max_epochz' is not a setting of fit; did you mean 'trainer.max_epochs'?",
        ),
        ("--dta.x=1", "'dta.x' is not a setting of fit; did you mean 'data'?"),
        (
            "--model.init_args.embeding_dim=4",
            "'embeding_dim' is not a setting of DLRMModule; did you mean 'embedding_dim'?",
        ),
        (
            "--data.init_args.datamodule.init_args.num_train_batchs=3",
            "'num_train_batchs' is not a setting of CriteoSyntheticDataModule; did you mean 'num_train_batches'?",
        ),
        (
            "--trainer.strategy.init_args.sharders=[{class_path: "
            + SHARDER
            + ", init_args: {capacty: {t_cat_2: 9}}}]",
            f"'capacty' is not a setting of {SHARDER.rsplit('.', 1)[1]}; did you mean 'capacity'?",
        ),
        (
            "--data.init_args.nope=3",
            "'nope' is not a setting of LookaheadDataModule; its settings: datamodule, horizon,",
        ),
        (
            "--data.class_path=torchrec_lookahead.data.LookaheadDataModul",
            "class_path 'torchrec_lookahead.data.LookaheadDataModul' names no class: module 'torchrec_lookahead.data' "
            "has no 'LookaheadDataModul'; did you mean 'torchrec_lookahead.data.LookaheadDataModule'?",
        ),
        (
            "--data.class_path=nosuchpkg.Thing",
            "class_path 'nosuchpkg.Thing' names no class: there is no module",
        ),
    ],
)
def test_a_misspelt_setting_or_class_is_one_config_error_with_the_closest_name(capsys, override, expected):
    line = _fit(capsys, override)
    assert line.startswith(f"ConfigError: {expected}"), line


def test_a_null_for_a_nested_class_setting_is_a_null_not_the_string_none(tmp_path):
    from torchrec_lookahead.launch import build_cli

    fae = "configs/dlrm_tiny_fae_lookahead.yaml"
    for override in (["--data.init_args.datamodule.init_args.hot_set=null"],
                     ["--data.init_args.datamodule.init_args.hot_set", "null"]):  # fmt: skip
        cli = build_cli(["--config", fae, *override, f"--trainer.default_root_dir={tmp_path}"])
        assert cli.datamodule.datamodule.hot_set_path is None
    # the class's other settings stay as the config gave them
    assert cli.config["data"]["init_args"]["datamodule"]["init_args"]["hot_budget_bytes"] is not None


def test_a_null_for_a_sharders_setting_is_refused_with_the_way_to_give_it(capsys):
    line = _fit(capsys, "--trainer.strategy.init_args.sharders.init_args.store_dir=null")
    assert line.startswith(
        "ConfigError: trainer.strategy.init_args.sharders.init_args.store_dir=null cannot be given on the command "
        "line"
    ), line


def test_a_stateful_callback_given_twice_is_one_config_error(capsys):
    line = _short_error(
        capsys,
        [
            "fit",
            "--config",
            "configs/dlrm_tiny_fae.yaml",
            "--trainer.callbacks+=torchrec_lookahead.callbacks.HotColdScheduler",
        ],
    )
    assert line == (
        "ConfigError: trainer.callbacks has HotColdScheduler more than once; a checkpoint keeps one state per such "
        "callback: keep one of them"
    ), line


@pytest.mark.slow
def test_an_error_while_a_progress_bar_is_drawn_starts_a_line_of_its_own(tmp_path):
    import subprocess
    import sys

    from ..data.test_readers import GOOD
    from .test_cli import clean_env

    train = tmp_path / "train.tsv"
    train.write_text((GOOD + "\n") * 16)
    out = subprocess.run(  # one stream, as a terminal shows the bar (stdout) and the error (stderr)
        [sys.executable, "-m", "torchrec_lookahead", "fit", "--config", _tsv_config(tmp_path, train)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300, env=clean_env(), cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout[-3000:]
    assert "Sanity Checking" in out.stdout  # the bar was drawn when validation found no data
    assert any(
        line.startswith("ConfigError: This DataModule has no 'val' data") for line in out.stdout.splitlines()
    )


def test_an_accelerator_this_machine_lacks_is_one_config_error(capsys):
    line = _fit(capsys, "--trainer.accelerator=gpu")
    assert line == "ConfigError: No supported gpu backend found!", line


@pytest.mark.parametrize("precision", ["64-true", "bf16-true"])
def test_a_true_precision_with_cached_tables_is_refused_before_planning(capsys, tmp_path, precision):
    line = _fit(capsys, f"--trainer.precision={precision}", f"--trainer.default_root_dir={tmp_path}")
    assert line.startswith(f"ConfigError: precision={precision} converts every batch in place"), line


def test_a_config_that_is_not_yaml_is_one_config_error(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [\n")
    line = _fit(capsys, "--config", str(bad))
    assert line.startswith("ConfigError: a config is not valid YAML: ") and "line 2, column 1" in line, line


def test_the_parser_report_of_another_kind_is_left_to_the_parser(capsys):
    assert type_error('Parser key "trainer":\n  Key "nope" is not expected\n') is None
    assert type_error("Unrecognized arguments: --nope") is None
    assert unknown_error('Parser key "trainer":\n  Key "nope" is not expected\n') is None
    with pytest.raises(SystemExit) as exit_:  # a missing argument: jsonargparse's own report and status
        main(["fit", "--trainer.max_steps=1"])
    assert exit_.value.code == 2
    assert "the following arguments are required" in capsys.readouterr().err


def test_a_store_dir_that_is_a_file_is_refused_before_anything_is_planned(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = _fit(
        capsys, "--config", _sharder_config(tmp_path, host_budget_bytes=100_000, store_dir=str(blocker))
    )
    assert line == (
        f"ConfigError: store_dir '{blocker}' is a file, not a directory; name a directory (it is made if missing)"
    ), line
    under = blocker / "stores"
    line = _fit(
        capsys, "--config", _sharder_config(tmp_path, host_budget_bytes=100_000, store_dir=str(under))
    )
    assert line.startswith(f"ConfigError: store_dir '{under}' cannot be made: '{blocker}' is a file"), line


def test_a_store_dir_on_a_read_only_filesystem_is_refused(capsys, tmp_path, monkeypatch):
    statvfs = os.statvfs
    read_only = tmp_path / "ro"
    read_only.mkdir()

    class _ReadOnly:
        f_flag = os.ST_RDONLY

    # as root, chmod does not stop a write: the filesystem's read-only flag is what the check reads
    monkeypatch.setattr(
        os, "statvfs", lambda p: _ReadOnly() if str(p).startswith(str(read_only)) else statvfs(p)
    )
    config = _sharder_config(tmp_path, host_budget_bytes=100_000, store_dir=str(read_only / "stores"))
    line = _fit(capsys, "--config", config)
    assert line.startswith(
        f"ConfigError: store_dir '{read_only / 'stores'}' is on a read-only filesystem ('{read_only}')"
    ), line


def test_a_store_dir_without_permission_is_refused(capsys, tmp_path, monkeypatch):
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else access(p, mode))
    line = _fit(
        capsys, "--config", _sharder_config(tmp_path, host_budget_bytes=100_000, store_dir=str(tmp_path))
    )
    assert line.startswith(f"ConfigError: store_dir '{tmp_path}': no permission to create files"), line


def test_a_store_directory_that_cannot_be_made_when_the_stores_are_is_a_store_error(tmp_path, monkeypatch):
    import tempfile

    from torchrec_lookahead.distributed._store_dirs import StoreDirs
    from torchrec_lookahead.errors import StoreError

    def refuse(*args: object, **kwargs: object) -> str:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with pytest.raises(
        StoreError, match=r"cannot make the stores' directory in '.*': Read-only file system"
    ) as e:
        StoreDirs().new(str(tmp_path), "", keep=False)
    assert e.value.path == str(tmp_path)


def test_a_data_file_that_is_a_directory_or_unreadable_is_a_data_error(capsys, tmp_path, monkeypatch):
    line = _short_error(capsys, ["fit", "--config", _tsv_config(tmp_path, tmp_path)])
    assert line == f"DataError: Data file '{tmp_path}' is a directory; name the data files in it", line
    train = tmp_path / "train.tsv"
    train.write_text("0\t" + "\t" * 38 + "\n")
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(train) else access(p, mode))
    line = _short_error(capsys, ["fit", "--config", _tsv_config(tmp_path, train)])
    assert line.startswith(f"DataError: Data file '{train}' cannot be read: no permission"), line


def test_a_config_cannot_plan_the_caches_for_one_horizon_and_train_with_another(capsys, monkeypatch):
    import torchrec_lookahead.strategies._sizing as sizing

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("sampled batches before checking the horizons")

    monkeypatch.setattr(sizing, "_sample_batches", never)
    sharders = f'[{{"class_path": "{SHARDER}", "init_args": {{"device_budget_bytes": 2000000, '
    line = _short_error(
        capsys,
        [
            "fit",
            "--config",
            BUDGET,
            f'--trainer.strategy.init_args.sharders={sharders}"planner_options": {{"horizon": 32}}}}}}]',
        ],
    )
    assert line.startswith(
        f"ConfigError: planner_options horizon=32 of {SHARDER.rsplit('.', 1)[1]} differs from horizon=64 of "
        "LookaheadDataModule"
    ), line


def test_a_default_root_dir_that_is_a_file_is_refused_before_anything_is_built(capsys, tmp_path, monkeypatch):
    from torchrec_lookahead.launch import LookaheadCLI

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("built the Trainer, model and data before checking default_root_dir")

    monkeypatch.setattr(LookaheadCLI, "instantiate_classes", never)
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = _fit(capsys, f"--trainer.default_root_dir={blocker}")
    assert line == (
        f"ConfigError: trainer.default_root_dir '{blocker}' is a file, not a directory; name a directory (it is "
        "made if missing)"
    ), line
    line = _fit(capsys, f"--trainer.default_root_dir={blocker / 'logs'}")
    assert line.startswith(
        f"ConfigError: trainer.default_root_dir '{blocker / 'logs'}' cannot be made: '{blocker}' is a file"
    ), line


@pytest.mark.parametrize(
    "subcommand, limit",
    [
        ("validate", "--trainer.limit_val_batches=0"),
        ("test", "--trainer.limit_test_batches=0.0"),
        ("predict", "--trainer.limit_predict_batches=0"),
    ],
)
def test_a_split_turned_off_is_refused_before_the_cache_is_planned(capsys, monkeypatch, subcommand, limit):
    """A training config often turns validation off: `validate` on it planned the cache and exited 0 having run
    nothing."""
    from torchrec_lookahead.launch import LookaheadCLI

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"built the Trainer, model and data for a `{subcommand}` with nothing to run")

    monkeypatch.setattr(LookaheadCLI, "instantiate_classes", never)
    split = limit.split("limit_")[1].split("_batches")[0]
    line = _short_error(capsys, [subcommand, "--config", TINY, limit])
    assert line.startswith(
        f"ConfigError: `{subcommand}` has nothing to run: trainer.limit_{split}_batches is 0"
    ), line
    assert line.endswith(f"pass --trainer.limit_{split}_batches 1.0 to run it"), line


def test_a_planner_chosen_kernel_beside_cached_tables_is_one_config_error(capsys):
    """compute_kernel: null with some tables cached ended in TorchRec's planner traceback (its estimators cannot
    price the lookahead sharder's kernel)."""
    line = _fit(capsys, "--trainer.strategy.init_args.compute_kernel=null")
    assert line.startswith(
        "ConfigError: compute_kernel: null (TorchRec's planner choosing the kernels) cannot plan the resident tables"
    ), line


@pytest.mark.parametrize(
    "override",
    [
        # refused by the strategy's set-up (config.yaml and an empty event file), by the capacity pre-scan
        # (hparams.yaml and the cache plan's report too)
        "--trainer.precision=64-true",
        SHARDERS.replace("CAP", "5"),
    ],
)
def test_a_fit_refused_at_start_up_leaves_no_log_version_of_its_own(capsys, tmp_path, override):
    """The refused run left an empty `lightning_logs/version_N` beside the runs that trained."""
    logs = tmp_path / "lightning_logs"
    (logs / "version_0").mkdir(parents=True)  # an earlier run's, empty too: not this run's to remove
    line = _fit(capsys, override, f"--trainer.default_root_dir={tmp_path}")
    assert line.startswith(("ConfigError: precision=64-true", "CapacityError: table 't_cat_2'")), line
    assert sorted(p.name for p in logs.iterdir()) == ["version_0"]


def test_fit_from_an_export_is_one_checkpoint_error_saying_what_an_export_holds(capsys, tmp_path):
    """Lightning's KeyError blamed save_weights_only; an export keeps the loops' progress but no optimizer."""
    import torch

    export = tmp_path / "served.ckpt"
    torch.save({"epoch": 0, "global_step": 5, "loops": {}, "callbacks": {}, "state_dict": {}}, export)
    line = _fit(capsys, "--trainer.strategy=auto", "--ckpt_path", str(export))
    assert line.startswith(f"CheckpointError: --ckpt_path {export} is an export"), line
    assert (
        "weights only" in line
        and "resume from the training checkpoint" in line
        and "save_weights_only" not in line
    )


def test_a_val_check_interval_above_the_epoch_is_one_config_error_and_leaves_no_log_version(capsys, tmp_path):
    """Lightning's ValueError traceback, once the loaders were built, left the refused run's version_N behind."""
    err = _short_error_any(
        capsys,
        [
            "fit",
            "--config",
            TINY,
            "--trainer.val_check_interval=50",
            f"--trainer.default_root_dir={tmp_path}",
        ],
    )
    assert err == (
        "ConfigError: trainer.val_check_interval must be at most the 12 training batches of an epoch but got 50: "
        "pass --trainer.val_check_interval 12 (or less), --trainer.check_val_every_n_epoch null to count batches "
        "across epochs, or --trainer.limit_val_batches 0 to turn validation off"
    ), err
    assert not (tmp_path / "lightning_logs").exists() or not any((tmp_path / "lightning_logs").iterdir())


def _short_error_any(capsys: pytest.CaptureFixture, args: list) -> str:
    """The last line of a CLI error, after whatever the run printed before it."""
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-2000:]
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "subcommand, config, split",
    [
        ("validate", "movielens", "val"),
        ("validate", "taobao", "val"),
        ("validate", "avazu", "val"),
        ("test", "movielens", "test"),
        ("predict", "movielens", "test"),
    ],
)
def test_a_split_without_files_is_one_error_up_front_not_after_the_checkpoint_is_restored(
    capsys, tmp_path, subcommand, config, split
):
    """The limit_val_batches hint was followed by a second error, "no 'val' data", once the checkpoint was read."""
    ckpt = tmp_path / "c.ckpt"
    torch.save(
        {"state_dict": {}}, ckpt
    )  # a checkpoint file (a missing or damaged one is refused before the config)
    line = _short_error(
        capsys, [subcommand, "--config", f"configs/{config}_lookahead.yaml", "--ckpt_path", str(ckpt)]
    )
    assert line.startswith(f"ConfigError: `{subcommand}` has nothing to run: the config's "), line
    assert (
        f"has no {split}_files; pass --data.init_args.datamodule.init_args.{split}_files <file(s)>" in line
    ), line
    assert ("limit_val_batches 1.0" in line) == (split == "val"), line


@pytest.mark.parametrize("dirpath", [False, True])
def test_ckpt_path_last_with_checkpoints_lightning_will_not_find_is_refused_naming_the_newest(
    capsys, tmp_path, dirpath
):
    """Without a dirpath each run logs to a new version_N and never finds the last checkpoint of the one before;
    with one, a run killed while writing its first last.ckpt leaves only the epoch's checkpoint. Both trained from
    step 0 with a warning; a first run (no checkpoint anywhere) still starts fresh."""
    ckpts = tmp_path / "ckpts" if dirpath else tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    (ckpts / "epoch=0-step=5.ckpt").mkdir(parents=True)
    args = [
        "fit", "--config", TINY, "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.save_last=true",
        "--ckpt_path=last", "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}",
    ]  # fmt: skip
    if dirpath:
        args.append(f"--trainer.callbacks.dirpath={ckpts}")
    line = _short_error(capsys, args)
    assert line.startswith("CheckpointError: --ckpt_path=last finds no last checkpoint"), line
    assert f"resume from it with --ckpt_path {shlex.quote(str(ckpts / 'epoch=0-step=5.ckpt'))}" in line, line
    assert ("give ModelCheckpoint a dirpath" in line) != dirpath, line
    assert sorted(p.name for p in (tmp_path / "lightning_logs").glob("*")) == (
        [] if dirpath else ["version_0"]
    )
