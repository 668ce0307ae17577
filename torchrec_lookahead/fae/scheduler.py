"""FAE's shuffle scheduler as a Lightning callback: runs of cold and hot mini-batches, at a rate adapted from
the validation loss.

The rule (FAE, equation 7), precisely:

* The *rate* ``r`` is a percentage in ``(0, 100]`` (FAE's ``R(r)``). A run of one kind is
  ``max(1, ceil(r / 100 * n_kind))`` batches, where ``n_kind`` is the number of batches of that kind in the
  epoch: ``R(100)`` trains every cold batch, then every hot one; small rates alternate single batches.
  Training starts each epoch with a cold run (cold batches touch the widest range of rows) at
  ``initial_rate`` (FAE's ``R(50)`` by default).
* A run ends when it has trained its length, or when its kind has no batches left this epoch; the other kind
  then starts a run if it has batches left. ``fae/swaps`` counts the changes of kind between consecutive
  trained batches.
* After each validation (not the sanity check), with ``L`` the validation loss (``monitor``), all-reduced
  over ranks so that every rank takes the same decision, and ``L_prev`` the previous one:

  - ``L >= L_prev``: the rate is halved (down to the rate at which every run is one batch) and the running
    run is cut to the new length at most;
  - ``L < L_prev`` for the ``patience``-th time in a row (FAE: 4): the rate is doubled (up to 100, runs as
    long as the rest of the epoch), from the next run on, and the count restarts;
  - otherwise the rate is unchanged.

The callback tells the :class:`~torchrec_lookahead.fae.HotColdDataModule`'s loader which kind to serve
next; the loader serves it when its bounded window allows (else the other kind, which the callback counts as
what it is). It logs ``fae/rate``, ``fae/hot_batches``, ``fae/cold_batches``, ``fae/swaps`` and
``fae/hot_share`` through Lightning's logging, and its state resumes with a checkpoint.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Dict, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from torchrec_lookahead._checks import is_int
from torchrec_lookahead.data.lookahead import LookaheadDataModule
from torchrec_lookahead.data.wrapper import trainer_datamodules
from torchrec_lookahead.errors import ConfigError, SetupError
from torchrec_lookahead.fae.datamodule import HotColdDataModule
from torchrec_lookahead.fae.loader import HotColdLoader
from torchrec_lookahead.fae.lookahead import HotColdLookaheadLoader
from torchrec_lookahead.fae.stream import BatchKind

__all__ = ["HotColdScheduler", "RateRule"]


class RateRule:
    """The rate part of the rule, on its own: feed it validation losses, read ``rate``.

    Args:
        rate: starting rate in percent.
        patience: consecutive decreases that double the rate.

    Example:
        >>> rule = RateRule(rate=50.0, patience=2)
        >>> [rule.observe(x, min_rate=1.0) for x in (1.0, 0.9, 0.8, 0.85, 0.7, 0.6)]
        [50.0, 50.0, 100.0, 50.0, 50.0, 100.0]
    """

    def __init__(self, rate: float = 50.0, patience: int = 4) -> None:
        given: object = rate  # checked as any value: the Python API takes what it is given
        if isinstance(given, bool) or not isinstance(given, numbers.Real) or not 0.0 < float(given) <= 100.0:
            raise ConfigError(f"Expected the rate in (0, 100] percent but got {rate!r}; FAE starts at 50")
        if not is_int(patience) or patience < 1:
            raise ConfigError(f"Expected patience to be a positive integer but got {patience!r}")
        self.rate = float(rate)
        self.patience = int(patience)
        self.last_loss: Optional[float] = None
        self.decreases = 0

    def observe(self, loss: float, min_rate: float) -> float:
        """Update the rate after a validation loss; returns the new rate."""
        if self.last_loss is not None:
            if loss >= self.last_loss:
                self.rate = max(self.rate / 2.0, min(min_rate, self.rate))
                self.decreases = 0
            else:
                self.decreases += 1
                if self.decreases >= self.patience:
                    self.rate = min(100.0, self.rate * 2.0)
                    self.decreases = 0
        self.last_loss = float(loss)
        return self.rate

    def state_dict(self) -> Dict[str, Any]:
        return {"rate": self.rate, "last_loss": self.last_loss, "decreases": self.decreases}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.rate = float(state.get("rate", self.rate))
        self.last_loss = state.get("last_loss")
        self.decreases = int(state.get("decreases", 0))


class HotColdScheduler(pl.Callback):
    """Interleave FAE's cold and hot mini-batches at a rate adapted from the validation loss.

    Args:
        initial_rate: starting rate in percent of each kind's batches per run (FAE: 50).
        patience: consecutive validation-loss decreases that double the rate (FAE: 4).
        monitor: the validation metric (lower is better).

    Example:
        >>> s = HotColdScheduler()
        >>> s.rule.rate, s.rule.patience
        (50.0, 4)
    """

    def __init__(self, initial_rate: float = 50.0, patience: int = 4, monitor: str = "val/logloss") -> None:
        super().__init__()
        self.rule = RateRule(initial_rate, patience)
        metric: object = monitor
        if not isinstance(metric, str) or not metric:
            raise ConfigError(
                f"Expected monitor to name a validation metric (lower is better, e.g. 'val/logloss') but got "
                f"{monitor!r}"
            )
        self.monitor = monitor
        self.kind = BatchKind.COLD
        self.left = 0
        self.swaps = 0
        self.trained: Dict[BatchKind, int] = {BatchKind.HOT: 0, BatchKind.COLD: 0}
        self.epoch = -1
        self._last_served: Optional[BatchKind] = None
        self._warned = False

    @property
    def rate(self) -> float:
        """The current rate in percent."""
        return self.rule.rate

    @staticmethod
    def _loader(trainer: pl.Trainer) -> HotColdLoader:
        dm, inner = trainer_datamodules(trainer)
        loader = dm.loader if isinstance(dm, (HotColdDataModule, LookaheadDataModule)) else None
        if isinstance(loader, HotColdLookaheadLoader):  # pinned hot rows: the lookahead loader wraps it
            loader = loader.hotcold
        if loader is None and isinstance(dm, LookaheadDataModule) and isinstance(inner, HotColdDataModule):
            loader = (
                inner.loader
            )  # no cached table: the lookahead DataModule passes the hot/cold loader through
        if isinstance(loader, HotColdLoader):
            return loader
        raise SetupError(
            "HotColdScheduler needs the hot/cold training loader: wrap the DataModule in "
            "torchrec_lookahead.fae.HotColdDataModule"
        )

    def run_length(self, kind: BatchKind, per_epoch: Dict[BatchKind, int]) -> int:
        """Batches in a run of ``kind`` at the current rate."""
        return max(1, math.ceil(self.rule.rate / 100.0 * per_epoch[kind] - 1e-9))

    def _min_rate(self, per_epoch: Dict[BatchKind, int]) -> float:
        return 100.0 / max(1, *per_epoch.values())

    def _request(self, loader: HotColdLoader) -> None:
        remaining = loader.remaining()
        if self.left <= 0 or remaining[self.kind] <= 0:
            other = BatchKind.HOT if self.kind is BatchKind.COLD else BatchKind.COLD
            if remaining[other] > 0:
                self.kind = other
            self.left = self.run_length(self.kind, loader.batches_per_epoch())
        loader.request(self.kind)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Resumed mid-epoch, Lightning skips on_train_epoch_start: the loader, made anew, must still be asked for
        # the kind the checkpoint's run was in (unasked, it serves the fuller queue, and the run diverges).
        if self.epoch == trainer.current_epoch:
            self._loader(trainer).request(self.kind)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loader = self._loader(trainer)
        if self.epoch != trainer.current_epoch:  # a fresh epoch (not one resumed from a checkpoint)
            self.epoch = trainer.current_epoch
            per = loader.batches_per_epoch()
            self.kind = BatchKind.COLD if per[BatchKind.COLD] > 0 else BatchKind.HOT
            self.left = self.run_length(self.kind, per)
            self._last_served = None
        loader.request(self.kind)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loader = self._loader(trainer)
        served = loader.last_kind
        if served is not None:
            if self._last_served is not None and served is not self._last_served:
                self.swaps += 1
            self._last_served = served
            self.trained[served] += 1
            if served is self.kind:
                self.left -= 1
        self._request(loader)
        total = sum(self.trained.values())
        pl_module.log_dict(
            {
                "fae/rate": self.rule.rate,
                "fae/hot_batches": float(self.trained[BatchKind.HOT]),
                "fae/cold_batches": float(self.trained[BatchKind.COLD]),
                "fae/swaps": float(self.swaps),
                "fae/hot_share": self.trained[BatchKind.HOT] / max(total, 1),
            },
            on_step=True,
            on_epoch=False,
        )

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:  # validations inside fit only
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            if not self._warned:
                rank_zero_warn(
                    f"HotColdScheduler: no {self.monitor!r} after validation; the rate stays fixed"
                )
                self._warned = True
            return
        loss = trainer.strategy.reduce(torch.as_tensor(value, dtype=torch.float64).clone(), reduce_op="mean")
        loader = self._loader(trainer)
        per = loader.batches_per_epoch()
        self.rule.observe(float(loss), self._min_rate(per))
        self.left = min(self.left, self.run_length(self.kind, per))
        self._request(loader)

    @override
    def state_dict(self) -> Dict[str, Any]:
        return {
            "rule": self.rule.state_dict(),
            "kind": self.kind.value,
            "left": self.left,
            "swaps": self.swaps,
            "hot_batches": self.trained[BatchKind.HOT],
            "cold_batches": self.trained[BatchKind.COLD],
            "epoch": self.epoch,
            "last_served": None if self._last_served is None else self._last_served.value,
        }

    @override
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.rule.load_state_dict(state_dict.get("rule", {}))
        self.kind = BatchKind(state_dict.get("kind", BatchKind.COLD.value))
        self.left = int(state_dict.get("left", 0))
        self.swaps = int(state_dict.get("swaps", 0))
        self.trained = {
            BatchKind.HOT: int(state_dict.get("hot_batches", 0)),
            BatchKind.COLD: int(state_dict.get("cold_batches", 0)),
        }
        self.epoch = int(state_dict.get("epoch", -1))
        last = state_dict.get("last_served")
        self._last_served = None if last is None else BatchKind(last)
