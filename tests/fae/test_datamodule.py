"""HotColdDataModule: calibrate or load the hot set, refuse bad ones, train end to end with the scheduler
(resident tables), resume mid-epoch exactly; the ``calibrate`` command."""

from __future__ import annotations

import datetime
import json
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import pytest
import torch
import yaml

from torchrec_lookahead.callbacks import HotColdScheduler, RateRule
from torchrec_lookahead.cli import main as cli_main
from torchrec_lookahead.data import CriteoSyntheticDataModule
from torchrec_lookahead.errors import CheckpointError, ConfigError
from torchrec_lookahead.fae import BatchKind, HotColdDataModule, HotSet
from torchrec_lookahead.fae.hotset import fingerprint

from ..conftest import REPO, tiny_data_args
from ..helpers import _trainer, check_mid_epoch_resume, make_model

FAE = dict(hot_budget_bytes=40_000, sample_fraction=0.5, small_table_bytes=1024, num_chunks=4, chunk_rows=16)


def _dm(**kw: Any) -> HotColdDataModule:
    return HotColdDataModule(
        CriteoSyntheticDataModule(**tiny_data_args()), **{**FAE, "embedding_dim": 8, **kw}
    )


def test_calibrates_saves_and_loads(tmp_path: Path) -> None:
    path = str(tmp_path / "hot.pt")
    dm = _dm(hot_set=path)
    dm.setup("fit")
    assert dm.hot_set is not None and Path(path).is_file()
    loaded = _dm(hot_set=path)
    loaded.setup("fit")
    assert loaded.hot_set is not None and loaded.hot_set.summary() == dm.hot_set.summary()
    per = loaded.train_dataloader().batches_per_epoch()
    assert per[BatchKind.HOT] > 0 and per[BatchKind.COLD] > 0
    with pytest.raises(ConfigError, match="hot_budget_bytes=40000"):
        _dm(hot_set=path, hot_budget_bytes=50_000).setup("fit")
    other = HotColdDataModule(
        CriteoSyntheticDataModule(**tiny_data_args(num_embeddings=[7] * 26)),
        hot_set=path,
        embedding_dim=8,
        **FAE,
    )
    with pytest.raises(ConfigError, match="rows"):
        other.setup("fit")


def test_a_resume_with_another_fixed_hot_set_is_refused_before_it_trains_other_samples() -> None:
    trained = _dm()
    trained.setup("fit")
    state = trained.state_dict()
    assert isinstance(state["hot_set_fingerprint"], str)
    same = _dm()
    same.load_state_dict(state)  # checked once the hot set is known
    same.setup("fit")
    assert same.hot_set is not None and trained.hot_set is not None
    assert fingerprint(same.hot_set) == fingerprint(trained.hot_set)
    other = _dm(hot_budget_bytes=30_000)
    other.setup(
        "fit"
    )  # the hot set already in force (as when the caches were sized with it): checked at load
    with pytest.raises(CheckpointError, match="trained with another hot set than this run's"):
        other.load_state_dict(state)
    later = _dm(hot_budget_bytes=30_000)
    later.load_state_dict(state)
    with pytest.raises(CheckpointError, match="another hot set"):
        later.setup("fit")


def test_bad_arguments_fail_before_training(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="hot_budget_bytes"):
        _dm(hot_budget_bytes=0)
    with pytest.raises(ConfigError, match="sample_fraction"):
        _dm(sample_fraction=1.5)
    with pytest.raises(ConfigError, match="window"):
        _dm(window=1)
    with pytest.raises(ConfigError, match="small tables"):
        _dm(hot_budget_bytes=100).setup("fit")
    with pytest.raises(ConfigError, match="embedding width"):
        HotColdDataModule(CriteoSyntheticDataModule(**tiny_data_args()), **FAE).setup("fit")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable hot set"):
        _dm(hot_set=str(bad)).setup("fit")
    # empty, a pickle of another kind, a hot set with a field missing: one short line each, saying what to do
    good = tmp_path / "good.pt"
    dm = _dm(hot_set=str(good))
    dm.setup("fit")
    raw = torch.load(good, weights_only=True)
    del raw["threshold"]
    torch.save(raw, tmp_path / "no_threshold.pt")
    (tmp_path / "empty.pt").write_bytes(b"")
    torch.save({"a": datetime.date(2020, 1, 1)}, tmp_path / "other.pt")  # not loadable with weights_only
    for name, match in [("empty.pt", "not a readable hot set file"), ("other.pt", "not a readable hot set file"),
                        ("no_threshold.pt", r"is a damaged hot set \(KeyError: 'threshold'\)")]:  # fmt: skip
        with pytest.raises(CheckpointError, match=match) as e:
            HotSet.load(str(tmp_path / name))
        assert "\n" not in str(e.value) and "weights_only" not in str(e.value) and "calibrate" in str(e.value)


def _fit(
    tmp_path: Path,
    max_steps: int,
    ckpt_path: Optional[str] = None,
    callbacks: Optional[List[Any]] = None,
    **kw: Any,
) -> Any:
    pl.seed_everything(0, verbose=False)
    inner = CriteoSyntheticDataModule(**tiny_data_args())
    dm = HotColdDataModule(inner, **FAE)
    model = make_model(inner)
    sched = HotColdScheduler(initial_rate=50.0, patience=1)
    trainer = _trainer(
        tmp_path,
        max_steps,
        [sched, *(callbacks or [])],
        strategy="torchrec",
        limit_val_batches=2,
        val_check_interval=3,
        **kw,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return trainer, model, sched, dm


class _ValLosses(pl.Callback):
    def __init__(self) -> None:
        self.losses: List[float] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.losses.append(float(trainer.callback_metrics["val/logloss"]))


def test_trains_end_to_end_with_the_scheduler(tmp_path: Path) -> None:
    seen = _ValLosses()
    trainer, model, sched, dm = _fit(tmp_path, max_steps=-1, max_epochs=1, callbacks=[seen])
    # The scheduler saw every validation of the run: replaying its rule on the losses gives its rate.
    per = dm.loader.batches_per_epoch()
    rule = RateRule(50.0, patience=1)
    for loss in seen.losses:
        rule.observe(loss, min_rate=100.0 / max(per.values()))
    assert len(seen.losses) >= 3 and sched.rate == rule.rate and sched.rule.last_loss == seen.losses[-1]
    per = dm.loader.batches_per_epoch()
    assert sched.trained == per and trainer.global_step == sum(per.values())
    assert sched.swaps >= 1 and "fae/rate" in trainer.callback_metrics
    assert float(trainer.callback_metrics["fae/hot_share"]) == pytest.approx(
        per[BatchKind.HOT] / sum(per.values())
    )


def test_mid_epoch_resume_equals_uninterrupted(tmp_path: Path) -> None:
    check_mid_epoch_resume(_fit, tmp_path)


def _tiny_config(tmp_path: Path, **data: Any) -> str:
    cfg: Dict[str, Any] = yaml.safe_load((REPO / "configs" / "dlrm_tiny.yaml").read_text())
    inner = cfg["data"]
    cfg["data"] = {
        "class_path": "torchrec_lookahead.fae.HotColdDataModule",
        "init_args": {"datamodule": inner, **FAE, **data},
    }
    path = tmp_path / "fae.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_calibrate_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = _tiny_config(tmp_path)
    save, out = tmp_path / "hs.pt", tmp_path / "cal.json"
    with pytest.raises(SystemExit) as e:
        cli_main(["calibrate", "--config", cfg, "--save", str(save), "--json", str(out)])
    assert e.value.code == 0
    assert "--- FAE hot set ---" in capsys.readouterr().out
    figures = json.loads(out.read_text())
    for key in ("threshold", "hot_budget_bytes", "hot_bytes", "hot_rows", "estimated_hot_rows",
                "hot_access_share", "hot_sample_share", "seconds"):  # fmt: skip
        assert key in figures
    raw = torch.load(save, weights_only=True)
    assert set(raw["hot_ids"]) == set(figures["hot_rows"])
    assert all(raw["hot_ids"][t].numel() == n for t, n in figures["hot_rows"].items())
    assert figures["hot_bytes"] == HotSet.load(str(save)).hot_bytes <= figures["hot_budget_bytes"]


def test_calibrate_writes_files_of_the_umasks_mode_and_refuses_outputs_it_would_lose_or_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    cfg = _tiny_config(tmp_path)
    save, out = tmp_path / "hs.pt", tmp_path / "cal.json"
    with pytest.raises(SystemExit) as e:
        cli_main(["calibrate", "--config", cfg, "--save", str(save), "--json", str(out)])
    assert e.value.code == 0
    mask = os.umask(0)
    os.umask(mask)
    assert (save.stat().st_mode & 0o777) == (out.stat().st_mode & 0o777) == 0o666 & ~mask
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [\n")
    cases = [
        (["--config", cfg, "--save", cfg], "--save '.*' is the file --config names"),
        (["--config", cfg, "--save", str(save), "--json", str(save)], "--json '.*' is the file --save names"),
        (["--config", cfg, "--save", str(tmp_path / "dangling" / "h.pt")], "is a broken symbolic link"),
        (["--config", str(bad)], r"bad.yaml is not valid YAML \(line 2, column 1\)"),
    ]
    capsys.readouterr()
    for args, match in cases:
        with pytest.raises(SystemExit) as e:
            cli_main(["calibrate", *args])
        assert e.value.code == 1
        err = capsys.readouterr().err.strip()
        assert "Traceback" not in err and re.search(f"ConfigError: .*{match}", err.splitlines()[-1]), err
    assert yaml.safe_load(Path(cfg).read_text())["data"]  # the config is untouched
    with pytest.raises(ConfigError, match="cannot write the hot set to '/proc/nope/h.pt'"):
        HotSet.load(str(save)).save("/proc/nope/h.pt")  # past the up-front checks: one typed error still


def test_calibrate_command_needs_a_budget(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "plain.yaml"
    path.write_text((REPO / "configs" / "dlrm_tiny.yaml").read_text())
    with pytest.raises(SystemExit) as exit_info:  # the CLI reports a LookaheadError as one line
        cli_main(["calibrate", "--config", str(path), "--json", str(tmp_path / "x.json")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ConfigError: ") and "hot_budget_bytes" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x.json").exists()


def test_the_boxs_growth_is_set_on_the_datamodule_and_checked_there() -> None:
    inner = CriteoSyntheticDataModule(batch_size=64, num_train_batches=4, scale=0.0005)
    dm = HotColdDataModule(inner, hot_budget_bytes=1 << 20, box_tolerance=None, box_max_share=0.5)
    assert dm.calibration["box_tolerance"] is None and dm.calibration["box_max_share"] == 0.5
    with pytest.raises(ConfigError, match="box_tolerance"):
        HotColdDataModule(inner, hot_budget_bytes=1 << 20, box_tolerance=-0.1)
