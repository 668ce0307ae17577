"""``LookaheadDataModule``: wraps any DataModule of TorchRec batches and plans the cache ahead of training.

Its training loader is a :class:`~torchrec_lookahead.runtime.LookaheadLoader` (planner and stager threads,
see :mod:`torchrec_lookahead.runtime.loader`) built on the strategy's
:class:`~torchrec_lookahead.runtime.CacheSession` (the session applies its batches), checked against the caches
first (``capacity_check``); validation and test loaders are the wrapped DataModule's own: evaluation reads ids,
not slots.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from torchrec_lookahead.data.rank_split import split_for_ranks
from torchrec_lookahead.data.wrapper import (
    PLANNED_BATCH_HOOKS,
    WrappedDataModule,
    innermost_datamodule,
    overridden_batch_hooks,
)
from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.oracle import LookaheadSettings, Policy
from torchrec_lookahead.oracle.config import DEFAULT_HORIZON, DEFAULT_PREFETCH_DEPTH
from torchrec_lookahead.runtime import (
    CacheHost,
    CacheSession,
    CapacityCheck,
    LookaheadLoader,
    check_loader_options,
    prescan,
)
from torchrec_lookahead.runtime.adapter import BatchAdapter
from torchrec_lookahead.runtime.capacity import DEFAULT_SCAN_SECONDS, check_scan_bounds
from torchrec_lookahead.runtime.report import need_lines, report_text, scan_progress, sigterm_pending
from torchrec_lookahead.runtime.types import (
    CachedTrainingLoader,
    PinnedLoaderOptions,
    PinnedPart,
    PinnedRowsSource,
)

__all__ = ["LookaheadDataModule", "batch_adapter_of"]


def check_cdlrm_schedule(policy: str, window: int, average_every: Optional[int]) -> None:
    """cDLRM mode writes back rank 0's copy of an evicted row, which holds every rank's updates only right
    after an averaging: evictions must happen at averaging steps. The ``window`` policy evicts only at window
    starts, so its window must be a multiple of λ (any policy will do with λ = 1).

    Raises:
        ConfigError: the plan stream can evict between two averagings (other ranks' updates would be lost).
    """
    if average_every is None or average_every <= 1:
        return
    if policy != Policy.WINDOW.value or window % average_every != 0:
        raise ConfigError(
            f"cDLRM mode (cdlrm_average_every={average_every}) needs evictions only at averaging steps: use "
            f"LookaheadDataModule(policy='window', window=k*{average_every}) (got policy={policy!r}, window="
            f"{window}), or cdlrm_average_every=1; otherwise rows evicted between averagings would lose the "
            "other ranks' updates"
        )


class LookaheadDataModule(WrappedDataModule):
    """Wrap a DataModule of TorchRec batches so that the model's cached tables are planned ahead.

    Args:
        datamodule: any DataModule whose loaders yield :class:`~torchrec.datasets.utils.Batch` es.
        horizon: batches the oracle reads ahead (default
            :data:`~torchrec_lookahead.oracle.DEFAULT_HORIZON`, the horizon the budget planner sizes caches for
            unless told otherwise).
        prefetch_depth: steps ahead the fetched rows are gathered (must not exceed ``horizon``).
        policy: a :class:`~torchrec_lookahead.oracle.Policy` or its value: ``belady`` (default), ``ttl``,
            ``window`` or ``lru``.
        queue_depth: planned batches kept ready.
        window: batches per window of the ``window`` policy.
        ways: associativity of the ``window`` policy.
        capacity_check: a :class:`~torchrec_lookahead.runtime.CapacityCheck` or its value. ``"epoch"``
            (default): before training, read the epoch's sparse features, up to ``capacity_check_batches``
            batches and ``capacity_check_seconds`` seconds, and
            raise :class:`~torchrec_lookahead.errors.CapacityError` / :class:`~torchrec_lookahead.errors.InvalidIdError`
            if a window read does not fit its cache or an id is out of range (torch's, numpy's and Python's
            random states are restored, so a shuffling loader keeps its order); the windows beyond the bound
            are checked as with ``"lookahead"``. ``"lookahead"``: no pre-scan; such errors surface when the
            oracle (``horizon`` batches ahead of training) reaches the window, before it is trained but possibly
            mid-epoch, after a flush. Loaders without ``len()`` and the ``window`` policy (set-associative: its
            own placement rules) are planned with ``"lookahead"``.
        capacity_check_batches: the most batches the ``"epoch"`` pre-scan reads (an int >= 1; ``None``, the
            default: no bound in batches). With several ranks, rank 0's bound holds on every rank.
        capacity_check_seconds: the pre-scan reads no further batch once this many seconds have passed (a number
            > 0; default 20, so that a large epoch starts training within a minute; ``None``: no time bound,
            the whole epoch unless ``capacity_check_batches``). With several ranks, rank 0's clock decides
            for every rank.
        stop_timeout_s: with several ranks, how long a rank that stopped training waits for the others to join
            the planner's last id all-gather (and the stager's last row gather over row-sharded stores) before
            it gives up with a typed error (a peer failed).
        planner_nice: how much lower the reader and planner threads run than training (Linux nice value, 0 to
            19; default 19, 0 leaves them alone). They read and plan batches ahead, so they only have to keep
            up on average; at lower priority it takes the CPU time training leaves, instead of preempting
            the training thread or its OpenMP workers in the middle of a parallel operator (measured in
            ``docs/benchmarks.md``).
        batch_adapter: how to read the wrapped DataModule's training batches when they are not TorchRec
            ``Batch`` es (a dict per batch, usual for two-tower models): a
            :class:`~torchrec_lookahead.runtime.DictBatchAdapter` or a :class:`~torchrec_lookahead.runtime.BatchAdapter`
            around a function from the batch to ``(dense features, KJT, labels)``. The model's ``training_step``
            still receives its own batch type, with the cached tables' ids replaced by cache slots. Without
            one, such batches are refused with a :class:`~torchrec_lookahead.errors.DataError` saying what to pass.

    Example:
        >>> from torchrec_lookahead.data import CriteoSyntheticDataModule
        >>> dm = LookaheadDataModule(CriteoSyntheticDataModule(batch_size=8, num_train_batches=2), horizon=16)
        >>> dm.num_dense_features
        13
    """

    def __init__(
        self,
        datamodule: pl.LightningDataModule,
        horizon: int = DEFAULT_HORIZON,
        prefetch_depth: int = DEFAULT_PREFETCH_DEPTH,
        policy: Union[Policy, str] = Policy.BELADY,
        queue_depth: int = 8,
        window: Optional[int] = None,
        ways: Optional[int] = None,
        capacity_check: str = "epoch",
        capacity_check_batches: Optional[int] = None,
        capacity_check_seconds: Optional[float] = DEFAULT_SCAN_SECONDS,
        stop_timeout_s: float = 60.0,
        planner_nice: int = 19,
        batch_adapter: Optional[BatchAdapter] = None,
    ) -> None:
        super().__init__(datamodule)
        if isinstance(datamodule, LookaheadDataModule):
            raise ConfigError(
                "datamodule is a LookaheadDataModule already: wrap the user's DataModule once (the outer one would "
                "plan batches whose cached ids the inner one has made cache slots)"
            )
        hooks = overridden_batch_hooks(
            innermost_datamodule(datamodule), pl.LightningDataModule, PLANNED_BATCH_HOOKS
        )
        if hooks:
            raise ConfigError(
                f"{type(innermost_datamodule(datamodule)).__name__} overrides {hooks}: the lookahead cache plans the "
                "batches its train_dataloader yields, and a hook that changed them after would train other ids "
                "than the planned ones (they are cache slots by then); move what the hook does into the dataset "
                "or the loader's collate_fn"
            )
        if batch_adapter is not None and not isinstance(batch_adapter, BatchAdapter):
            raise ConfigError(
                f"Expected batch_adapter to be a torchrec_lookahead.runtime.BatchAdapter (or DictBatchAdapter) but got "
                f"{type(batch_adapter).__name__}; wrap a function as "
                "BatchAdapter(split=<batch -> (dense, KJT, labels)>)"
            )
        self.batch_adapter = batch_adapter
        self.queue_depth, self.stop_timeout_s, self.planner_nice = check_loader_options(
            queue_depth, stop_timeout_s, planner_nice
        )
        if capacity_check not in (CapacityCheck.EPOCH, CapacityCheck.LOOKAHEAD):
            raise ConfigError(f"Expected capacity_check 'epoch' or 'lookahead' but got {capacity_check!r}")
        #: the most batches the ``"epoch"`` pre-scan reads, and its time bound in seconds (``None``: no bound)
        self.capacity_check_batches, self.capacity_check_seconds = check_scan_bounds(
            capacity_check_batches, capacity_check_seconds
        )
        #: the oracle's horizon, prefetch depth and policy, validated once (the loader plans with them)
        self.settings = LookaheadSettings(horizon, prefetch_depth, policy, window, ways)
        self.capacity_check = CapacityCheck(capacity_check)
        #: the training loader: a LookaheadLoader, or FAE's loader of pinned rows around one
        self.loader: Optional[CachedTrainingLoader] = None

    @property
    def horizon(self) -> int:
        """Batches the oracle reads ahead (:attr:`settings`)."""
        return self.settings.horizon

    @property
    def prefetch_depth(self) -> int:
        """Steps ahead the fetched rows are gathered (:attr:`settings`)."""
        return self.settings.prefetch_depth

    @property
    def policy(self) -> Policy:
        """The oracle's policy (:attr:`settings`)."""
        return Policy(self.settings.policy)

    @override
    def teardown(self, stage: str) -> None:
        if self.loader is not None:
            self.loader.close()
        super().teardown(stage)

    def _session(self) -> Optional[CacheSession]:
        """The strategy's cache session (``None`` without a strategy that holds one, or no cached table)."""
        strategy = self.trainer.strategy if self.trainer is not None else None
        return strategy.cache_session() if isinstance(strategy, CacheHost) else None

    @override
    def train_dataloader(self) -> Any:
        inner = self.datamodule.train_dataloader()
        session = self._session()
        if session is None or not session.target.capacity:
            rank_zero_warn(
                "LookaheadDataModule: the model has no cached tables; batches pass through unplanned"
            )
            return inner
        if isinstance(inner, (list, tuple, dict)):
            raise ConfigError(
                f"{type(self.datamodule).__name__}.train_dataloader() returns a {type(inner).__name__} of "
                f"{len(inner)} loaders: the lookahead cache plans one training stream; return one loader (over a "
                "ConcatDataset of their datasets, say)"
            )
        target = session.target
        if isinstance(self.datamodule, PinnedRowsSource):
            return self._pinned_loader(self.datamodule, inner, session)
        if self.trainer is not None:
            inner = split_for_ranks(self.trainer, inner)
        check_cdlrm_schedule(self.policy.value, self.settings.window_length, target.average_every)
        if self.loader is not None:  # a reload: the previous loader's threads must not outlive it
            self.loader.close()
        self.loader = self._lookahead(inner, session)
        self.loader.expected_batches = self._check_epoch(inner, session, self.loader.oracle_fields)
        return self.loader

    def _lookahead(
        self, inner: Any, session: CacheSession, pinned: Optional[PinnedPart] = None
    ) -> LookaheadLoader:
        return LookaheadLoader(
            inner,
            session,
            self.settings,
            self.queue_depth,
            stop_timeout_s=self.stop_timeout_s,
            planner_nice=self.planner_nice,
            pinned=pinned,
            batch_adapter=self.batch_adapter,
        )

    def _pinned_loader(self, source: PinnedRowsSource, inner: Any, session: CacheSession) -> Any:
        """Rows pinned in the caches (FAE's hot rows): the wrapped DataModule builds the loader on plan streams
        of this DataModule's settings, after its previous loader is closed."""
        if self.loader is not None:  # a reload: the previous loader's threads must not outlive it
            self.loader.close()
        options = PinnedLoaderOptions(
            self.policy,
            self.prefetch_depth,
            self.capacity_check,
            self.batch_adapter,
            self.trainer,
            self.capacity_check_batches,
            self.capacity_check_seconds,
            self.settings,
        )
        self.loader = source.pinned_loader(inner, session, self._lookahead, options)
        return self.loader

    def _check_epoch(self, inner: Any, session: CacheSession, oracle_fields: Dict[str, Any]) -> Optional[int]:
        """``capacity_check="epoch"``: fail before training if a window of the epoch does not fit (contract 2;
        under ``ttl``, the loader's oracle itself, ``oracle_fields``, plans the batches read). Returns the epoch's
        batches where the check read the whole of it (``None`` otherwise)."""
        target = session.target
        if self.capacity_check is not CapacityCheck.EPOCH or self.policy is Policy.WINDOW:
            return None
        try:
            len(inner)
        except TypeError:
            rank_zero_warn(
                "LookaheadDataModule: the training loader has no len(), so its windows are checked as the oracle "
                "reaches them (capacity_check='lookahead')"
            )
            return None

        total = len(inner)
        bound = self.capacity_check_batches
        with scan_progress(
            self.trainer, "Lookahead capacity check", total if bound is None else min(total, bound)
        ) as tick:
            scan = prescan(
                inner,
                target,
                self.prefetch_depth,
                self.stop_timeout_s,
                self.batch_adapter,
                on_batch=tick,
                max_batches=bound,
                max_seconds=self.capacity_check_seconds,
                signalled=sigterm_pending(self.trainer),
                oracle_fields=oracle_fields if self.policy is Policy.TTL else None,
            )
        if scan.ended or scan.batches >= total:
            head = f"Lookahead capacity check: {scan.batches:,} batches read ahead in {scan.seconds:.1f} s"
        else:
            by = (
                f"capacity_check_batches={bound}"
                if bound is not None and scan.batches >= bound
                else f"capacity_check_seconds={self.capacity_check_seconds:g}"
            )
            head = (
                f"Lookahead capacity check: {scan.batches:,} of the epoch's {total:,} batches read ahead in "
                f"{scan.seconds:.1f} s (bound: {by}); the windows of the other {total - scan.batches:,} are "
                f"checked as the oracle plans them, {self.horizon} batches ahead of training"
            )
        lines = [f"{head}; the largest windows read need, of each cache's rows:"] + need_lines(scan, target)
        report_text(self.trainer, "lookahead/capacity_check", "\n".join(lines))
        return scan.batches if scan.ended else None


def batch_adapter_of(datamodule: object) -> Optional[BatchAdapter]:
    """How the training batches of ``datamodule`` are read: a :class:`LookaheadDataModule`'s ``batch_adapter``,
    ``None`` for any other DataModule (TorchRec ``Batch`` es).

    Example:
        >>> batch_adapter_of(None) is None
        True
    """
    return datamodule.batch_adapter if isinstance(datamodule, LookaheadDataModule) else None
