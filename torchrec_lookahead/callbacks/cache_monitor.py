"""``CacheMonitor``: cache statistics to the logger (TensorBoard), per cached table.

Logged every ``log_every_n_steps`` training steps, under ``cache/<table>/...``: ``hit_rate`` (lookups served
by rows already cached before the step's fetches), ``rows_fetched`` and ``rows_written_back`` per step,
``bytes_moved`` per step; and ``cache/oracle_lead`` (batches planned ahead of training) and
``cache/stager_wait_ms`` (time the training step waited for staged rows, per step), ``cache/batch_wait_ms``
(time it waited for the planner's next batch, per step), ``cache/planner_cpu_ms`` and ``cache/stager_cpu_ms``
(CPU time of the planner thread per batch planned, of the stager thread per plan staged). With several ranks
(LRPP), per step: ``cache/sync/rows_synced_critical`` (rows refreshed or gradient-synchronised before or
within the step), ``cache/sync/rows_synced_delayed`` (shared rows not read at the next step, whose gradients
are all-reduced in the background), ``cache/sync/rows_refreshed``, ``cache/sync/rows_grad_synced`` (every
shared row) and ``cache/sync/rows_skipped`` (rows updated by one rank only, never synchronised).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from torchrec_lookahead.errors import ConfigError

__all__ = ["CacheMonitor"]


class CacheMonitor(Callback):
    """Log cache statistics of the ``torchrec`` strategy's cached tables.

    Args:
        log_every_n_steps: steps between two logs (default: the Trainer's ``log_every_n_steps``).

    Example:
        >>> CacheMonitor(log_every_n_steps=10).state_key
        'CacheMonitor'
    """

    def __init__(self, log_every_n_steps: Optional[int] = None) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ConfigError(
                f"Expected log_every_n_steps to be a positive integer but got {log_every_n_steps}"
            )
        self.log_every_n_steps = log_every_n_steps
        self._last: Dict[str, Dict[str, int]] = {}
        self._last_loader: Dict[str, float] = {}
        self._last_sync: Dict[str, int] = {}
        self._last_step = 0
        self.last_metrics: Dict[str, float] = {}

    @staticmethod
    def _strategy(trainer: pl.Trainer) -> Any:
        s = trainer.strategy
        return s if hasattr(s, "cached_modules") else None

    def _stats(self, trainer: pl.Trainer) -> Dict[str, Dict[str, int]]:
        s = self._strategy(trainer)
        out: Dict[str, Dict[str, int]] = {}
        if s is not None:
            for m in s.cached_modules():
                out.update(m.cache.stats())
        return out

    def _sync(self, trainer: pl.Trainer) -> Dict[str, int]:
        s = self._strategy(trainer)
        out: Dict[str, int] = {}
        if s is not None:
            for m in s.cached_modules():
                for k, v in getattr(m, "sync_counters", {}).items():
                    out[k] = out.get(k, 0) + v
        return out

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = self._stats(trainer)
        self._last_sync = self._sync(trainer)
        self._last_loader = {}
        self._last_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        every = self.log_every_n_steps or int(getattr(trainer, "log_every_n_steps", 50))
        if trainer.global_step % max(every, 1) != 0:
            return
        stats = self._stats(trainer)
        steps = max(trainer.global_step - self._last_step, 1)
        metrics: Dict[str, float] = {}
        for table, now in stats.items():
            before = self._last.get(table, {})
            d = {k: v - before.get(k, 0) for k, v in now.items()}
            lookups = d.get("lookups", 0)
            metrics[f"cache/{table}/hit_rate"] = d.get("hits", 0) / lookups if lookups else 0.0
            metrics[f"cache/{table}/rows_fetched"] = d.get("rows_fetched", 0) / steps
            metrics[f"cache/{table}/rows_written_back"] = d.get("rows_written_back", 0) / steps
            metrics[f"cache/{table}/bytes_moved"] = d.get("bytes_moved", 0) / steps
        sync = self._sync(trainer)
        for k, v in sync.items():
            metrics[f"cache/sync/{k}"] = (v - self._last_sync.get(k, 0)) / steps
        self._last_sync = sync
        loader = getattr(getattr(trainer, "datamodule", None), "loader", None)
        if loader is not None and hasattr(loader, "oracle_lead"):
            metrics["cache/oracle_lead"] = float(loader.oracle_lead())
            counters = loader.stats()
            delta = {k: v - self._last_loader.get(k, 0.0) for k, v in counters.items()}
            self._last_loader = counters
            metrics["cache/stager_wait_ms"] = delta["stats_wait_s"] * 1e3 / steps
            metrics["cache/gathered_by_training_thread"] = delta["stats_gathered_here"] / steps
            metrics["cache/batch_wait_ms"] = delta["stats_batch_wait_s"] * 1e3 / steps
            for what, cpu, count in (
                ("planner", "stats_planner_cpu_s", "stats_planned"),
                ("stager", "stats_stager_cpu_s", "stats_staged"),
            ):
                metrics[f"cache/{what}_cpu_ms"] = delta[cpu] * 1e3 / delta[count] if delta[count] > 0 else 0.0
        self._last = stats
        self._last_step = trainer.global_step
        self.last_metrics = metrics
        if metrics and trainer.logger is not None:
            trainer.logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def state_dict(self) -> Dict[str, Any]:
        return {"log_every_n_steps": self.log_every_n_steps}

    @override
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.log_every_n_steps = state_dict.get("log_every_n_steps", self.log_every_n_steps)
