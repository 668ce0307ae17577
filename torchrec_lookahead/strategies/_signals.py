"""SIGTERM stops every rank together, at the same training step.

Lightning's SIGTERM handler runs a blocking ``dist.broadcast`` inside the handler, at whatever point the signal
finds the main thread: a peer inside the cache's all-gather (or any other collective) never joins it, and every
rank waits for good. The handler also makes a rank that receives it alone stop at the end of its step while its
peers go on. :class:`LockstepSignalConnector` replaces the handler's work by a flag (and the forwarding of the
signal to the processes Lightning launched), and the strategy agrees on the flags once per training step, at the
end of the step, with one all-reduce of a host tensor on a gloo group (:meth:`agree`): every rank then
ends after the same step (Lightning's ``SIGTERMException``), flushes its caches and exits, whichever of them the
signal reached. With one process the flag stops training at once, and the lookahead pre-scans poll it
(:func:`~torchrec_lookahead.runtime.report.scan_progress`).
"""

from __future__ import annotations

import logging
from types import FrameType
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message, rank_zero_info
from typing_extensions import override

__all__ = ["LockstepSignalConnector", "announce_stop", "use_lockstep_signals"]

log = logging.getLogger(__name__)


class LockstepSignalConnector(_SignalConnector):
    """Lightning's signal connector whose SIGTERM handler only records the signal (see the module docstring).

    ``received_sigterm``, which Lightning's loops read, becomes true on every rank at the same step, through
    :meth:`agree`; with one process, at once.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        super().__init__(trainer)
        #: this rank received SIGTERM (not yet agreed with the others)
        self.pending = False
        self._flag_group: Optional[dist.ProcessGroup] = None

    @override
    def register_signal_handlers(self) -> None:
        self.pending = False
        super().register_signal_handlers()

    @override
    def _sigterm_notifier_fn(self, signum: Any, _: Optional[FrameType]) -> None:
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}", self.trainer.local_rank))
        if not self.pending:
            launcher = self.trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)  # the ranks Lightning started as this process's children
        self.pending = True
        if self.trainer.world_size == 1:
            self.received_sigterm = True

    def _group(self) -> Optional[dist.ProcessGroup]:
        """The group the flags are agreed on: the default group when it is gloo, else a gloo group of every rank
        (created at the first agreement, a point every rank reaches together), so that the flag stays a host
        tensor and agreeing never waits for the device (under NCCL, ``item()`` of a device tensor would)."""
        if self._flag_group is None:
            default = dist.group.WORLD
            self._flag_group = default if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return self._flag_group

    def agree(self, validating: bool = False) -> bool:
        """Whether some rank received SIGTERM; a collective of every rank's training thread (one all-reduce of
        three numbers, on the host, see :meth:`_group`) that every rank calls at the same point of every training
        step (its end, before Lightning decides whether to validate or stop) and, so that a long validation does
        not keep a signalled run going, of every validation step (``validating``: Lightning's evaluation loop then
        stops after the batch).

        The same all-reduce agrees on ``trainer.should_stop``: set on some rank only (a callback reading a
        rank-local metric), it becomes true on every rank, so that every rank stops after the same step instead
        of one leaving its peers inside a collective (Lightning's DDP does not agree on it either)."""
        if self.received_sigterm:
            return True
        trainer = self.trainer
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            stop = int(bool(trainer.should_stop))
            # MAX of [signal, stop, not stop]: some rank signalled, some rank stops, some rank does not
            flags = torch.tensor([int(self.pending), stop, 1 - stop])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group())
            signalled, any_stop, any_go = (int(x) for x in flags.tolist())
            if any_stop and any_go:
                trainer.should_stop = True
                where = (
                    f"after the validation after step {trainer.global_step}"
                    if validating or trainer.validating
                    else f"after step {trainer.global_step}"
                )
                rank_zero_info(f"should_stop: every rank stops {where} (some rank set trainer.should_stop)")
            if signalled:
                self.received_sigterm = True
                where = (
                    f"in the validation after step {trainer.global_step}"
                    if validating
                    else f"after step {trainer.global_step}"
                )
                rank_zero_info(f"SIGTERM: every rank stops {where} (the caches are flushed)")
        return self.received_sigterm


def use_lockstep_signals(trainer: pl.Trainer) -> LockstepSignalConnector:
    """Give ``trainer`` a :class:`LockstepSignalConnector` (before it registers its signal handlers).

    Lightning's training loop also broadcasts rank 0's SIGTERM flag at the start of every step (a collective on
    the default group; under NCCL a device tensor read back, a host-device synchronisation per step). With the
    connector the flag is already the same on every rank (:meth:`LockstepSignalConnector.agree`), so that
    broadcast becomes the local check it amounts to. The flags are agreed at the end of every training step, after
    each validation of the fit and at the end of each epoch (``trainer.should_stop``, which hooks of those points
    may set on one rank only: see :meth:`LockstepSignalConnector.agree`)."""
    if isinstance(trainer._signal_connector, LockstepSignalConnector):
        return trainer._signal_connector  # given (and its loops wrapped) by an earlier call
    connector = LockstepSignalConnector(trainer)
    trainer._signal_connector = connector
    loop = trainer.fit_loop.epoch_loop
    if hasattr(loop, "_broadcast_sigterm_tensor"):

        def local_check() -> None:
            if connector.received_sigterm:
                raise SIGTERMException()

        loop._broadcast_sigterm_tensor = local_check  # type: ignore[method-assign]
    end_of_step = loop.on_advance_end
    validate = loop.val_loop.run
    fit = trainer.fit_loop
    end_of_epoch = fit.on_advance_end

    def agreed_end_of_step(data_fetcher: Any) -> None:
        connector.agree()  # before Lightning validates, or stops, on trainer.should_stop
        end_of_step(data_fetcher)

    def agreed_validation() -> Any:
        out = validate()
        connector.agree(validating=True)  # a should_stop set by a validation hook on some rank
        return out

    def agreed_end_of_epoch() -> None:
        end_of_epoch()
        connector.agree()  # a should_stop set by an end-of-epoch hook on some rank

    loop.on_advance_end = agreed_end_of_step  # type: ignore[method-assign]
    loop.val_loop.run = agreed_validation  # type: ignore[method-assign]
    fit.on_advance_end = agreed_end_of_epoch  # type: ignore[method-assign]
    return connector


def announce_stop(module: Optional[pl.LightningModule], exception: BaseException) -> None:
    """With one process, say where SIGTERM stopped ``module``'s run (Lightning stops it at the end of the step, or
    of the validation batch, in which the signal came, without a word; several ranks say it when they agree)."""
    trainer = module._trainer if module is not None else None
    if trainer is None or not isinstance(exception, SIGTERMException) or trainer.world_size > 1:
        return
    where = (
        f"in the validation after step {trainer.global_step}"
        if trainer.validating
        else f"after step {trainer.global_step}"
    )
    rank_zero_info(f"SIGTERM: the run stops {where} (the caches are flushed)")
