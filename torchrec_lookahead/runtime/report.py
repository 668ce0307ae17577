"""What a user sees of the cache's set-up at fit start: the cache plan and the capacity pre-scan, printed on rank 0
(the pre-scan with a progress bar, as Lightning's own bars are drawn, with tqdm on standard error) and logged as
text to every TensorBoard logger of the Trainer (``SummaryWriter.add_text``), beside the run's metrics.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import TYPE_CHECKING, Callable, Iterator, List, Mapping, Optional

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

if TYPE_CHECKING:
    from torchrec_lookahead.runtime.scan import PreScan
    from torchrec_lookahead.runtime.target import CacheTarget

__all__ = ["report_text", "scan_progress", "sigterm_pending", "ScanTicker", "need_lines"]

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


def need_lines(scan: PreScan, target: CacheTarget, pinned: Optional[Mapping[str, int]] = None) -> List[str]:
    """The capacity report's lines: a table alone against its capacity; the tables of a shared slot space
    together against the space's (the sum of theirs), each member's own need below it, which may exceed its
    share of the space's rows. ``pinned``: rows of each cache held by FAE's pinned hot rows, which the scanned
    (cold) batches do not read: each need counts them besides the windows'.

    Example:
        >>> from torchrec_lookahead.runtime import CacheTarget, PreScan
        >>> target = CacheTarget({"a": 4, "b": 4, "c": 2}, {}, {}, {}, slot_spaces={"a+1": ("a", "b")})
        >>> scan = PreScan({"a": 5, "b": 1, "c": 2}, 3, True, 0.1, {"a+1": 6})
        >>> for line in need_lines(scan, target):
        ...     print(line)
          c: 2 of 2 cache rows
          tables a, b (one shared cache): 6 of 8 cache rows
            each table's own windows: a 5, b 1
        >>> for line in need_lines(scan, target, pinned={"a": 1, "c": 0}):
        ...     print(line)
          c: 2 of 2 cache rows
          tables a, b (one shared cache): 7 of 8 cache rows (1 pinned hot rows and the windows' 6)
            each table's own windows: a 5 (and 1 pinned), b 1
    """
    held = {t: int(n) for t, n in (pinned or {}).items() if n}

    def cache(need: int, tables: List[str], capacity: int) -> str:
        p = sum(held.get(t, 0) for t in tables)
        extra = f" ({p:,} pinned hot rows and the windows' {need:,})" if p else ""
        return f"{need + p:,} of {capacity:,} cache rows{extra}"

    def own(table: str) -> str:
        return f"{table} {scan.need[table]:,}" + (f" (and {held[table]:,} pinned)" if table in held else "")

    lines = []
    spaces = {k: m for k, m in target.slot_spaces.items() if k in scan.space_need}
    pooled = {t for m in spaces.values() for t in m}
    lines += [
        f"  {t}: {cache(scan.need[t], [t], int(target.capacity[t]))}"
        for t in sorted(scan.need)
        if t not in pooled
    ]
    for k, members in sorted(spaces.items()):
        total = sum(int(target.capacity[t]) for t in members)
        lines.append(
            f"  tables {', '.join(members)} (one shared cache): {cache(scan.space_need[k], list(members), total)}"
        )
        lines.append(f"    each table's own windows: {', '.join(own(t) for t in members if t in scan.need)}")
    return lines
