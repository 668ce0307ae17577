"""Ranks given different settings (an override that depends on the rank's environment) are refused before anything
is built, with one ConfigError line per rank naming the setting; ranks that agree train as before."""

import subprocess
import sys
from pathlib import Path

import pytest

from torchrec_lookahead.strategies._rank_settings import flat_settings, settings_disagreement

from ..cli.test_cli import clean_env
from ..conftest import REPO, free_port


def test_flat_settings_names_every_setting_by_its_dotted_key_without_the_config_files_log_dir_or_locations():
    from jsonargparse.typing import Path_fr

    settings = flat_settings(
        {
            "config": [Path_fr(str(REPO / "configs" / "dlrm_tiny_lookahead.yaml"))],
            "seed_everything": 0,
            "data": {
                "init_args": {
                    "horizon": 8,
                    "datamodule": {
                        "init_args": {"seed": 0, "train_files": ["/host1/a.tsv"], "movies_file": "m"}
                    },
                }
            },
            "model": {"init_args": {"store_dir": "/local/ssd", "emb_path": "x"}},
            "trainer": {"callbacks": [{"class_path": "CacheMonitor"}], "default_root_dir": "/local/logs"},
        }
    )
    assert settings == {
        "seed_everything": "0",
        "data.init_args.horizon": "8",
        "data.init_args.datamodule.init_args.seed": "0",
        "model.init_args.emb_path": "'x'",
        "trainer.callbacks": "[{'class_path': 'CacheMonitor'}]",
    }  # files and directories may be each host's own (data copies, local disks): not compared


def test_the_disagreement_names_the_settings_their_values_and_the_ranks():
    same = {"a": "1", "b": "2"}
    assert settings_disagreement([same, dict(same), dict(same)]) is None
    message = settings_disagreement([same, same, {"a": "1", "b": "3", "c": "4"}])
    assert message is not None
    assert "b is 2 on rank 0 but 3 on rank 2" in message
    assert "c is unset on rank 0 but 4 on rank 2" in message
    many = settings_disagreement([{k: "0" for k in "abcde"}, {k: "1" for k in "abcde"}])
    assert many is not None and "(and 2 more)" in many


_BY_RANK = """
import os
import sys

sys.path.insert(0, {repo!r})
from torchrec_lookahead.cli import main

args = sys.argv[1:]
if os.environ.get("RANK") == "1":
    args.append({override!r})
main(args)
"""


@pytest.mark.distributed
@pytest.mark.parametrize(
    "command, override, setting",
    [
        (
            "fit",
            "--model.init_args.embedding_optimizer.lr=0.1",
            "model.init_args.embedding_optimizer.lr is 0.05",
        ),
        (
            "fit",
            "--data.init_args.datamodule.init_args.seed=1",
            "data.init_args.datamodule.init_args.seed is 0",
        ),
        ("verify", "--data.init_args.horizon=4", "data.init_args.horizon is 8 on rank 0"),  # its own Trainers
    ],
)
def test_ranks_given_different_settings_are_refused_before_training(
    tmp_path: Path, command: str, override: str, setting: str
):
    script = tmp_path / "by_rank.py"
    script.write_text(_BY_RANK.format(repo=str(REPO), override=override))
    steps = "--steps=2" if command == "verify" else "--trainer.max_steps=2"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
        str(script), command, "--config", "configs/dlrm_tiny_lookahead.yaml", "--trainer.devices=2", steps,
        f"--trainer.default_root_dir={tmp_path / 'logs'}",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=clean_env())
    assert done.returncode != 0, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "ConfigError:" in line]
    assert errors and all(setting in line for line in errors), done.stderr[-3000:]
    assert all(
        line.startswith(("ConfigError: the ranks", "[rank 1] ConfigError: the ranks")) for line in errors
    )
    assert "Epoch 0" not in done.stderr + done.stdout  # refused before the first step
    before = done.stderr[: done.stderr.index(errors[-1])]
    assert "Traceback" not in before  # one line per rank, then torchrun's report
