import pytest

from torchrec_lookahead import ConfigError
from torchrec_lookahead.callbacks import CacheMonitor

from ..helpers import fit_cached


def test_cache_monitor_reports_per_table_statistics(tmp_path):
    monitor = CacheMonitor(log_every_n_steps=2)
    trainer, _ = fit_cached(tmp_path, 6, callbacks=[monitor])
    m = monitor.last_metrics
    for table in ("t_cat_2", "t_cat_11", "t_cat_15"):
        assert 0.0 <= m[f"cache/{table}/hit_rate"] <= 1.0
        assert m[f"cache/{table}/rows_fetched"] >= 0 and f"cache/{table}/bytes_moved" in m
    assert m["cache/oracle_lead"] >= 0 and m["cache/stager_wait_ms"] >= 0
    assert 0 <= m["cache/gathered_by_training_thread"] <= 1
    assert m["cache/batch_wait_ms"] >= 0 and m["cache/planner_cpu_ms"] >= 0 and m["cache/stager_cpu_ms"] >= 0
    loader = trainer.datamodule.loader
    assert loader.stats_planned >= 6 and loader.stats_planner_cpu_s > 0 and loader.stats_batch_wait_s >= 0
    assert loader.stats_staged + loader.stats_gathered_here >= 5  # every step's rows were gathered somewhere
    assert any(m[f"cache/{t}/hit_rate"] > 0 for t in ("t_cat_2", "t_cat_11", "t_cat_15"))


def test_cache_monitor_validates_its_argument():
    with pytest.raises(ConfigError, match="positive integer"):
        CacheMonitor(log_every_n_steps=0)
