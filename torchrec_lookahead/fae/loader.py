"""The training loader of a :class:`~torchrec_lookahead.fae.HotColdDataModule`: FAE's all-hot and cold
mini-batches of a :class:`~torchrec_lookahead.fae.stream.HotColdStream`, steered by the
:class:`~torchrec_lookahead.fae.HotColdScheduler`."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, Mapping, Optional

from torchrec.datasets.utils import Batch

from torchrec_lookahead.fae.stream import BatchKind, HotColdStream

__all__ = ["HotColdLoader"]


class HotColdLoader:
    """The training loader of a :class:`HotColdDataModule`: all-hot and cold batches of a
    :class:`~torchrec_lookahead.fae.stream.HotColdStream`, with ``len``, exact mid-epoch resume
    (``state_dict``) and :meth:`request` for the scheduler.

    Args:
        stream: the regrouped stream.
        on_epoch_end: called with the stream when the epoch's last batch is about to be handed out (every
            sample read): ``recalibrate="epoch"`` computes the next epoch's hot set there, so that a checkpoint
            taken after that batch holds it.
    """

    def __init__(
        self, stream: HotColdStream, on_epoch_end: Optional[Callable[[HotColdStream], None]] = None
    ) -> None:
        self.stream = stream
        self.on_epoch_end = on_epoch_end

    def __len__(self) -> int:
        return len(self.stream)

    def kinds(
        self, source: Optional[Callable[[], Iterator[Batch]]] = None
    ) -> Iterator[tuple[BatchKind, Batch]]:
        """The epoch's batches with their kinds (what :meth:`__iter__` yields, with the kind); ``source`` as in
        :meth:`HotColdStream.iterate`."""
        for kind, batch in self.stream.iterate(source):
            if self.on_epoch_end is not None and self.stream.epoch_complete():
                self.on_epoch_end(self.stream)
            yield kind, batch

    def __iter__(self) -> Iterator[Batch]:
        for _, batch in self.kinds():
            yield batch

    def request(self, kind: Optional[BatchKind]) -> None:
        """Serve ``kind`` next when the window allows (``None``: stream order)."""
        self.stream.request(kind)

    @property
    def last_kind(self) -> Optional[BatchKind]:
        """The kind of the batch handed out last."""
        return self.stream.last_kind

    def remaining(self) -> Dict[BatchKind, int]:
        """Batches of each kind still to come this epoch."""
        return self.stream.remaining()

    def batches_per_epoch(self) -> Dict[BatchKind, int]:
        """Hot and cold batches per epoch."""
        return self.stream.batches_per_epoch()

    def state_dict(self) -> Dict[str, int]:
        if self.on_epoch_end is not None and self.stream.epoch_complete():
            # The next hot set is known (the DataModule's state holds it): the next iteration is a new epoch
            # under it, from its start; the counts of this epoch's hot set would not fit its batches.
            return {"hot_served": 0, "cold_served": 0}
        return self.stream.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.stream.load_state_dict(state_dict)
