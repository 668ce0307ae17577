"""benchmarks/cdlrm_gap.py without training: its torchrun command lines are valid CLI arguments that differ
only in the synchronisation, and its log reader and loss gap."""

import pytest

from benchmarks import cdlrm_gap
from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
from torchrec_lookahead.launch import build_cli


def _cli_args(cmd):
    return cmd[cmd.index("fit") + 1 :]


def test_dry_run_commands_build_the_two_rank_window_job_differing_only_in_the_sharder():
    exact, cdlrm = cdlrm_gap.main(["--quick", "--dry-run"])["commands"]
    differ = [(a, b) for a, b in zip(_cli_args(exact), _cli_args(cdlrm)) if a != b]
    # the sharder (cdlrm_average_every added) and the log directories, nothing else
    assert len(exact) == len(cdlrm) and any("cdlrm_average_every: 4" in b for _, b in differ)
    assert all("sharders=" in b or "exact_l4" in a for a, b in differ), differ
    cli = build_cli(_cli_args(cdlrm))
    assert cli.trainer.num_devices == 2
    assert cli.datamodule.policy == "window" and cli.datamodule.settings.window == 4
    assert cli.datamodule.datamodule.config.batch_size == 1024  # global batch 2,048 as in the config
    (sharder,) = [
        s for s in cli.trainer.strategy._sharders if isinstance(s, LookaheadEmbeddingBagCollectionSharder)
    ]
    assert sharder.cdlrm_average_every == 4
    assert {type(c).__name__ for c in cli.trainer.callbacks} >= {"CacheMonitor", "StepTimeLog"}


def test_lambdas_must_be_positive():
    with pytest.raises(SystemExit):
        cdlrm_gap.main(["--dry-run", "--lambdas", "0"])


def test_metrics_reader_and_loss_gap(tmp_path):
    log = tmp_path / "csv" / "version_0"
    log.mkdir(parents=True)
    (log / "metrics.csv").write_text(
        "cache/sync/rows_averaged,epoch,step,time/step_ms,train/loss,val/auc,val/logloss\n"
        "10,0,0,,0.70,,\n"
        ",0,1,50.0,0.60,,\n"
        "0,0,1,,,,\n"
        ",0,1,,,0.75,0.45\n"
    )
    m = cdlrm_gap.read_metrics(tmp_path)
    assert m["loss"] == {0: 0.70, 1: 0.60} and m["step_ms"] == [50.0]
    assert m["val"] == [{"step": 1, "auc": 0.75, "logloss": 0.45}]
    assert cdlrm_gap.sync_rows("cdlrm", m["sync"], len(m["loss"])) == 5.0
    gap = cdlrm_gap.loss_gap({0: 0.7, 1: 0.6, 2: 0.5, 3: 0.4}, {0: 0.7, 1: 0.8, 2: 0.5, 3: 0.3})
    assert gap["max"] == pytest.approx(0.2) and gap["mean"] == pytest.approx(0.075)
    assert gap["last_quarter_mean_signed"] == pytest.approx(-0.1)
