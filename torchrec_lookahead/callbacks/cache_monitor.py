"""``CacheMonitor``: cache statistics logged through Lightning (every logger, and ``trainer.callback_metrics``,
so ``EarlyStopping`` and ``ModelCheckpoint`` can monitor them), at the step ``train/loss`` is logged at.

Logged every ``log_every_n_steps`` training steps, under ``cache/<table>/...``: ``hit_rate`` (lookups served
by rows already cached before the step's fetches), ``rows_fetched``, ``rows_written_back``, ``rows_flushed``
and ``bytes_moved`` per step, ``occupancy`` (its filled slots / the rows of its cache, which the tables of a
pooled layout share); over every cached table
``cache/hit_rate``, ``cache/device_bytes`` (cache rows and their optimizer state) and ``cache/host_bytes``
(the stores' rows and state), ``cache/samples_per_s`` (this rank's training samples per second since the last
log); and ``cache/oracle_lead`` (batches planned ahead of training) and
``cache/stager_wait_ms`` (time the training step waited for staged rows, per step), ``cache/batch_wait_ms``
(time it waited for the planner's next batch, per step), ``cache/reader_cpu_ms``, ``cache/planner_cpu_ms`` and
``cache/stager_cpu_ms`` (CPU time of the reader thread per batch read, of the planner thread per batch planned,
of the stager thread per plan staged; absent from a log in which the thread handled no batch, as the reader
once it has read the epoch), and
``cache/training_thread_ms`` (time the training thread spent in cache code per step: applying the plan, with
its counters, without the wait for staged rows; making FAE's hot batches; with several ranks also the cache
kernels' backward hooks, the exact gradient exchange and its update). With several ranks
(LRPP), per step: ``cache/sync/rows_synced_critical`` (rows refreshed or gradient-synchronised before or
within the step), ``cache/sync/rows_synced_delayed`` (shared rows not read at the next step, whose gradients
travel in the background), ``cache/sync/rows_refreshed``, ``cache/sync/rows_grad_synced`` (every
shared row), ``cache/sync/rows_skipped`` (rows updated by one rank only, never synchronised),
``cache/sync/grad_floats_sent`` (gradient floats this rank sent for other ranks' shared rows) and, where some
happened, ``cache/sync/exchanges_indexed_in_backward`` (gradient exchanges the backward indexed itself because
the step's plan came without an exchange index: plans made by hand).

"Per step" is per training batch (one plan each): with ``accumulate_grad_batches`` > 1 the figures are per batch,
logged once per optimizer step.

With a TensorBoard logger, the monitor also writes a custom-scalars layout (:data:`TENSORBOARD_LAYOUT`, the
"Custom Scalars" tab): every table's hit rate on one chart, every table's rows fetched on another, and so on.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from typing_extensions import override

from torchrec_lookahead._checks import is_int
from torchrec_lookahead.data import batch_adapter_of, trainer_datamodules
from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.runtime import CacheHost, CacheSession, CacheStats

__all__ = ["CacheMonitor", "TENSORBOARD_LAYOUT"]

#: TensorBoard's custom-scalars layout: category -> chart title -> ``["Multiline", [tag regexes]]``, each chart
#: drawing every cached table's series of one metric together.
TENSORBOARD_LAYOUT: Dict[str, Dict[str, List[Any]]] = {
    "lookahead cache": {
        "hit rate (every table, and all)": ["Multiline", [r"cache/[^/]+/hit_rate", r"cache/hit_rate"]],
        "rows fetched per step": ["Multiline", [r"cache/[^/]+/rows_fetched"]],
        "rows written back per step": ["Multiline", [r"cache/[^/]+/rows_written_back"]],
        "occupancy": ["Multiline", [r"cache/[^/]+/occupancy"]],
        "bytes": ["Multiline", [r"cache/device_bytes", r"cache/host_bytes"]],
    },
    "lookahead threads": {
        "training waits (ms per step)": ["Multiline", [r"cache/stager_wait_ms", r"cache/batch_wait_ms"]],
        "training thread in cache code (ms per step)": ["Multiline", [r"cache/training_thread_ms"]],
        "thread CPU (ms per batch)": ["Multiline", [r"cache/(reader|planner|stager)_cpu_ms"]],
        "oracle lead (batches)": ["Multiline", [r"cache/oracle_lead"]],
    },
    "lookahead sync (several ranks)": {
        "rows synchronised per step": ["Multiline", [r"cache/sync/rows_.*"]],
    },
}


def _batch_size(batch: Any, adapter: Any = None) -> int:
    """Samples in ``batch``: its labels' length; a batch that is not a TorchRec ``Batch`` (a dict) read through
    the DataModule's :class:`~torchrec_lookahead.runtime.BatchAdapter`."""
    labels = getattr(batch, "labels", None)
    if labels is None and adapter is not None:
        labels = adapter.split(batch)[2]
    return int(labels.shape[0]) if isinstance(labels, torch.Tensor) and labels.dim() > 0 else 0


class CacheMonitor(Callback):
    """Log cache statistics of the ``torchrec`` strategy's cached tables.

    Args:
        log_every_n_steps: steps between two logs (default: the Trainer's ``log_every_n_steps``).

    Example:
        >>> CacheMonitor(log_every_n_steps=10).state_key
        'CacheMonitor'
    """

    def __init__(self, log_every_n_steps: Optional[int] = None) -> None:
        if log_every_n_steps is not None and (not is_int(log_every_n_steps) or log_every_n_steps < 1):
            raise ConfigError(
                f"Expected log_every_n_steps to be a positive integer but got {log_every_n_steps!r}"
            )
        self.log_every_n_steps = log_every_n_steps
        self._last = CacheStats()
        self._last_step = 0
        self._last_time = time.perf_counter()
        self._samples = 0
        self._batches = 0
        self.last_metrics: Dict[str, float] = {}

    @staticmethod
    def _session(trainer: pl.Trainer) -> Optional[CacheSession]:
        s = trainer.strategy
        return s.cache_session() if isinstance(s, CacheHost) else None

    def _stats(self, trainer: pl.Trainer) -> CacheStats:
        session = self._session(trainer)
        return CacheStats() if session is None else session.stats()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = self._stats(trainer)
        self._last_step = trainer.global_step
        self._last_time = time.perf_counter()
        self._samples = self._batches = 0
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_custom_scalars(TENSORBOARD_LAYOUT)

    def _footprint(self, trainer: pl.Trainer) -> Dict[str, float]:
        """Per cached table its occupancy (its rows / the rows of its cache, shared in a pooled layout), and device
        and host bytes of all caches."""
        session = self._session(trainer)
        out: Dict[str, float] = {}
        device = host = 0
        if session is None:
            return out
        for m in session.modules:
            cache = m.cache
            for table, capacity in cache.capacity.items():
                filled = int((cache.slot_ids(table) >= 0).sum())
                rows = cache.cache_rows(table)  # its slot space's: a pooled cache's tables share its rows
                out[f"cache/{table}/occupancy"] = filled / rows if rows else 0.0
                row = cache.cache_weights(table).shape[1] + sum(
                    v.shape[1] for v in cache.cache_states(table).values()
                )
                device += capacity * row * 4
                store = cache.stores[table]
                host += store.num_embeddings * row * 4
        out["cache/device_bytes"] = float(device)
        out["cache/host_bytes"] = float(host)
        return out

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._samples += _batch_size(batch, batch_adapter_of(trainer_datamodules(trainer)[0]))
        self._batches += 1
        every = self.log_every_n_steps or int(getattr(trainer, "log_every_n_steps", 50))
        # once per optimizer step: with accumulate_grad_batches > 1 several batches end at the same global step
        if trainer.global_step == self._last_step or trainer.global_step % max(every, 1) != 0:
            return
        stats = self._stats(trainer)
        d = stats - self._last
        # the cache's counters count batches (one plan each): per batch, which is per step without accumulation
        steps = max(self._batches, 1)
        self._batches = 0
        metrics: Dict[str, float] = {}
        for table, c in d.tables.items():
            n = c.get("lookups", 0)
            metrics[f"cache/{table}/hit_rate"] = c.get("hits", 0) / n if n else 0.0
            for counter in ("rows_fetched", "rows_written_back", "rows_flushed", "bytes_moved"):
                metrics[f"cache/{table}/{counter}"] = c.get(counter, 0) / steps
        if d.tables:
            metrics["cache/hit_rate"] = d.hit_rate
            metrics.update(self._footprint(trainer))
        now_time = time.perf_counter()
        elapsed = now_time - self._last_time
        metrics["cache/samples_per_s"] = self._samples / elapsed if elapsed > 0 else 0.0
        self._last_time, self._samples = now_time, 0
        for k, v in d.sync.items():
            metrics[f"cache/sync/{k}"] = v / steps
        session = self._session(trainer)
        if session is not None and session.loader is not None:
            metrics["cache/oracle_lead"] = float(session.oracle_lead())
            metrics["cache/stager_wait_ms"] = d.threads.stager_wait_s * 1e3 / steps
            metrics["cache/gathered_by_training_thread"] = d.threads.gathered_here / steps
            metrics["cache/batch_wait_ms"] = d.threads.batch_wait_s * 1e3 / steps
            metrics["cache/training_thread_ms"] = d.training_thread_s * 1e3 / steps
            for what, cpu, count in (
                ("reader", d.threads.reader_cpu_s, d.threads.read),
                ("planner", d.threads.planner_cpu_s, d.threads.planned),
                ("stager", d.threads.stager_cpu_s, d.threads.staged),
            ):
                if count > 0:  # a thread done with the epoch (the reader, far ahead) has no figure, not 0 ms
                    metrics[f"cache/{what}_cpu_ms"] = cpu * 1e3 / count
        self._last = stats
        self._last_step = trainer.global_step
        self.last_metrics = metrics
        # Through Lightning: every logger, callback_metrics (EarlyStopping / ModelCheckpoint can monitor them),
        # at the step train/loss is logged at. Counters are this rank's (the caches' plans are global).
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    @override
    def state_dict(self) -> Dict[str, Any]:
        return {"log_every_n_steps": self.log_every_n_steps}

    @override
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.log_every_n_steps = state_dict.get("log_every_n_steps", self.log_every_n_steps)
