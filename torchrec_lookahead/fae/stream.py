"""FAE's input processor: a stream of TorchRec batches regrouped into all-hot and cold mini-batches.

A sample is *hot* when every id of every feature (every value of a multi-hot bag) is a hot row. The stream
reads source batches in order, splits each into its hot and cold samples, and queues them. Hot batch ``j`` is
the ``j``-th run of ``batch_size`` hot samples in stream order, cold batch ``j`` the ``j``-th run of cold
ones: the contents of each kind are fixed by the data alone, and only their interleaving is chosen at run
time (by :meth:`HotColdStream.request`, which the :class:`~torchrec_lookahead.fae.HotColdScheduler`
drives). The queue is bounded: the stream reads ahead only while fewer than ``window`` source batches' worth
of samples wait; when the requested kind cannot be completed within that bound, the other kind is served.
At the end of the epoch the leftover hot and cold samples (fewer than a batch of each; the hot leftover is the
last ``hot samples % batch_size`` hot samples) form one last cold batch, served when a cold batch is requested
after the source is read (or when nothing else is left), so every sample is trained exactly once per epoch.

With ``W`` ranks each rank reads its slice of every global source batch; the slices are all-gathered, so
every rank regroups the same global stream, takes the same decisions, and keeps its contiguous slice of each
regrouped global batch (``batch_size`` rows per rank).

The state that resumes an epoch mid-way is the number of hot and cold batches handed out: the queues are
order-preserving, so replaying the source from the epoch's start and skipping that many samples of each kind
rebuilds them exactly.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, List, Mapping, Optional

import torch
from torchrec.datasets.utils import Batch

from torchrec_lookahead.errors import CheckpointError, ConfigError, DataError
from torchrec_lookahead.fae.samples import Samples

__all__ = ["BatchKind", "HotColdStream", "count_hot_samples", "classify_epoch"]


class BatchKind(str, enum.Enum):
    """Which kind of mini-batch: every sample hot, or not."""

    HOT = "hot"
    COLD = "cold"


Gather = Callable[[Samples], Optional[Samples]]


def count_hot_samples(batches: Iterable[Batch], masks: Mapping[str, torch.Tensor]) -> tuple[int, int]:
    """(hot samples, all samples) of ``batches`` (FAE's one classification pass)."""
    hot, total, _ = _count(batches, masks)
    return hot, total


def _count(batches: Iterable[Batch], masks: Mapping[str, torch.Tensor]) -> tuple[int, int, int]:
    hot = total = largest = 0
    for b in batches:
        s = Samples.of(b)
        hot += int(s.hot(masks).sum())
        total += len(s)
        largest = max(largest, len(s))
    return hot, total, largest


def classify_epoch(batches: Iterable[Batch], masks: Mapping[str, torch.Tensor]) -> tuple[int, int, int]:
    """(hot samples, all samples, rows of the largest batch) of one rank's epoch."""
    return _count(batches, masks)


class _Queue:
    """Samples of one kind waiting, in stream order."""

    def __init__(self) -> None:
        self.parts: Deque[Samples] = deque()
        self.size = 0

    def push(self, s: Samples) -> None:
        if len(s):
            self.parts.append(s)
            self.size += len(s)

    def pop(self, n: int) -> Samples:
        taken: List[Samples] = []
        need = n
        while need:
            head = self.parts[0]
            if len(head) <= need:
                taken.append(self.parts.popleft())
                need -= len(head)
            else:
                taken.append(head.slice(0, need))
                self.parts[0] = head.slice(need, len(head))
                need = 0
        self.size -= n
        return Samples.cat(taken)

    def drop(self, n: int) -> None:
        if n:
            self.pop(n)


class _GathersOver(Exception):
    """The stream's gathers ended (a peer stopped): the iteration ends."""


class HotColdStream:
    """All-hot and cold mini-batches regrouped from a stream of batches.

    Args:
        source: called once per epoch, returns an iterator over this rank's source batches.
        masks: feature -> bool per row (hot or not), e.g. :meth:`~torchrec_lookahead.fae.HotSet.masks`.
        batch_size: rows per regrouped batch per rank.
        window: source batches of samples that may wait at most (>= 2).
        num_samples: samples per epoch (global) and hot ones, if known (gives ``len``).
        rank: this rank.
        world_size: ranks.
        gather: joins the ranks' slices of a source batch into the global batch (identity for one rank);
            ``None`` from it ends the iteration (the gathers are over: a peer stopped).
        count_accesses: keep exact per-row access counts of the epoch's global samples
            (:attr:`access_counts`, for ``recalibrate="epoch"``); the sizes come from ``masks``.

    Example:
        >>> from torchrec import KeyedJaggedTensor
        >>> def src():
        ...     for i in range(3):
        ...         kjt = KeyedJaggedTensor(["a"], torch.tensor([i, 2, 3, 0]), lengths=torch.ones(4, dtype=torch.int32))
        ...         yield Batch(torch.zeros(4, 1), kjt, torch.zeros(4))
        >>> s = HotColdStream(src, {"a": torch.tensor([True, True, False, False])}, batch_size=2, window=4)
        >>> [(k.value, b.sparse_features.values().tolist()) for k, b in s][:3]
        [('hot', [0, 0]), ('cold', [2, 3]), ('hot', [1, 0])]
    """

    def __init__(
        self,
        source: Callable[[], Iterator[Batch]],
        masks: Mapping[str, torch.Tensor],
        batch_size: int,
        window: int = 64,
        num_samples: Optional[tuple[int, int]] = None,
        rank: int = 0,
        world_size: int = 1,
        gather: Optional[Gather] = None,
        count_accesses: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"Expected batch_size to be a positive integer but got {batch_size}")
        if window < 2:
            raise ConfigError(f"Expected window >= 2 source batches but got {window}")
        if not (0 <= rank < world_size):
            raise ConfigError(f"Expected 0 <= rank < world_size but got rank={rank}, world_size={world_size}")
        if world_size > 1 and gather is None:
            raise ConfigError(
                "With several ranks the stream needs a gather function (all-gather of the slices)"
            )
        self.source = source
        self.masks = dict(masks)
        self.batch_size = batch_size
        self.window = window
        self.rank = rank
        self.world_size = world_size
        self.gather = gather
        self.num_samples = num_samples
        self.requested: Optional[BatchKind] = None
        self.served: Dict[BatchKind, int] = {BatchKind.HOT: 0, BatchKind.COLD: 0}
        self.last_kind: Optional[BatchKind] = None
        #: the global batch (every rank's rows) of the batch handed out last
        self.last_global: Optional[Samples] = None
        self._resume: Optional[Dict[BatchKind, int]] = None
        self.count_accesses = count_accesses
        #: with ``count_accesses``: feature -> accesses per row of the global samples read this epoch (a resumed
        #: epoch re-reads its prefix, so they cover the whole epoch all the same)
        self.access_counts: Dict[str, torch.Tensor] = {}
        #: with ``count_accesses``: global samples read this epoch
        self.samples_read = 0

    @property
    def global_batch_size(self) -> int:
        """Rows of one regrouped global batch."""
        return self.batch_size * self.world_size

    def batches_per_epoch(self) -> Dict[BatchKind, int]:
        """Full hot and cold batches per epoch, and whether a last (leftover) cold batch follows."""
        if self.num_samples is None:
            raise ConfigError("The stream's length is unknown: pass num_samples (count_hot_samples gives it)")
        hot, total = self.num_samples
        g = self.global_batch_size
        tail = 1 if (hot % g) + ((total - hot) % g) else 0
        return {BatchKind.HOT: hot // g, BatchKind.COLD: (total - hot) // g + tail}

    def __len__(self) -> int:
        return sum(self.batches_per_epoch().values())

    def request(self, kind: Optional[BatchKind]) -> None:
        """Ask for ``kind`` next (``None``: whichever completes first in stream order)."""
        self.requested = None if kind is None else BatchKind(kind)

    def remaining(self) -> Dict[BatchKind, int]:
        """Batches of each kind still to come this epoch (the leftover batch counts as cold)."""
        per = self.batches_per_epoch()
        return {k: per[k] - self.served[k] for k in per}

    def state_dict(self) -> Dict[str, int]:
        """Hot and cold batches handed out in the current epoch."""
        return {"hot_served": self.served[BatchKind.HOT], "cold_served": self.served[BatchKind.COLD]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next iteration resume after the batches already handed out."""
        if "hot_served" not in state or "cold_served" not in state:
            raise CheckpointError(
                f"the checkpoint's loader state {dict(state)} is not a hot/cold loader's (no 'hot_served' and "
                "'cold_served'): it was written by a run without HotColdDataModule; resume it with the config that "
                "wrote it, or start a new FAE run from its weights"
            )
        self._resume = {BatchKind.HOT: int(state["hot_served"]), BatchKind.COLD: int(state["cold_served"])}

    def epoch_complete(self) -> bool:
        """Every batch of the epoch has been handed out (so every sample has been read)."""
        return self.num_samples is not None and not any(self.remaining().values())

    def _count(self, s: Samples) -> None:
        for k, v in zip(s.keys, s.values):
            # O(ids), not O(rows) as a bincount into the whole table would be
            self.access_counts[k].index_add_(0, v, torch.ones_like(v))
        self.samples_read += len(s)

    def _mine(self, s: Samples) -> Samples:
        if self.world_size == 1:
            return s
        n = len(s)
        base, extra = divmod(n, self.world_size)
        lo = self.rank * base + min(self.rank, extra)
        return s.slice(lo, lo + base + (1 if self.rank < extra else 0))

    def __iter__(self) -> Iterator[tuple[BatchKind, Batch]]:
        return self.iterate()

    def iterate(
        self, source: Optional[Callable[[], Iterator[Batch]]] = None
    ) -> Iterator[tuple[BatchKind, Batch]]:
        """One epoch, as ``iter(stream)``, reading ``source`` (the same batches as the stream's own, e.g. a reader
        of a :class:`~torchrec_lookahead.fae.shared_read.SharedRead`) instead of the stream's ``source``."""
        try:
            yield from self._iter(source or self.source)
        except _GathersOver:
            return

    def _iter(self, source: Callable[[], Iterator[Batch]]) -> Iterator[tuple[BatchKind, Batch]]:
        g = self.global_batch_size
        skip = self._resume or {BatchKind.HOT: 0, BatchKind.COLD: 0}
        self._resume = None
        self.served = {BatchKind.HOT: 0, BatchKind.COLD: 0}
        queues = {BatchKind.HOT: _Queue(), BatchKind.COLD: _Queue()}
        to_skip = {k: skip[k] * g for k in skip}
        if self.count_accesses:
            self.access_counts = {f: torch.zeros(m.numel(), dtype=torch.int64) for f, m in self.masks.items()}
            self.samples_read = 0
        it = source()
        exhausted = False
        source_rows = 0

        def read() -> bool:
            nonlocal exhausted, source_rows
            try:
                b = next(it)
            except StopIteration:
                exhausted = True
                return False
            s = Samples.of(b)
            if self.gather is not None and self.world_size > 1:
                joined = self.gather(s)
                if joined is None:
                    raise _GathersOver
                s = joined
            source_rows = max(source_rows, len(s))
            hot = s.hot(self.masks)  # checks the features against the hot set first
            if self.count_accesses:
                self._count(s)
            for kind, part in ((BatchKind.HOT, s.select(hot)), (BatchKind.COLD, s.select(~hot))):
                queues[kind].push(part)
                drop = min(to_skip[kind], queues[kind].size)
                queues[kind].drop(drop)
                to_skip[kind] -= drop
            return True

        # The last (leftover) cold batch was served before the hot batches ran out: it took every cold sample
        # and the epoch's last ``hot % g`` hot samples, which are known only once the source is read.
        tail = (
            self.num_samples is not None
            and skip[BatchKind.COLD] > (self.num_samples[1] - self.num_samples[0]) // g
        )
        if tail and self.num_samples is not None:
            to_skip[BatchKind.COLD] = self.num_samples[1] - self.num_samples[0]
        while any(to_skip.values()) or (tail and not exhausted):
            if not read() and any(to_skip.values()):
                raise CheckpointError(
                    f"Cannot resume the hot/cold stream: the epoch has fewer than the {skip[BatchKind.HOT]} hot "
                    f"and {skip[BatchKind.COLD]} cold batches already trained; was the data changed?"
                )
        if tail and self.num_samples is not None:
            hot_q = queues[BatchKind.HOT]
            keep = max(hot_q.size - self.num_samples[0] % g, 0)
            if hot_q.size:
                hot_q.push(hot_q.pop(hot_q.size).slice(0, keep))
        self.served = dict(skip)
        while True:
            want = self.requested
            order = [want, BatchKind.COLD if want is BatchKind.HOT else BatchKind.HOT] if want else []
            while not exhausted:
                if want is not None and queues[want].size >= g:
                    break
                if want is None and any(q.size >= g for q in queues.values()):
                    break
                waiting = queues[BatchKind.HOT].size + queues[BatchKind.COLD].size
                if source_rows and waiting >= self.window * source_rows:
                    break
                read()
            if want is None:
                ready = [k for k, q in queues.items() if q.size >= g]
                order = sorted(ready, key=lambda k: -queues[k].size)
            kind = next((k for k in order if queues[k].size >= g), None)
            hot_rest = queues[BatchKind.HOT].size % g
            if exhausted and want is BatchKind.COLD and queues[BatchKind.COLD].size < g:
                if queues[BatchKind.COLD].size + hot_rest:
                    kind = None  # the last cold batch now: its samples are known once the source is read
            if kind is not None:
                out = queues[kind].pop(g)
            else:
                if not exhausted:
                    raise DataError(  # unreachable with window >= 2: a full queue holds a batch of one kind
                        f"The hot/cold window of {self.window} source batches holds no full batch"
                    )
                hot = queues[BatchKind.HOT]
                whole = hot.pop(hot.size) if hot.size else None
                rest = (
                    [queues[BatchKind.COLD].pop(queues[BatchKind.COLD].size)]
                    if queues[BatchKind.COLD].size
                    else []
                )
                if whole is not None:  # full hot batches stay queued; the leftover (the last samples) joins
                    hot.push(whole.slice(0, len(whole) - hot_rest))
                    if hot_rest:
                        rest.append(whole.slice(len(whole) - hot_rest, len(whole)))
                if not rest:
                    return
                out, kind = Samples.cat(rest), BatchKind.COLD
            if kind is BatchKind.COLD and len(out) < g and len(out) < self.world_size:
                raise DataError(
                    f"The epoch's last batch has {len(out)} samples, fewer than the {self.world_size} ranks; "
                    "change the batch size or the number of batches so that every rank gets a sample"
                )
            self.served[kind] += 1
            self.last_kind = kind
            self.last_global = out
            yield kind, self._mine(out).batch()
