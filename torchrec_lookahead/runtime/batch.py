"""The batch the lookahead loader yields: a TorchRec ``Batch`` whose cached features hold cache slots, with its
step's plan (:class:`LookaheadBatch`). It is a value: it knows nothing of the loader that planned it, and the
:class:`~torchrec_lookahead.runtime.CacheSession` that applies it is the one that attached that loader.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Tuple

import torch
from torchrec.datasets.utils import Batch

from torchrec_lookahead.distributed.lrpp import LRPPPlan
from torchrec_lookahead.errors import SetupError
from torchrec_lookahead.modules import PreparedPlan
from torchrec_lookahead.modules.types import StagedRows
from torchrec_lookahead.oracle.types import BatchPlan

if TYPE_CHECKING:
    from torchrec_lookahead.runtime.adapter import BatchAdapter

__all__ = ["LookaheadBatch", "staged_result"]


@dataclass
class LookaheadBatch(Batch):
    """A TorchRec batch whose cached features hold cache slots, with the step's plan and staged rows.

    It is a ``Batch`` (TorchRec's train pipelines and the user's ``training_step`` read it as one) and it is
    immutable once built: :func:`dataclasses.replace` makes a changed copy.

    Attributes:
        plan: the step's plan (applied by :meth:`CacheSession.apply
            <torchrec_lookahead.runtime.CacheSession.apply>` before the step).
        staged: future of the rows the plan fetches (gathered by the planning loader's stager); ``None`` for a
            batch of pinned (hot) rows, which moves nothing.
        lrpp: with several ranks, the step's synchronisation plan.
        pin: a plan to apply before ``plan``, on an empty cache: it loads the pinned hot rows (first batch of
            a plan stream with pinned rows, see :class:`~torchrec_lookahead.fae.PinnedRows`).
        source: the user's own batch this one was read from through ``adapter`` (``None`` for a TorchRec
            ``Batch``); the model trains on :meth:`user_batch`.
        adapter: the :class:`~torchrec_lookahead.runtime.BatchAdapter` that read ``source``.
        prepared: ``plan`` as each cached collection of the session applies it (one move per slot space, with
            the step's counts), built on the planner thread; ``None``: the collections build it themselves.

    Example:
        >>> from torchrec import KeyedJaggedTensor
        >>> kjt = KeyedJaggedTensor(["f"], torch.tensor([0, 1]), lengths=torch.tensor([1, 1]))
        >>> b = LookaheadBatch(torch.zeros(2, 1), kjt, torch.zeros(2))
        >>> b.plan = None
        Traceback (most recent call last):
        ...
        dataclasses.FrozenInstanceError: cannot assign to field 'plan'
    """

    plan: Optional[BatchPlan] = None
    staged: Optional[Future[StagedRows]] = field(default=None, repr=False)
    lrpp: Optional[LRPPPlan] = field(default=None, repr=False)
    pin: Optional[BatchPlan] = field(default=None, repr=False)
    source: Optional[Any] = field(default=None, repr=False)
    adapter: Optional[BatchAdapter] = field(default=None, repr=False)
    prepared: Optional[Tuple[PreparedPlan, ...]] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_built", True)

    def __setattr__(self, name: str, value: Any) -> None:
        # TorchRec's Batch is a mutable dataclass, so a subclass cannot be declared frozen: refuse instead.
        if getattr(self, "_built", False):
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")
        object.__setattr__(self, name, value)

    def user_batch(self) -> Any:
        """What the model's ``training_step`` receives: the user's own batch with its KJT replaced by this
        batch's (cache slots for the cached tables), or this batch itself when it was a TorchRec ``Batch``."""
        if self.source is None or self.adapter is None:
            return self
        _, old, _ = self.adapter.split(self.source)
        return self.adapter.with_sparse(self.source, old, self.sparse_features)

    def to(self, device: torch.device, non_blocking: Optional[bool] = None) -> LookaheadBatch:
        """This batch on ``device``; ``non_blocking=None``: without waiting for the copies when the batch is in
        pinned memory (the planning loader pins it for a CUDA cache), as Lightning moves it."""
        if non_blocking is None:
            non_blocking = self.dense_features.is_pinned()
        return LookaheadBatch(
            self.dense_features.to(device=device, non_blocking=non_blocking),
            self.sparse_features.to(device=device, non_blocking=non_blocking),
            self.labels.to(device=device, non_blocking=non_blocking),
            plan=self.plan,
            staged=self.staged,
            lrpp=self.lrpp,
            pin=self.pin,
            source=self.source,
            adapter=self.adapter,
            prepared=self.prepared,
        )


def staged_result(plan: Optional[BatchPlan], staged: Future[StagedRows]) -> StagedRows:
    """The rows ``staged`` holds (blocks until the stager has gathered them).

    Raises:
        SetupError: the future was cancelled (the loader was stopped before the rows were gathered).
    """
    try:
        return staged.result()
    except CancelledError:
        raise SetupError(
            f"the staged rows of step {plan.step if plan else '?'} were cancelled: the lookahead "
            "loader that produced this batch has been stopped"
        ) from None
