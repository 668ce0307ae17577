"""The runtime's contracts with what plugs into it: rows pinned in the caches (FAE's hot rows,
:class:`PinnedPart`)."""

from __future__ import annotations

from typing import Dict, Protocol, runtime_checkable

from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.oracle.types import BatchPlan

__all__ = ["PinnedPart"]


@runtime_checkable
class PinnedPart(Protocol):
    """Rows pinned in the first slots of the caches for a whole plan stream (FAE's hot rows, implemented by
    :class:`~torchrec_lookahead.hotcold.PinnedRows`): the oracle plans the rest of each cache, over the part of
    each batch that reads no pinned row, and its plans are lifted to the whole cache."""

    @property
    def pinned_rows(self) -> Dict[str, int]:
        """Pinned rows (the first slots) per cached table."""
        ...

    def dynamic_capacity(self) -> Dict[str, int]:
        """Cache slots per table left to the oracle."""
        ...

    def cold_part(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """``kjt`` without its pinned ids: what the oracle plans."""
        ...

    def lift(self, plan: BatchPlan, kjt: KeyedJaggedTensor) -> BatchPlan:
        """``plan`` (over the dynamic slots, for ``cold_part(kjt)``) as a plan of the whole cache for ``kjt``."""
        ...
