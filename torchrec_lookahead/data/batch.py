"""The batch the lookahead loader yields (:class:`LookaheadBatch`) and what it knows of the model's cached
tables (:class:`CacheTarget`).

Example:
    >>> from torchrec_lookahead.store import TensorStore
    >>> target = CacheTarget({"t": 8}, {"f": "t"}, {"t": 100}, {"t": TensorStore(100, 4, {}, name="t", seed=0)})
    >>> target.num_ranks, sorted(target.capacity)
    (1, ['t'])
"""

from __future__ import annotations

from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence

import torch
from torchrec.datasets.utils import Batch

from torchrec_lookahead.distributed.sharded import ShardedLookaheadEmbeddingBagCollection
from torchrec_lookahead.errors import ConfigError, SetupError
from torchrec_lookahead.modules.types import StagedRows
from torchrec_lookahead.oracle.types import BatchPlan
from torchrec_lookahead.store.types import EmbeddingStore

if TYPE_CHECKING:
    from torchrec_lookahead.data.adapter import BatchAdapter
    from torchrec_lookahead.data.lookahead_loader import LookaheadLoader

__all__ = ["LookaheadBatch", "CacheTarget", "cached_modules", "reset_caches"]


def cached_modules(model: torch.nn.Module) -> List[ShardedLookaheadEmbeddingBagCollection]:
    """The collections of ``model`` (a ``DistributedModelParallel`` model, or any module holding one) with
    cached tables, in module order."""
    return [m for m in model.modules() if isinstance(m, ShardedLookaheadEmbeddingBagCollection)]


def reset_caches(modules: Sequence[ShardedLookaheadEmbeddingBagCollection]) -> None:
    """Flush, then empty the caches of ``modules`` (a new plan stream starts from an empty cache)."""
    for m in modules:
        m.flush()
        m.invalidate()


@dataclass
class LookaheadBatch(Batch):
    """A TorchRec batch whose cached features hold cache slots, with the step's plan and staged rows.

    Attributes:
        plan: the step's plan (apply before the step).
        staged: future of the rows the plan fetches (gathered in the background).
        loader: the loader that produced the batch (told when the plan has been applied); ``None`` for a
            hot batch of pinned rows, which moves nothing.
        lrpp: with several ranks, the step's synchronisation plan.
        pin: a plan to apply before ``plan``, on an empty cache: it loads the pinned hot rows (first batch of
            a plan stream with pinned rows, see :class:`~torchrec_lookahead.hotcold.PinnedRows`).
        source: the user's own batch this one was read from through ``adapter`` (``None`` for a TorchRec
            ``Batch``); the model trains on :meth:`user_batch`.
        adapter: the :class:`~torchrec_lookahead.data.BatchAdapter` that read ``source``.
    """

    plan: Optional[BatchPlan] = None
    staged: Optional[Future[StagedRows]] = None
    loader: Optional[LookaheadLoader] = field(default=None, repr=False)
    lrpp: Optional[Any] = None
    pin: Optional[BatchPlan] = None
    source: Optional[Any] = field(default=None, repr=False)
    adapter: Optional[BatchAdapter] = field(default=None, repr=False)

    def user_batch(self) -> Any:
        """What the model's ``training_step`` receives: the user's own batch with its KJT replaced by this
        batch's (cache slots for the cached tables), or this batch itself when it was a TorchRec ``Batch``."""
        if self.source is None or self.adapter is None:
            return self
        _, old, _ = self.adapter.split(self.source)
        return self.adapter.with_sparse(self.source, old, self.sparse_features)

    def to(self, device: torch.device, non_blocking: bool = False) -> LookaheadBatch:
        return LookaheadBatch(
            dense_features=self.dense_features.to(device=device, non_blocking=non_blocking),
            sparse_features=self.sparse_features.to(device=device, non_blocking=non_blocking),
            labels=self.labels.to(device=device, non_blocking=non_blocking),
            plan=self.plan,
            staged=self.staged,
            loader=self.loader,
            lrpp=self.lrpp,
            pin=self.pin,
            source=self.source,
            adapter=self.adapter,
        )

    def wait_staged(self) -> Optional[StagedRows]:
        """The staged rows (blocks until the stager has gathered them); the wait is counted by the loader.

        Raises:
            SetupError: the loader was stopped before the rows were gathered (the batch is from a finished
                iteration).
        """
        if self.staged is None:
            return None
        if self.loader is not None:
            return self.loader.staged_rows(self.plan, self.staged)
        return staged_result(self.plan, self.staged)

    def mark_started(self) -> None:
        """Call before waiting for the staged rows (the loader's
        :meth:`~torchrec_lookahead.data._threads.ApplyProgress.begin`)."""
        if self.loader is not None and self.plan is not None:
            self.loader.progress.begin(self.plan.step)

    def mark_applied(self) -> None:
        """Call after applying the plan (the loader's
        :meth:`~torchrec_lookahead.data._threads.ApplyProgress.applied`)."""
        if self.loader is not None and self.plan is not None:
            self.loader.progress.applied(self.plan.step)

    def apply_to(self, modules: Sequence[ShardedLookaheadEmbeddingBagCollection]) -> None:
        """Bring the caches of ``modules`` to this batch's plan; call right before the batch's training step,
        after the previous step's optimizer update (no stale read: the plan writes back the rows it evicts,
        with their updates, and loads the rows it fetches, gathered only after every write-back they depend
        on). Pinned hot rows (``pin``) are loaded first, into the caches the loader's epoch start emptied."""
        if self.pin is not None:
            for m in modules:
                m.pin_rows(self.pin)
        if self.plan is None:
            return
        self.mark_started()
        staged = self.wait_staged()
        for m in modules:
            # Plans from the lookahead loader's own oracle: the O(capacity) re-checks are skipped.
            m.apply_plan(self.plan, staged, self.lrpp, trusted=True)
        self.mark_applied()


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


@dataclass(frozen=True)
class CacheTarget:
    """What the oracle and stager need to know about the model's cached tables.

    Attributes:
        capacity: cache rows per cached table.
        feature_to_table: feature -> table, for every cached table's features.
        num_embeddings: rows per cached table.
        stores: host store per cached table.
        num_ranks: data-parallel ranks (LRPP when > 1: every rank plans the global batch).
        rank: this rank.
        group: process group on which the planner thread gathers the other ranks' ids.
        average_every: cDLRM mode's averaging period λ (``None``: exact LRPP).
    """

    capacity: Mapping[str, int]
    feature_to_table: Mapping[str, str]
    num_embeddings: Mapping[str, int]
    stores: Mapping[str, EmbeddingStore]
    num_ranks: int = 1
    rank: int = 0
    group: Optional[Any] = None
    average_every: Optional[int] = None

    @classmethod
    def from_modules(
        cls,
        modules: Sequence[ShardedLookaheadEmbeddingBagCollection],
        num_ranks: int = 1,
        rank: int = 0,
        group: Optional[Any] = None,
    ) -> CacheTarget:
        """The cached tables of ``modules`` (see :func:`cached_modules`), planned on ``num_ranks`` ranks.

        Raises:
            ConfigError: two cached collections share a table or feature name.
        """
        capacity: Dict[str, int] = {}
        f2t: Dict[str, str] = {}
        rows: Dict[str, int] = {}
        stores: Dict[str, Any] = {}
        for m in modules:
            cache = m.cache
            clash = sorted(set(capacity) & set(cache.capacity))
            clash += sorted(
                f for f in cache.feature_to_table if f in f2t and f2t[f] != cache.feature_to_table[f]
            )
            if clash:
                raise ConfigError(
                    f"Two cached collections share table or feature names {clash}; give every cached table and "
                    "feature a unique name"
                )
            capacity.update(cache.capacity)
            stores.update(cache.stores)
            f2t.update({f: t for f, t in cache.feature_to_table.items() if t in cache.capacity})
            rows.update(
                {c.name: c.num_embeddings for c in cache.embedding_bag_configs() if c.name in cache.capacity}
            )
        return cls(
            capacity=capacity,
            feature_to_table=f2t,
            num_embeddings=rows,
            stores=stores,
            num_ranks=num_ranks,
            rank=rank,
            group=group,
            average_every=next((m.average_every for m in modules if m.average_every is not None), None),
        )
