"""What a user sees of the cache's set-up at fit start: the cache plan and the capacity pre-scan, printed on rank 0
(the pre-scan with a progress bar, as Lightning's own bars are drawn, with tqdm on standard error) and logged as
text to every TensorBoard logger of the Trainer (``SummaryWriter.add_text``), beside the run's metrics.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, Iterator, Optional

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

__all__ = ["report_text", "scan_progress", "sigterm_pending", "ScanTicker"]

ScanTicker = Callable[[], None]
"""Called once per batch read by a pre-scan."""


def _is_global_zero(trainer: Optional[pl.Trainer]) -> bool:
    return trainer is None or trainer.is_global_zero


def report_text(trainer: Optional[pl.Trainer], tag: str, text: str) -> None:
    """Print ``text`` on rank 0 and add it to each TensorBoard logger of ``trainer`` under ``tag``.

    TensorBoard renders text as Markdown: the text is sent as a preformatted block, so that tables keep their
    columns.

    Example:
        >>> report_text(None, "lookahead/cache_plan", "t_cat_2: 140 rows")
    """
    rank_zero_info(text)
    if trainer is None or not _is_global_zero(trainer):
        return
    block = "\n".join("    " + line for line in text.splitlines())
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text(tag, block, global_step=int(trainer.global_step))


@contextlib.contextmanager
def scan_progress(
    trainer: Optional[pl.Trainer], description: str, total: Optional[int]
) -> Iterator[ScanTicker]:
    """A progress bar over a pre-scan of ``total`` batches (``None``: unknown) while the block runs, on rank 0
    where the Trainer shows progress bars (``enable_progress_bar``). Yields the ticker to call once per batch; it
    also ends the scan of a single process that received SIGTERM (``SIGTERMException``).

    Example:
        >>> with scan_progress(None, "scan", total=2) as tick:
        ...     tick(); tick()
    """
    shows = trainer is not None and trainer.is_global_zero and trainer.progress_bar_callback is not None
    if not shows:
        yield lambda: _stop_if_terminated(trainer)
        return
    from tqdm import tqdm

    t0 = time.perf_counter()
    with tqdm(
        total=total, desc=description, unit="batch", file=sys.stderr, dynamic_ncols=True, leave=True
    ) as bar:

        def tick() -> None:
            _stop_if_terminated(trainer)
            bar.update(1)

        yield tick
        bar.set_postfix_str(f"{time.perf_counter() - t0:.1f} s", refresh=True)


def _stop_if_terminated(trainer: Optional[pl.Trainer]) -> None:
    """End a pre-scan of one process that received SIGTERM (a scan of a large dataset takes minutes). With
    several ranks the scan shares the signal through its lockstep gathers instead (:func:`sigterm_pending`), so
    that every rank stops at the same batch.

    Raises:
        SIGTERMException: Lightning's, as its loops raise it.
    """
    if trainer is not None and trainer.world_size == 1 and trainer.received_sigterm:
        raise SIGTERMException()


def sigterm_pending(trainer: Optional[pl.Trainer]) -> Callable[[], bool]:
    """A test of whether this rank received SIGTERM, agreed with its peers or not yet (the ``pending`` flag of
    the strategy's :class:`~torchrec_lookahead.strategies._signals.LockstepSignalConnector`). A multi-rank
    pre-scan shares it through its lockstep gathers (:func:`~torchrec_lookahead.runtime.scan.prescan`), so that
    every rank stops at the same batch.

    Example:
        >>> sigterm_pending(None)()
        False
    """

    def pending() -> bool:
        if trainer is None:
            return False
        connector = trainer._signal_connector  # Lightning's; the strategy's lockstep one adds ``pending``
        return bool(getattr(connector, "pending", False) or connector.received_sigterm)

    return pending
