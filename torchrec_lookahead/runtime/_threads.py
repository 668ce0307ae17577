"""Threads of the lookahead loader: one iteration's queues and stop flag (:class:`_Run`), and what its reader,
planner and stager threads do first (:func:`single_threaded_ops`, :func:`lower_thread_priority`).

Example:
    >>> run = _Run(queue_depth=2)
    >>> run.put("batch"), run.get(), run.stopped
    (True, 'batch', False)
    >>> run.stop() is None, run.stopped, run.put("late")
    (True, True, False)
"""

from __future__ import annotations

import logging
import numbers
import os
import queue
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch

from torchrec_lookahead._checks import check_int, is_int
from torchrec_lookahead.errors import ConfigError

__all__ = [
    "single_threaded_ops",
    "lower_thread_priority",
    "check_nice",
    "check_loader_options",
    "ApplyProgress",
    "LoaderStats",
]

log = logging.getLogger(__name__)

_END = object()


def single_threaded_ops() -> None:
    """Run the calling thread's torch operators on one thread (the lookahead threads call it first).

    With OpenMP, a parallel operator started from a thread other than the training thread gets a thread team of
    its own, as large as torch's intra-op setting: the planner's and stager's small operators would add that
    many spinning workers beside the training thread's team (oversubscription). ``torch.set_num_threads``
    sets the calling thread's team size and also the default that threads initialising later start from;
    the default is set back from a short-lived thread, so that only this thread changes.
    """
    default = torch.get_num_threads()
    if default == 1:
        return
    torch.set_num_threads(1)
    restore = threading.Thread(target=torch.set_num_threads, args=(default,), name="restore-num-threads")
    restore.start()
    restore.join()


def check_nice(nice: int) -> int:
    """``planner_nice`` as an ``int`` in [0, 19] (the nice value the planner thread adds to its own).

    Raises:
        ConfigError: it is not an integer in that range.
    """
    if not is_int(nice) or not 0 <= int(nice) <= 19:
        raise ConfigError(f"Expected planner_nice in [0, 19] but got {nice!r}")
    return int(nice)


def check_loader_options(
    queue_depth: int, stop_timeout_s: float, planner_nice: int
) -> Tuple[int, float, int]:
    """The lookahead loader's ``queue_depth`` (an integer >= 1), ``stop_timeout_s`` (a number > 0) and
    ``planner_nice`` (:func:`check_nice`), as ``LookaheadDataModule`` and ``LookaheadTrainPipeline`` take them.

    Raises:
        ConfigError: one is out of its range.

    Example:
        >>> check_loader_options(8, 60, 19)
        (8, 60.0, 19)
    """
    depth = check_int("queue_depth", queue_depth, 1, "give the planned batches kept ready")
    if (
        isinstance(stop_timeout_s, bool)
        or not isinstance(stop_timeout_s, numbers.Real)
        or not 0 < stop_timeout_s <= threading.TIMEOUT_MAX - 30  # the threads' join waits 30 s more
    ):
        raise ConfigError(
            f"Expected stop_timeout_s > 0 (seconds, finite) but got {stop_timeout_s!r}; e.g. 60"
        )
    return depth, float(stop_timeout_s), check_nice(planner_nice)


def lower_thread_priority(nice: int) -> None:
    """Raise the calling thread's nice value by ``nice`` (Linux schedules threads as tasks; elsewhere, and for 0,
    nothing happens). A thread can lower its own priority without privileges, never raise it back."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + nice, 19))
    except OSError as e:  # e.g. a sandbox refusing setpriority: run at normal priority
        log.debug("could not lower the planner thread's priority: %s", e)


class ApplyProgress:
    """The no-stale-read rule between the training thread and the stager, in one object the loader owns.

    The stager gathers the rows of plan ``t`` only once plan ``t - prefetch_depth - 1`` is applied: its
    write-backs, which the gathered rows may depend on, have landed in the store. When that is known depends
    on the rank count, and only here:

    * one rank: once the training thread has applied the plan (:meth:`applied`);
    * several ranks: plan ``t - 1`` of *every* rank has landed once this rank begins step ``t``
      (:meth:`begin`), because step ``t - 1``'s backward collectives wait for every rank.

    Args:
        num_ranks: data-parallel ranks.

    Example:
        >>> one, two = ApplyProgress(1), ApplyProgress(2)
        >>> one.begin(4); one.applied(4); two.begin(4); two.applied(4)
        >>> one.last, two.last
        (4, 3)
    """

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._last = -1
        self._cond = threading.Condition()

    @property
    def last(self) -> int:
        """The last step whose write-backs are known to have landed (-1: none)."""
        return self._last

    def reset(self) -> None:
        """A new iteration: nothing applied yet."""
        with self._cond:
            self._last = -1

    def begin(self, step: int) -> None:
        """The training thread is about to apply plan ``step`` (before it waits for the staged rows)."""
        if self.num_ranks > 1:
            self._advance(step - 1)

    def applied(self, step: int) -> None:
        """The training thread has applied plan ``step``."""
        if self.num_ranks == 1:
            self._advance(step)

    def wait(self, step: int, stopped: Callable[[], bool]) -> None:
        """Block until plan ``step``'s write-backs have landed or ``stopped()`` (checked every 50 ms)."""
        with self._cond:
            while self._last < step and not stopped():
                self._cond.wait(timeout=0.05)

    def _advance(self, step: int) -> None:
        with self._cond:
            self._last = max(self._last, step)
            self._cond.notify_all()


@dataclass(frozen=True)
class LoaderStats:
    """Cumulative counters of a lookahead loader's threads (a snapshot: ``LookaheadLoader.stats()``); the
    difference of two snapshots is the work between them.

    Attributes:
        stager_wait_s: seconds the training thread waited for a step's staged rows (no stale read: the stager
            gathers rows only once the write-backs they depend on have landed).
        batch_wait_s: seconds the training thread waited for the planner's next batch (the planner was behind).
        planner_cpu_s: CPU seconds of the planner thread (gathering ids across ranks, planning, remapping).
        planned: batches planned.
        stager_cpu_s: CPU seconds of the stager thread (gathering rows).
        staged: plans whose rows the stager gathered.
        gathered_here: steps whose rows the training thread gathered itself (the stager had not started them).
        reader_cpu_s: CPU seconds of the reader thread (reading the wrapped loader's batches ahead of the
            planner).
        read: batches the reader thread read.

    Example:
        >>> later = LoaderStats(stager_wait_s=0.5, planned=5, staged=4, gathered_here=1)
        >>> d = later - LoaderStats(planned=2, staged=2)
        >>> d.planned, d.staged + d.gathered_here, d.stager_wait_s
        (3, 3, 0.5)
    """

    stager_wait_s: float = 0.0
    batch_wait_s: float = 0.0
    planner_cpu_s: float = 0.0
    planned: int = 0
    stager_cpu_s: float = 0.0
    staged: int = 0
    gathered_here: int = 0
    reader_cpu_s: float = 0.0
    read: int = 0

    # the fields' values in their order (``dataclasses.astuple`` deep-copies: the training thread adds its wait
    # every step)
    def __add__(self, other: LoaderStats) -> LoaderStats:
        return LoaderStats(*(a + b for a, b in zip(vars(self).values(), vars(other).values())))

    def __sub__(self, other: LoaderStats) -> LoaderStats:
        return LoaderStats(*(a - b for a, b in zip(vars(self).values(), vars(other).values())))


@dataclass(frozen=True)
class _ReadError:
    """What reading the wrapped loader raised, handed from the reader thread to the planner."""

    error: BaseException


class _Run:
    """The queues, stop flag and threads of one iteration of a :class:`LookaheadLoader`."""

    def __init__(self, queue_depth: int, join_timeout_s: float = 30.0) -> None:
        self.out: queue.Queue[Any] = queue.Queue(maxsize=queue_depth)
        self.to_stage: queue.Queue[Any] = queue.Queue()
        #: batches the reader thread read, not yet taken by the planner
        self.reads: queue.Queue[Any] = queue.Queue(maxsize=queue_depth)
        self.reader: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self.threads: List[threading.Thread] = []
        self.join_timeout_s = join_timeout_s
        #: the first error of the planner's or the stager's shutdown (its last collective was not joined by every
        #: rank)
        self.shutdown_error: Optional[BaseException] = None
        self._lock = threading.Lock()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def start(self, plan: Any, stage: Any, read: Optional[Any] = None) -> None:
        """Start the planner and stager threads, and the reader thread when ``read`` is given (first: the
        planner takes a reader that is not alive, with nothing read, for one that ended without handing over the
        loader's end; started after the planner, a reader a loaded machine had not run yet was taken for one)."""
        self.threads = []
        if read is not None:
            self.reader = threading.Thread(target=read, args=(self,), daemon=True, name="lookahead-reader")
            self.threads.append(self.reader)
        self.threads += [
            threading.Thread(target=plan, args=(self,), daemon=True, name="lookahead-oracle"),
            threading.Thread(target=stage, args=(self,), daemon=True, name="lookahead-stager"),
        ]
        for t in self.threads:
            t.start()

    def put(self, item: Any) -> bool:
        """Hand an item to the training thread; ``False`` once the run is stopped."""
        return self._put(self.out, item)

    def put_read(self, item: Any) -> bool:
        """Hand a batch the reader thread read (or its end, or its error) to the planner; ``False`` once the run
        is stopped."""
        return self._put(self.reads, item)

    def _put(self, into: queue.Queue[Any], item: Any) -> bool:
        while not self.stopped:
            try:
                into.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def read_ahead(self) -> Iterator[Any]:
        """The batches the reader thread put in :attr:`reads`, in order; raises what reading raised; ends at the
        loader's end or once the run is stopped."""
        while not self.stopped:
            try:
                item = self.reads.get(timeout=0.05)
            except queue.Empty:
                if self.reader is not None and not self.reader.is_alive() and self.reads.empty():
                    raise RuntimeError(
                        "the lookahead reader thread ended without handing over the loader's end"
                    ) from None
                continue
            if item is _END:
                return
            if isinstance(item, _ReadError):
                raise item.error
            yield item

    def get(self) -> Any:
        return self.out.get()

    def shutdown_failed(self, error: BaseException) -> None:
        """Record an error of a thread's shutdown (the first one is kept)."""
        with self._lock:
            if self.shutdown_error is None:
                self.shutdown_error = error

    def stop(self) -> Optional[BaseException]:
        """Stop and join the threads; returns the first shutdown error of the planner or the stager, if any.

        Under a ``KeyboardInterrupt`` (Ctrl-C) the reader thread, which a stop cannot interrupt inside the wrapped
        loader's ``next()``, is waited for :data:`INTERRUPT_JOIN_S` only: a daemon thread, it is left behind, in
        one line, and ends with the process."""
        self._stop.set()
        interrupted = _interrupted()
        for t in self.threads:
            if t is threading.current_thread():
                continue
            left = interrupted and t is self.reader
            t.join(timeout=min(self.join_timeout_s, INTERRUPT_JOIN_S) if left else self.join_timeout_s)
            if not t.is_alive():
                continue
            if left:
                log.warning(
                    "interrupted: the lookahead reader thread, blocked in the wrapped loader's next(), is left "
                    "behind (a daemon thread: it ends with the process)"
                )
            else:
                log.warning(
                    "lookahead thread %s did not stop within %g s (blocked in the wrapped loader?)",
                    t.name,
                    self.join_timeout_s,
                )
        return self.shutdown_error


#: how long the stop of an interrupted run waits for the reader thread (it is idle or inside the wrapped loader)
INTERRUPT_JOIN_S = 2.0


def _interrupted() -> bool:
    """Whether a ``KeyboardInterrupt`` is being handled on this thread (also as the context of the exception
    being handled: the ``GeneratorExit`` of a stream closed by an interrupted loop)."""
    error: Optional[BaseException] = sys.exc_info()[1]
    seen = 0
    while error is not None and seen < 16:
        if isinstance(error, KeyboardInterrupt):
            return True
        error, seen = error.__context__, seen + 1
    return False
