import re
from typing import Any, Dict, List

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger

from torchrec_lookahead import ConfigError
from torchrec_lookahead.callbacks import CacheMonitor
from torchrec_lookahead.runtime import CacheStats

from ..helpers import fit_cached

TABLES = ("t_cat_2", "t_cat_11", "t_cat_15")


class _Snapshots(pl.Callback):
    """Each cache's own stats() and the session's stats() after each training step (runs after the monitor:
    callbacks are called in list order)."""

    def __init__(self) -> None:
        self.stats: List[Dict[str, Dict[str, int]]] = []
        self.session: List[CacheStats] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        out: Dict[str, Dict[str, int]] = {}
        for m in trainer.strategy.cached_modules():
            out.update(m.cache.stats())
        self.stats.append(out)
        self.session.append(trainer.strategy.cache_session().stats())


def test_cache_monitor_logs_the_counters_deltas_through_lightning(tmp_path):
    monitor, snaps = CacheMonitor(log_every_n_steps=2), _Snapshots()
    csv = CSVLogger(tmp_path, name="csv")
    trainer, _ = fit_cached(tmp_path, 6, callbacks=[monitor, snaps], logger=csv, log_every_n_steps=2)
    m = monitor.last_metrics
    # the last log covers steps 5 and 6: per-step averages of the counters' deltas
    before, after = snaps.stats[3], snaps.stats[5]
    hits = lookups = 0
    for table in TABLES:
        d = {k: after[table][k] - before[table][k] for k in after[table]}
        hits, lookups = hits + d["hits"], lookups + d["lookups"]
        assert m[f"cache/{table}/rows_fetched"] == d["rows_fetched"] / 2
        assert m[f"cache/{table}/rows_written_back"] == d["rows_written_back"] / 2
        assert m[f"cache/{table}/bytes_moved"] == d["bytes_moved"] / 2
        assert m[f"cache/{table}/hit_rate"] == (d["hits"] / d["lookups"] if d["lookups"] else 0.0)
        assert 0.0 < m[f"cache/{table}/occupancy"] <= 1.0
    assert m["cache/hit_rate"] == hits / lookups and lookups > 0
    assert m["cache/samples_per_s"] > 0 and m["cache/device_bytes"] < m["cache/host_bytes"]
    # the session's snapshots hold the same per-table counters, and the loader threads' and training thread's
    d_session = snaps.session[5] - snaps.session[3]
    assert d_session.tables == {t: {k: after[t][k] - before[t][k] for k in after[t]} for t in after}
    assert d_session.hit_rate == m["cache/hit_rate"] and d_session.sync == {}  # one rank: no LRPP
    d_loader = d_session.threads
    assert m["cache/gathered_by_training_thread"] == d_loader.gathered_here / 2 <= 1
    assert m["cache/stager_wait_ms"] == pytest.approx(d_loader.stager_wait_s * 1e3 / 2)
    assert m["cache/batch_wait_ms"] == pytest.approx(d_loader.batch_wait_s * 1e3 / 2)
    assert m["cache/training_thread_ms"] == pytest.approx(d_session.training_thread_s * 1e3 / 2)
    assert m["cache/training_thread_ms"] > 0  # every step applied a plan
    counters = trainer.datamodule.loader.stats()
    assert counters.planned >= 6 and counters.planner_cpu_s > 0
    assert counters.read >= counters.planned and counters.reader_cpu_s > 0  # the reader thread read them
    assert counters.batch_wait_s >= d_loader.batch_wait_s  # the run's total holds the waits of steps 4-5
    assert counters.staged + counters.gathered_here >= 5  # every step's rows were gathered somewhere
    # through Lightning: in callback_metrics, and in every logger (a CSV one here) at train/loss's steps
    assert trainer.callback_metrics["cache/hit_rate"].item() == pytest.approx(m["cache/hit_rate"])
    rows = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert "cache/hit_rate" in header and f"cache/{TABLES[0]}/rows_flushed" in header


def test_cache_monitor_validates_its_argument():
    for bad in (0, 2.5, True):  # a fraction or a bool was taken (the period rounded, or 1)
        with pytest.raises(ConfigError, match="positive integer"):
            CacheMonitor(log_every_n_steps=bad)  # type: ignore[arg-type]


def test_samples_of_dict_batches_are_counted_through_the_datamodule_s_adapter():
    import torch
    from torchrec import KeyedJaggedTensor

    from torchrec_lookahead.callbacks.cache_monitor import _batch_size
    from torchrec_lookahead.runtime import DictBatchAdapter

    kjt = KeyedJaggedTensor(
        keys=["f"], values=torch.tensor([1, 2, 3]), lengths=torch.ones(3, dtype=torch.long)
    )
    batch = {"dense": torch.zeros(3, 1), "sparse": kjt, "labels": torch.ones(3)}
    assert _batch_size(batch) == 0  # nothing says where a dict keeps its labels
    assert _batch_size(batch, DictBatchAdapter()) == 3


def test_a_tensorboard_log_gets_the_custom_scalars_layout_of_the_cache_metrics(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.custom_scalar import layout_pb2

    tb = TensorBoardLogger(tmp_path, name="tb")
    fit_cached(tmp_path, 2, callbacks=[CacheMonitor(log_every_n_steps=1)], logger=tb, log_every_n_steps=1)
    layouts, tags = [], set()
    for events in (tmp_path / "tb").rglob("events.out.tfevents.*"):
        for event in EventFileLoader(str(events)).Load():
            for value in event.summary.value:
                tags.add(value.tag)
                if value.tag == "custom_scalars__config__":
                    layouts.append(layout_pb2.Layout.FromString(value.tensor.string_val[0]))
    (layout,) = layouts
    charts = {c.title: list(c.multiline.tag) for cat in layout.category for c in cat.chart}
    hit_rate = [re.compile(r) for r in charts["hit rate (every table, and all)"]]
    for table in TABLES:  # every table's logged hit rate is drawn on the one chart
        assert f"cache/{table}/hit_rate" in tags
        assert any(r.fullmatch(f"cache/{table}/hit_rate") for r in hit_rate)
    assert any(r.fullmatch("cache/hit_rate") for r in hit_rate)


def test_with_accumulated_batches_the_monitor_logs_once_per_optimizer_step_per_batch_figures(tmp_path):
    """Two batches end at each global step: the monitor logged at both (the second with nothing in it) and at
    step 0, and divided a log's counters by optimizer steps, not by the batches (plans) they counted."""

    class _Logged(pl.Callback):
        def __init__(self) -> None:
            self.at: List[int] = []
            self.seen = monitor.last_metrics

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if monitor.last_metrics is not self.seen:
                self.seen = monitor.last_metrics
                self.at.append(trainer.global_step)

    monitor, snaps = CacheMonitor(log_every_n_steps=2), _Snapshots()
    logged = _Logged()
    fit_cached(tmp_path, 4, callbacks=[monitor, snaps, logged], logger=False, accumulate_grad_batches=2)
    assert logged.at == [2, 4], logged.at  # batches 4 and 8 (steps 2 and 4), once each
    m = monitor.last_metrics
    before, after = snaps.stats[3], snaps.stats[7]  # the last log covers batches 5-8
    for table in TABLES:
        assert (
            m[f"cache/{table}/rows_fetched"]
            == (after[table]["rows_fetched"] - before[table]["rows_fetched"]) / 4
        )
