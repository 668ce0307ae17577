"""The cache's set-up report: printed on rank 0 with a progress bar, and sent to TensorBoard as text."""

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException

from torchrec_lookahead.runtime.report import report_text, scan_progress


def trainer(tmp_path, progress_bar: bool = True, loggers=None) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=loggers if loggers is not None else False,
        enable_progress_bar=progress_bar,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )


def test_scan_progress_draws_a_bar_only_where_the_trainer_shows_progress(capsys, tmp_path):
    with scan_progress(trainer(tmp_path), "Scanning", total=3) as tick:
        for _ in range(3):
            tick()
    err = capsys.readouterr().err
    assert "Scanning: 100%" in err and "3/3" in err and " s]" in err  # the bar ends with the scan's time
    other_rank = SimpleNamespace(is_global_zero=False, world_size=2, received_sigterm=False)
    for quiet in (trainer(tmp_path, progress_bar=False), other_rank, None):
        with scan_progress(quiet, "Scanning", total=3) as tick:
            tick()
        assert "Scanning" not in capsys.readouterr().err


def test_report_text_goes_to_every_tensorboard_logger_and_skips_others(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = [TensorBoardLogger(tmp_path / "a", name=""), TensorBoardLogger(tmp_path / "b", name="")]
    t = trainer(tmp_path, loggers=[*tb, CSVLogger(tmp_path / "csv")])
    report_text(t, "lookahead/cache", "Lookahead cache:\n  t 10 rows")
    for logger in tb:
        logger.experiment.flush()
        events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0})
        events.Reload()
        (event,) = events.Tensors("lookahead/cache/text_summary")
        # a preformatted Markdown block: TensorBoard keeps the lines and columns
        assert event.tensor_proto.string_val[0].decode() == "    Lookahead cache:\n      t 10 rows"


def test_a_pre_scan_of_one_process_ends_when_it_receives_sigterm(tmp_path):
    for shows_bar in (False, True):
        t = trainer(tmp_path, progress_bar=shows_bar)
        with pytest.raises(SIGTERMException):
            with scan_progress(t, "scan", total=1000) as tick:
                for i in range(1000):
                    if i == 3:
                        t._signal_connector.received_sigterm = True  # what Lightning's handler sets
                    tick()
    several = SimpleNamespace(
        world_size=2, received_sigterm=True, is_global_zero=True, progress_bar_callback=None
    )
    with scan_progress(several, "scan", total=2) as tick:  # several ranks: the scan's collectives go on
        tick()
        tick()
