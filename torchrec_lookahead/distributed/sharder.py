"""``LookaheadEmbeddingBagCollectionSharder``: swap it in for TorchRec's EBC sharder to train large tables
through the lookahead cache.

Tables whose parameter sharding uses TorchRec's ``CUSTOMIZED_KERNEL`` compute kernel (see
:func:`~torchrec_lookahead.distributed.plan.lookahead_sharding_plan`) are trained through a host store and a
device cache of ``capacity`` rows; the others are sharded by TorchRec's own
:class:`~torchrec.distributed.embeddingbag.EmbeddingBagCollectionSharder`, unchanged.

Cached tables are placed by :func:`~torchrec_lookahead.distributed.lookahead_sharding_plan`, not by TorchRec's
own planner: TorchRec's estimators and plan validation know only TorchRec's kernels, and its planner would size
a cached table whole onto one device. A sharder with tables to cache therefore refuses to be planned by
TorchRec's planner (``DistributedModelParallel(model, sharders=[...])`` without ``plan=``) with a
:class:`~torchrec_lookahead.errors.ConfigError` naming the fix; one with nothing to cache is TorchRec's EBC sharder.

Example:
    >>> sharder = LookaheadEmbeddingBagCollectionSharder(capacity={"t_big": 4096})
    >>> with lookahead_planning():
    ...     "customized_kernel" in sharder.compute_kernels("data_parallel", "cpu")
    True
    >>> "customized_kernel" in LookaheadEmbeddingBagCollectionSharder().compute_kernels("data_parallel", "cpu")
    False
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import dataclasses
import enum
import fcntl
import logging
import os
import shutil
import tempfile
import time
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ParameterSharding, QuantizedCommCodecs, ShardingEnv, ShardingType
from torchrec.distributed.utils import optimizer_type_to_emb_opt_type
from torchrec.modules.embedding_configs import DataType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from torchrec_lookahead.distributed.lrpp import WriterFilteredStore
from torchrec_lookahead.distributed.sharded import CUSTOMIZED, ShardedLookaheadEmbeddingBagCollection
from torchrec_lookahead.errors import CapacityError, ConfigError
from torchrec_lookahead.modules import CachedEmbeddingBagCollection, CacheOptimizerConfig
from torchrec_lookahead.store import DiskStore, MmapStore, RowShardedStore, TensorStore, row_bounds
from torchrec_lookahead.store.disk_store import check_host_policy
from torchrec_lookahead.store.sharded_store import STAGE_CHANNEL, EmptyShardStore
from torchrec_lookahead.store.types import EmbeddingStore

__all__ = [
    "LookaheadEmbeddingBagCollectionSharder",
    "cache_optimizer_from_module",
    "StoreSharding",
    "STORE_SHARDINGS",
    "StoreKind",
    "STORE_KINDS",
    "lookahead_planning",
]

_PLANNING: contextvars.ContextVar[bool] = contextvars.ContextVar("lookahead_planning", default=False)


@contextlib.contextmanager
def lookahead_planning() -> Iterator[None]:
    """Inside, lookahead sharders offer the cache's kernel to TorchRec's planner (what
    :func:`~torchrec_lookahead.distributed.lookahead_sharding_plan` runs it in); outside, a sharder with tables
    to cache refuses to be planned."""
    token = _PLANNING.set(True)
    try:
        yield
    finally:
        _PLANNING.reset(token)


class StoreSharding(enum.StrEnum):
    """Where the host stores of a multi-rank job live (the sharder's ``store_sharding``); a ``str``, so the
    YAML strings ``host`` and ``row_wise`` are its values.

    Example:
        >>> StoreSharding("row_wise") is StoreSharding.ROW_WISE, StoreSharding.HOST == "host"
        (True, True)
    """

    HOST = "host"  #: one copy of each table per host (several hosts: sharded row-wise over the hosts)
    ROW_WISE = "row_wise"  #: one shard per rank


STORE_SHARDINGS = tuple(s.value for s in StoreSharding)
"""Values of the sharder's ``store_sharding`` option."""


class StoreKind(enum.StrEnum):
    """What holds a cached table on the host (the sharder's ``store``).

    Example:
        >>> StoreKind("disk") is StoreKind.DISK
        True
    """

    RAM = "ram"  #: in RAM (several ranks of a host: shared memory)
    MMAP = "mmap"  #: a memory-mapped file under ``store_dir`` (the page cache decides what stays in RAM)
    DISK = (
        "disk"  #: a file under ``store_dir`` read with direct I/O, under a host tier of ``host_budget_bytes``
    )


STORE_KINDS = tuple(s.value for s in StoreKind)
"""Values of the sharder's ``store`` option."""

_IN_BACKWARD_ATTRS = ("_optimizer_classes", "_optimizer_kwargs", "_in_backward_optimizers")


def _cache_optimizer(optimizer: Any, kw: Dict[str, Any]) -> CacheOptimizerConfig:
    """A cache optimizer from FBGEMM-named arguments (``lr`` as TorchRec's in-backward kwargs name it, or
    ``learning_rate`` as fused params do)."""
    return CacheOptimizerConfig(
        optimizer,
        learning_rate=float(kw["lr"] if "lr" in kw else kw.get("learning_rate", 0.01)),
        eps=float(kw.get("eps", 1e-8)),
        beta1=float(kw.get("beta1", 0.9)),
        beta2=float(kw.get("beta2", 0.999)),
        weight_decay=float(kw.get("weight_decay", 0.0)),
    )


def table_parameters(module: nn.Module) -> nn.ModuleDict:
    """The per-table modules of a TorchRec collection: ``embedding_bags`` of an EmbeddingBagCollection,
    ``embeddings`` of an EmbeddingCollection."""
    found = getattr(module, "embedding_bags", None)
    return found if isinstance(found, nn.ModuleDict) else module.embeddings  # type: ignore[return-value]


def table_configs(module: nn.Module) -> List[Any]:
    """The table configs of a TorchRec EmbeddingBagCollection or EmbeddingCollection."""
    if isinstance(module, EmbeddingBagCollection):
        return list(module.embedding_bag_configs())
    return list(module.embedding_configs())  # type: ignore[operator]


def copy_in_backward_optimizers(src: nn.Module, dst: nn.Module, names: List[str]) -> None:
    """Give the tables ``names`` of collection ``dst`` the ``apply_optimizer_in_backward`` declarations of
    ``src``'s (how TorchRec's sharders find each table's fused optimizer)."""
    for name in names:
        a, b = table_parameters(src)[name].weight, table_parameters(dst)[name].weight
        for attr in _IN_BACKWARD_ATTRS:
            if hasattr(a, attr):
                setattr(b, attr, getattr(a, attr))


def cache_optimizer_from_module(module: nn.Module, tables: List[str]) -> Optional[CacheOptimizerConfig]:
    """The cache optimizer declared on the tables with ``apply_optimizer_in_backward`` (``None`` if none).

    Raises:
        ConfigError: cached tables declare different optimizers, or one the cache cannot move with the row.
    """
    found: Dict[str, CacheOptimizerConfig] = {}
    for name, p in table_parameters(module).named_parameters():
        table = name.split(".")[0]
        if table not in tables or not getattr(p, "_optimizer_classes", None):
            continue
        cls = p._optimizer_classes[0]  # type: ignore[attr-defined]
        kw = dict(p._optimizer_kwargs[0])  # type: ignore[attr-defined]
        try:
            opt: EmbOptimType = optimizer_type_to_emb_opt_type(cls)  # type: ignore[assignment]
        except ValueError:
            raise ConfigError(
                f"Table '{table}' declares optimizer {cls.__name__}, which the cache does not support"
            ) from None
        found[table] = _cache_optimizer(opt, kw)
    distinct = set(found.values())
    if len(distinct) > 1:
        raise ConfigError(
            f"Cached tables declare different optimizers {found}; use one optimizer for all of them"
        )
    return next(iter(distinct)) if distinct else None


_FUSABLE_SHARDINGS = (ShardingType.TABLE_WISE.value, ShardingType.ROW_WISE.value)
# Optimizer arguments that _cache_optimizer maps one to one; anything else in fused_params (gradient clipping,
# stochastic rounding, output dtype, ...) changes what TorchRec's kernel computes.
_FUSABLE_OPTIMIZER_KEYS = {"optimizer", "learning_rate", "lr", "eps", "beta1", "beta2", "weight_decay"}
# Per-table plan settings TorchRec's fused kernel honours and the cache's kernel does not.
_PLAN_EXTRAS = ("cache_params", "enforce_hbm", "stochastic_rounding", "bounds_check_mode", "output_dtype",
                "key_value_params")  # fmt: skip


def _table_optimizer(module: EmbeddingBagCollection, name: str, fused_params: Dict[str, Any]) -> Any:
    """The optimizer TorchRec's fused kernel would train table ``name`` with: its ``apply_optimizer_in_backward``
    declaration over the sharder's ``fused_params`` (as TorchRec merges them), else ``fused_params`` alone.
    Returns a :class:`CacheOptimizerConfig`, or the reason there is none the cache can reproduce."""
    p: Any = table_parameters(module)[name].weight
    classes = getattr(p, "_optimizer_classes", None)
    if not classes:
        if "optimizer" not in fused_params:
            return f"table '{name}' declares no optimizer and the sharder has none in fused_params"
        return _cache_optimizer(fused_params["optimizer"], fused_params)
    kw = dict(p._optimizer_kwargs[0])
    unknown = sorted(set(kw) - _FUSABLE_OPTIMIZER_KEYS)
    if unknown:
        return f"table '{name}' declares optimizer arguments {unknown} the cache's kernel does not take"
    try:
        opt = optimizer_type_to_emb_opt_type(classes[0])
    except ValueError:
        return f"table '{name}' declares optimizer {classes[0].__name__}, which the cache does not support"
    return _cache_optimizer(opt, {**fused_params, **kw})


def _why_not_fusable(
    module: EmbeddingBagCollection,
    resident_cfgs: List[Any],
    params: Dict[str, ParameterSharding],
    env: ShardingEnv,
    optimizer: CacheOptimizerConfig,
    fused_params: Optional[Dict[str, Any]],
) -> Optional[str]:
    """``None`` when the resident tables can train in the cache's kernel with exactly TorchRec's arithmetic,
    else the reason they cannot."""
    if env.world_size > 1:
        return f"{env.world_size} ranks (the resident tables are sharded across them by TorchRec)"
    fp = dict(fused_params or {})
    unknown = sorted(set(fp) - _FUSABLE_OPTIMIZER_KEYS)
    if unknown:
        return f"the sharder's fused_params {unknown} have no counterpart in the cache's kernel"
    for c in resident_cfgs:
        ps = params.get(c.name)
        if ps is None:
            return f"table '{c.name}' has no sharding plan"
        if (
            ps.compute_kernel != EmbeddingComputeKernel.FUSED.value
            or ps.sharding_type not in _FUSABLE_SHARDINGS
        ):
            return (
                f"table '{c.name}' is planned {ps.sharding_type} with the {ps.compute_kernel} kernel (fusing needs "
                f"{'/'.join(_FUSABLE_SHARDINGS)} with the fused kernel)"
            )
        if c.data_type != DataType.FP32:
            return f"table '{c.name}' is {c.data_type.name} (the cache's kernel holds FP32 tables)"
        extra = [f for f in _PLAN_EXTRAS if getattr(ps, f, None) is not None]
        if extra:
            return f"table '{c.name}' is planned with {extra}, which the cache's kernel does not take"
        declared = _table_optimizer(module, c.name, fp)
        if isinstance(declared, str):
            return declared
        if dataclasses.replace(declared, kernel=optimizer.kernel) != optimizer:
            return f"table '{c.name}' trains with {declared}, not the cached tables' {optimizer}"
    return None


@torch.no_grad()
def _copy_resident_weights(
    module: EmbeddingBagCollection, cache: CachedEmbeddingBagCollection, names: List[str]
) -> None:
    """Start the resident tables of ``cache`` from ``module``'s weights, as TorchRec's sharding does (a module
    on the meta device has none: the cache's deterministic initial values stay)."""
    for name in names:
        w = module.embedding_bags[name].weight
        if not w.is_meta:
            cache.cache_weights(name).copy_(w.detach().to(cache.device))


log = logging.getLogger(__name__)

STORE_DIR_PREFIX = "torchrec_lookahead_stores_"
KEPT_STORE_DIR_PREFIX = "torchrec_lookahead_kept_stores_"
_OWNER_LOCK = ".owner.lock"
_ORPHAN_MIN_AGE_S = 60.0


def hold_store_dir(directory: str) -> int:
    """Take the owner lock of a fresh shared-store directory and return its descriptor (keep it open for the
    life of the process: the kernel releases the lock when the process ends, however it ends)."""
    fd = os.open(os.path.join(directory, _OWNER_LOCK), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def remove_orphaned_store_dirs(base: Optional[str]) -> List[str]:
    """Remove shared-store directories under ``base`` (default: the temp directory) whose owner died without
    removing them (a SIGKILLed rank 0 runs no atexit handler, and ``/dev/shm`` is memory): a directory is an
    orphan when its owner lock can be taken, i.e. no live process, in any PID namespace, holds it. Directories
    without a lock file, or younger than a minute (being set up), are left alone. Returns the removed paths."""
    base = base or tempfile.gettempdir()
    removed: List[str] = []
    try:
        names = [n for n in os.listdir(base) if n.startswith(STORE_DIR_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(base, name)
        lock = os.path.join(path, _OWNER_LOCK)
        try:
            if time.time() - os.stat(path).st_mtime < _ORPHAN_MIN_AGE_S or not os.path.exists(lock):
                continue
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live owner holds it
            os.close(fd)
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            log.warning("removed the shared stores %s left by a process that ended without cleaning up", path)
        finally:
            os.close(fd)
    return removed


class LookaheadEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """TorchRec's EBC sharder, extended with the lookahead cache for ``CUSTOMIZED_KERNEL`` tables.

    Its arguments, by concern (the Args below follow this order):

    * cache size: ``capacity``, ``device_budget_bytes``, ``planner_options``;
    * host stores: ``stores``, ``store``, ``store_dir``, ``host_budget_bytes``, ``disk_options``, ``keep_stores``,
      ``store_sharding``, ``seed``;
    * optimizer: ``optimizer``;
    * several ranks: ``cdlrm_average_every``, ``delayed_sync``;
    * resident tables (TorchRec's): ``fuse_resident``, ``fused_params``, ``qcomm_codecs_registry``.

    Args:
        capacity: cache rows per cached table (e.g. ``CachePlan.capacity`` from the lookahead planner).
        device_budget_bytes: instead of ``capacity``, a device memory budget: the ``torchrec`` strategy runs
            the :class:`~torchrec_lookahead.distributed.planner.LookaheadPlanner` on sampled training batches
            to choose resident tables and cache sizes (:meth:`plan_capacity`).
        planner_options: keyword arguments of the planner (``horizon``, ``prefetch_depth``, ``policy``,
            ``num_sample_batches``, ...).
        stores: explicit host stores per cached table.
        store: what holds the cached tables on the host: ``"ram"``, ``"mmap"`` (a memory-mapped file under
            ``store_dir``) or ``"disk"`` (a :class:`~torchrec_lookahead.store.DiskStore`: a file under ``store_dir``,
            default the temp directory, read with direct I/O under a host tier of ``host_budget_bytes``; with
            several ranks one row shard per rank, as ``store_sharding="row_wise"``). Default: ``"mmap"`` when
            ``store_dir`` is given, else ``"ram"``.
        store_dir: where the files of ``"mmap"`` and ``"disk"`` stores go: a fresh directory
            ``<store_dir>/torchrec_lookahead_stores_*/`` per run, removed when the process exits (a later run
            removes those of runs that were killed) unless ``keep_stores``.
        host_budget_bytes: with ``store="disk"``, the host tier's bytes on each rank: an int is split over the
            cached tables of each collection in proportion to their bytes (each must get at least one row), a
            dict gives each table its own.
        disk_options: with ``store="disk"``, more :class:`~torchrec_lookahead.store.DiskStore` arguments
            (``direct_io``, ``io_threads``, ``preallocate``, ``host_policy``: ``"lru"`` or ``"lookahead"``,
            ``disk_prefetch_depth``: steps ahead the lookahead policy reads the planned rows from disk).
        keep_stores: keep the store directories under ``store_dir`` after the run (to inspect the trained
            tables; a new run never reopens them). Default: remove them.
        store_sharding: where the host stores of a multi-rank job live. ``"host"`` (the default): one copy of
            each table per host, in memory the host's ranks share (``/dev/shm``, or ``store_dir``); on one host
            that is one shared store, with several hosts the table is sharded row-wise over the hosts (one
            shard per host, each rank serving its own host's shard to the same local rank of the other
            hosts), reached with torch.distributed collectives
            (:class:`~torchrec_lookahead.store.RowShardedStore`). ``"row_wise"``: one shard per rank, in the
            rank's own memory (a memory-mapped file under ``store_dir`` when given), also on one host (how
            the sharded store is tested on one machine, and a way to spread the tables over the ranks' memory).
            Ignored with one rank.
        seed: seed of the initial table values (identical to a resident model initialised with
            :func:`~torchrec_lookahead.modules.init_embedding_bag_tables_` and the same seed); default: the
            ``torchrec`` strategy's ``init_seed``, else 0.
        optimizer: the cache's fused optimizer; by default the one declared on the table parameters with
            ``apply_optimizer_in_backward``, else ``fused_params``.
        cdlrm_average_every: with several ranks, cDLRM's scheme instead of LRPP: each rank updates its cache
            replica with its own gradients only, and the replicas (rows and optimizer state) are averaged every
            this many steps, before evictions (use the ``window`` policy with ``window`` a multiple of it;
            ``LookaheadDataModule`` refuses schedules that evict between averagings unless it is 1).
            **Approximate by design** (exact only for SGD averaged every step); see docs/design.md.
        delayed_sync: with several ranks (LRPP), synchronise the gradients of shared rows that no rank reads
            at the next step in the background, on a process group of their own, off the critical path; their
            update lands before the next step's plan is applied, exactly as if applied in the step. ``False``:
            every shared row is synchronised inside the backward.
        fuse_resident: with one rank, train the resident tables in the cache module's own kernel (one FBGEMM
            TBE, one lookup and one fused update for the whole collection) instead of in a second,
            TorchRec-sharded module beside it: the same arithmetic without a second module's batch split,
            kernel launches and output reassembly. ``None`` (the default): whenever it computes exactly what
            TorchRec would, i.e. one rank, every resident table planned with TorchRec's ``fused`` kernel
            (table-wise or row-wise) and declaring the cached tables' optimizer; ``True``: require it (a
            :class:`~torchrec_lookahead.errors.ConfigError` says why not); ``False``: always TorchRec's
            module. With several ranks the resident tables stay TorchRec-sharded.
        fused_params: TorchRec fused parameters for the resident tables.
        qcomm_codecs_registry: TorchRec communication codecs.
    Example:
        >>> sharder = LookaheadEmbeddingBagCollectionSharder(capacity={"t_big": 4096})
        >>> sharder.fuse_resident is None  # resident tables join the cache's kernel where that is exact
        True
    """

    def __init__(
        self,
        capacity: Optional[Dict[str, int]] = None,
        optimizer: Optional[CacheOptimizerConfig] = None,
        stores: Optional[Dict[str, EmbeddingStore]] = None,
        store_dir: Optional[str] = None,
        keep_stores: bool = False,
        store: Optional[str] = None,
        host_budget_bytes: Optional[Union[int, Dict[str, int]]] = None,
        disk_options: Optional[Dict[str, Any]] = None,
        seed: Optional[int] = None,
        device_budget_bytes: Optional[int] = None,
        planner_options: Optional[Dict[str, Any]] = None,
        cdlrm_average_every: Optional[int] = None,
        store_sharding: Optional[str] = None,
        delayed_sync: bool = True,
        fuse_resident: Optional[bool] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        qcomm_codecs_registry: Optional[Dict[str, QuantizedCommCodecs]] = None,
    ) -> None:
        if fused_params is None and optimizer is not None:
            fused_params = optimizer.fused_params()
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)
        self.capacity: Dict[str, int] = {k: int(v) for k, v in (capacity or {}).items()}
        for t, c in self.capacity.items():
            if c < 1:
                raise ConfigError(f"capacity of table '{t}' must be a positive number of rows but got {c}")
        if device_budget_bytes is not None and device_budget_bytes <= 0:
            raise ConfigError(f"Expected device_budget_bytes > 0 but got {device_budget_bytes}")
        if device_budget_bytes is not None and self.capacity:
            raise ConfigError(
                "Give either capacity or device_budget_bytes to the lookahead sharder, not both"
            )
        if cdlrm_average_every is not None and cdlrm_average_every < 1:
            raise ConfigError(f"Expected cdlrm_average_every >= 1 but got {cdlrm_average_every}")
        self.cdlrm_average_every = cdlrm_average_every
        if store_sharding is not None and store_sharding not in STORE_SHARDINGS:
            raise ConfigError(
                f"store_sharding must be one of {list(STORE_SHARDINGS)} but got {store_sharding!r}"
            )
        self.store_sharding = StoreSharding(store_sharding or StoreSharding.HOST)
        self._store_groups: Optional[Dict[str, Any]] = None
        self.delayed_sync = bool(delayed_sync)
        self.fuse_resident = None if fuse_resident is None else bool(fuse_resident)
        self._delayed_groups: Dict[Tuple[int, ...], Any] = {}
        self.device_budget_bytes = device_budget_bytes
        self.planner_options = dict(planner_options or {})
        self.cache_plan: Optional[Any] = None
        self.optimizer = optimizer
        self.stores = dict(stores or {})
        self.store_dir = store_dir
        self.keep_stores = bool(keep_stores)
        self.store_kind = _store_kind(store, store_dir, host_budget_bytes, disk_options)
        self.host_budget_bytes = host_budget_bytes
        self.disk_options = dict(disk_options or {})
        self._run_dir: Optional[str] = None
        self._owner_locks: List[int] = []  # descriptors holding shared-store directories' owner locks
        self.seed = seed

    def plan_capacity(
        self,
        module: nn.Module,
        sample_batches: Iterable[Any],
        pinned: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> Any:
        """Size the caches of every EmbeddingBagCollection and EmbeddingCollection in ``module`` for
        ``device_budget_bytes``.

        Sets :attr:`capacity` (cached tables only) and :attr:`cache_plan` (the planner's report) and returns
        the plan.

        Args:
            module: the model.
            sample_batches: sparse features of training batches (for pinned rows: of the cold batches).
            pinned: table -> sorted hot ids pinned in its cache (FAE). The budget holds the pinned rows plus the
                dynamic caches: the pinned rows' bytes (weights and optimizer state) come off the budget, the
                planner sizes each table's dynamic part from the samples' cold ids (as ids of a table of
                ``rows - P`` rows), and a cached table's capacity is ``P`` plus its dynamic rows. A table whose
                every row is hot stays resident.

        Raises:
            ConfigError: no budget was given, or pinned rows name a table the module does not have.
            CapacityError: the budget cannot hold the pinned rows and the smallest feasible caches.
        """
        from torchrec_lookahead.distributed.planner import LookaheadPlanner
        from torchrec_lookahead.hotcold.pinned import cold_table_ids

        if self.device_budget_bytes is None:
            raise ConfigError("plan_capacity() needs device_budget_bytes")
        ebcs = [m for m in module.modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))]
        tables = [c for m in ebcs for c in table_configs(m)]
        names = [c.name for c in tables]
        optimizer = self.optimizer
        for m in ebcs:
            optimizer = optimizer or cache_optimizer_from_module(m, names)
        optimizer = optimizer or CacheOptimizerConfig()
        # Leave 25% above the sampled working set by default: batches after the sample can need more rows.
        options = {"floor_headroom": 1.25, **self.planner_options}
        hot = {t: ids for t, ids in (pinned or {}).items() if ids.numel()}
        if not hot:
            plan = LookaheadPlanner(self.device_budget_bytes, **options).plan(
                tables, optimizer, sample_batches
            )
            self.capacity = dict(plan.capacity)
            self.cache_plan = plan
            return plan
        unknown = sorted(set(hot) - set(names))
        if unknown:
            raise ConfigError(
                f"pinned rows name tables {unknown} the model does not have; its tables: {names}"
            )
        probe = LookaheadPlanner(self.device_budget_bytes, **options)
        bpr = {t.name: t.bpr for t in probe._tables(tables, optimizer)}
        pinned_rows = {t: int(ids.numel()) for t, ids in hot.items()}
        pinned_bytes = sum(n * bpr[t] for t, n in pinned_rows.items())
        if pinned_bytes >= self.device_budget_bytes:
            raise CapacityError(
                f"device_budget_bytes={self.device_budget_bytes:,} does not exceed the {pinned_bytes:,} bytes of the "
                f"{sum(pinned_rows.values()):,} pinned hot rows; raise the budget or lower hot_budget_bytes"
            )
        dynamic = [
            dataclasses.replace(c, num_embeddings=c.num_embeddings - pinned_rows.get(c.name, 0))
            for c in tables
            if c.num_embeddings > pinned_rows.get(c.name, 0)
        ]
        f2t = {f: c.name for c in dynamic for f in c.feature_names}
        samples = (cold_table_ids(getattr(b, "sparse_features", b), f2t, hot) for b in sample_batches)
        plan = LookaheadPlanner(self.device_budget_bytes - pinned_bytes, **options).plan(
            dynamic, optimizer, samples
        )
        self.capacity = {t: c + pinned_rows.get(t, 0) for t, c in plan.capacity.items()}
        self.cache_plan = plan
        return plan

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        """TorchRec's kernels, and inside :func:`lookahead_planning` the cache's for data-parallel tables.

        Raises:
            ConfigError: TorchRec's own planner asks (no ``lookahead_planning``) while this sharder has tables
                to cache (``capacity`` or ``device_budget_bytes``).
        """
        return self.cache_kernels(
            list(super().compute_kernels(sharding_type, compute_device_type)), sharding_type
        )

    def cache_kernels(self, kernels: List[str], sharding_type: str) -> List[str]:
        """``kernels`` (TorchRec's) plus the cache's where :func:`lookahead_planning` plans a data-parallel table;
        shared with the EmbeddingCollection sibling (see :meth:`compute_kernels`)."""
        if not _PLANNING.get():
            if self.capacity or self.device_budget_bytes is not None:
                what = (
                    sorted(self.capacity)
                    if self.capacity
                    else f"device_budget_bytes={self.device_budget_bytes}"
                )
                raise ConfigError(
                    f"TorchRec's planner cannot place the lookahead cache's tables ({what}): "
                    "DistributedModelParallel was given the lookahead sharder without a plan. Pass "
                    "plan=torchrec_lookahead.distributed.lookahead_sharding_plan(model, sharders, capacity, "
                    "topology) to DistributedModelParallel (under Lightning, strategy='torchrec' does this)"
                )
            return kernels
        if sharding_type == ShardingType.DATA_PARALLEL.value:
            kernels.append(CUSTOMIZED)
        return kernels

    def _store(self, cfg: Any, optimizer: CacheOptimizerConfig, host_budget: int) -> Optional[EmbeddingStore]:
        if cfg.name in self.stores:
            return self.stores[cfg.name]
        if self.store_kind is StoreKind.RAM:
            return None
        if self._run_dir is None:
            # A fresh directory per run: reopening an earlier run's files would silently continue its training.
            self._run_dir = self._new_store_dir(self.store_dir, "", keep=self.keep_stores)
        if self.store_kind is StoreKind.DISK:
            return self._disk_store(
                os.path.join(self._run_dir, f"{cfg.name}.rows"), cfg, optimizer, host_budget
            )
        return MmapStore(
            os.path.join(self._run_dir, f"{cfg.name}.bin"),
            cfg.num_embeddings,
            cfg.embedding_dim,
            optimizer.state_widths(cfg.embedding_dim),
            name=cfg.name,
            seed=self.seed or 0,
        )

    def shard(  # type: ignore[override]
        self,
        module: EmbeddingBagCollection,
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        device: Optional[torch.device] = None,
        module_fqn: Optional[str] = None,
    ) -> Any:
        configs = module.embedding_bag_configs()
        cached = self.cached_table_names(configs, params)
        if not cached:
            return super().shard(module, params, env, device, module_fqn)
        optimizer = self.cache_optimizer(module, cached)
        resident_cfgs = [c for c in configs if c.name not in cached]
        resident = None
        fuse = self._fuse_resident(module, resident_cfgs, params, env, optimizer)
        if resident_cfgs and not fuse:
            sub = EmbeddingBagCollection(
                tables=resident_cfgs, is_weighted=module.is_weighted(), device=torch.device("meta")
            )
            copy_in_backward_optimizers(module, sub, [c.name for c in resident_cfgs])
            resident = super().shard(
                sub, {c.name: params[c.name] for c in resident_cfgs}, env, device, module_fqn
            )
        cached_cfgs = [c for c in configs if c.name in cached]
        stores = self.cache_stores(cached_cfgs, optimizer, env)
        cache = CachedEmbeddingBagCollection(
            configs if fuse else cached_cfgs,
            capacity={t: self.capacity[t] for t in cached},
            optimizer=optimizer,
            stores=stores,
            seed=self.seed or 0,
            device=device,
            is_weighted=module.is_weighted(),
        )
        if fuse:
            _copy_resident_weights(module, cache, [c.name for c in resident_cfgs])
        return ShardedLookaheadEmbeddingBagCollection(
            configs,
            resident,
            cache,
            module.is_weighted(),
            **self.sync_options(env),
        )

    def sync_options(self, env: ShardingEnv) -> Dict[str, Any]:
        """The sharded cached module's rank and multi-rank arguments (LRPP, delayed sync, cDLRM) for ``env``."""
        delayed = self.delayed_sync and env.world_size > 1 and self.cdlrm_average_every is None
        return dict(
            rank=env.rank,
            world_size=env.world_size,
            process_group=env.process_group,
            average_every=self.cdlrm_average_every if env.world_size > 1 else None,
            delayed_sync=delayed,
            delayed_group=self._delayed_group(env) if delayed else None,
        )

    def cached_table_names(self, configs: List[Any], params: Dict[str, ParameterSharding]) -> List[str]:
        """The tables of ``configs`` planned for the cache (``CUSTOMIZED_KERNEL``).

        Raises:
            ConfigError: a table planned for the cache has no capacity.
        """
        cached = [c.name for c in configs if c.name in params and params[c.name].compute_kernel == CUSTOMIZED]
        missing = [t for t in cached if t not in self.capacity]
        if missing:
            raise ConfigError(
                f"Tables {missing} are planned for the lookahead cache but have no capacity; pass "
                f"capacity={{table: rows}} to LookaheadEmbeddingBagCollectionSharder (known: {sorted(self.capacity)})"
            )
        uncached = [c.name for c in configs if c.name in self.capacity and c.name not in cached]
        if uncached:
            raise ConfigError(
                f"Tables {uncached} have a cache capacity but the sharding plan gives them TorchRec's "
                f"{sorted({params[t].compute_kernel for t in uncached if t in params})} kernel: they would train "
                "resident. Build the plan with torchrec_lookahead.distributed.lookahead_sharding_plan(model, "
                "sharders, capacity, topology), or drop them from capacity"
            )
        return cached

    def cache_optimizer(self, module: nn.Module, cached: List[str]) -> CacheOptimizerConfig:
        """The cached tables' optimizer: the sharder's ``optimizer``, else the one declared on the tables, else
        ``fused_params``'.

        Raises:
            ConfigError: none is given, or the tables declare several.
        """
        optimizer = self.optimizer or cache_optimizer_from_module(module, cached)
        if optimizer is None:
            fp = dict(self.fused_params or {})
            if "optimizer" not in fp:
                raise ConfigError(
                    "No optimizer for the cached tables: declare one with apply_optimizer_in_backward, or pass "
                    "optimizer=CacheOptimizerConfig(...) to the sharder"
                )
            optimizer = _cache_optimizer(fp["optimizer"], fp)
        return optimizer

    def cache_stores(
        self, cfgs: List[Any], optimizer: CacheOptimizerConfig, env: ShardingEnv
    ) -> Dict[str, EmbeddingStore]:
        """The host stores of the cached tables ``cfgs`` (absent: the cache makes an in-RAM one)."""
        if env.world_size > 1:
            # LRPP: one shared host store per table. The kernel is the one-rank kernel (FBGEMM's where it has
            # the optimizer): its backward runs over the exchange batch (distributed/exact_sync.py).
            return self._shared_stores(cfgs, optimizer, env)
        budgets = self._host_budgets({c.name: c.num_embeddings * _row_bytes(c, optimizer) for c in cfgs})
        return {c.name: s for c in cfgs if (s := self._store(c, optimizer, budgets[c.name])) is not None}

    def _host_budgets(self, table_bytes: Dict[str, int]) -> Dict[str, int]:
        """Each table's share of ``host_budget_bytes`` (0 unless ``store="disk"``)."""
        budget = self.host_budget_bytes
        if self.store_kind is not StoreKind.DISK or budget is None:
            return dict.fromkeys(table_bytes, 0)
        if isinstance(budget, dict):
            missing = sorted(set(table_bytes) - set(budget))
            if missing:
                raise ConfigError(
                    f"host_budget_bytes gives no budget to the cached tables {missing}; give every cached table "
                    "one, or one int for all"
                )
            return {t: int(budget[t]) for t in table_bytes}
        total = max(1, sum(table_bytes.values()))
        return {t: int(budget) * b // total for t, b in table_bytes.items()}

    def _disk_store(
        self,
        path: str,
        cfg: Any,
        optimizer: CacheOptimizerConfig,
        host_budget: int,
        rows: Optional[Tuple[int, int]] = None,
    ) -> DiskStore:
        """A disk store of table ``cfg`` (of its rows ``[lo, hi)`` when ``rows`` is given)."""
        lo, hi = rows or (0, cfg.num_embeddings)
        widths = optimizer.state_widths(cfg.embedding_dim)
        row_bytes = _row_bytes(cfg, optimizer)
        if host_budget < row_bytes:
            raise CapacityError(
                f"the host tier of table '{cfg.name}' gets {host_budget:,} bytes of host_budget_bytes="
                f"{self.host_budget_bytes}, below one row ({row_bytes} bytes); raise host_budget_bytes",
                table=cfg.name,
                needed=1,
                available=0,
            )
        return DiskStore(path, hi - lo, cfg.embedding_dim, widths, name=cfg.name, seed=self.seed or 0,
                         host_budget_bytes=host_budget, row_offset=lo, table_rows=cfg.num_embeddings,
                         **self.disk_options)  # fmt: skip

    def _fuse_resident(
        self,
        module: EmbeddingBagCollection,
        resident_cfgs: List[Any],
        params: Dict[str, ParameterSharding],
        env: ShardingEnv,
        optimizer: CacheOptimizerConfig,
    ) -> bool:
        """Whether the resident tables train in the cache module's kernel (see ``fuse_resident``)."""
        if not resident_cfgs or self.fuse_resident is False:
            return False
        why = _why_not_fusable(module, resident_cfgs, params, env, optimizer, self.fused_params)
        if why is not None and self.fuse_resident:
            raise ConfigError(
                f"fuse_resident=True, but the resident tables cannot join the cache's kernel: {why}"
            )
        if why is not None:
            log.info("resident tables stay in TorchRec's sharded module: %s", why)
        return why is None

    def _new_store_dir(self, base: Optional[str], tag: str, keep: bool) -> str:
        """A fresh store directory under ``base`` (default: the temp directory), after removing the directories of
        runs whose owner died. Unless ``keep``, this one is owned by the process (its lock held until the
        process ends) and removed at exit."""
        if base is not None:
            os.makedirs(base, exist_ok=True)
        remove_orphaned_store_dirs(base)
        if keep:
            directory = tempfile.mkdtemp(prefix=f"{KEPT_STORE_DIR_PREFIX}{tag}", dir=base)
            log.info("the stores of this run stay in %s (keep_stores=True)", directory)
            return directory
        directory = tempfile.mkdtemp(prefix=f"{STORE_DIR_PREFIX}{tag}", dir=base)
        self._owner_locks.append(hold_store_dir(directory))
        atexit.register(shutil.rmtree, directory, True)
        return directory

    def _delayed_group(self, env: ShardingEnv) -> Any:
        """The process group of delayed synchronisation: one per set of ranks, created once (by every rank,
        in the same order, as sharding runs identically on every rank) with the backend of ``env``'s group."""
        pg = env.process_group
        ranks = tuple(dist.get_process_group_ranks(pg)) if pg is not None else tuple(range(env.world_size))
        if ranks not in self._delayed_groups:
            backend = dist.get_backend(pg) if pg is not None else dist.get_backend()
            self._delayed_groups[ranks] = dist.new_group(ranks=list(ranks), backend=backend)
        return self._delayed_groups[ranks]

    def _shared_stores(
        self, cfgs: List[Any], optimizer: CacheOptimizerConfig, env: ShardingEnv
    ) -> Dict[str, EmbeddingStore]:
        """The host stores of a multi-rank job (see ``store_sharding``): one memory-mapped store per table
        shared by the ranks of the host, or row shards reached with collectives."""
        if self.stores:  # checked on every rank, before any collective
            raise ConfigError("explicit stores= are not supported with several ranks; use store_dir=")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
        if self.store_sharding is StoreSharding.ROW_WISE or self.store_kind is StoreKind.DISK:
            # a disk store's host tier is one process's memory: one row shard per rank
            return self._sharded_stores(cfgs, optimizer, env, list(range(env.world_size)))
        if local == env.world_size:
            return self._one_host_stores(cfgs, optimizer, env)
        if local < 1 or env.world_size % local != 0:
            raise ConfigError(
                f"{env.world_size} ranks with LOCAL_WORLD_SIZE={local} do not form equal hosts; the host-sharded "
                "store needs the same number of ranks on every host (or use store_sharding='row_wise')"
            )
        # torchrun numbers the ranks of a host contiguously: host h holds ranks [h * local, (h + 1) * local).
        return self._sharded_stores(cfgs, optimizer, env, [r // local for r in range(env.world_size)])

    def _one_host_stores(
        self, cfgs: List[Any], optimizer: CacheOptimizerConfig, env: ShardingEnv
    ) -> Dict[str, EmbeddingStore]:
        """Memory-mapped stores shared by the ranks of one host: rank 0 creates and initialises them in a
        fresh directory (under ``store_dir``, else ``/dev/shm``), the others open them after a barrier."""
        pg = env.process_group
        holder: List[Optional[str]] = [None]
        if env.rank == 0:
            base = self.store_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
            holder[0] = self._new_store_dir(base, "", keep=self.keep_stores and self.store_dir is not None)
        dist.broadcast_object_list(holder, src=0, group=pg)
        directory = str(holder[0])
        stores: Dict[str, EmbeddingStore] = {}
        for c in cfgs:
            path = os.path.join(directory, f"{c.name}.bin")
            if env.rank == 0:
                store = MmapStore(path, c.num_embeddings, c.embedding_dim, optimizer.state_widths(c.embedding_dim),
                                  name=c.name, seed=self.seed or 0)  # fmt: skip
                for lo in range(0, c.num_embeddings, 1 << 16):  # initialise every chunk before sharing
                    store.gather(torch.arange(lo, min(lo + (1 << 16), c.num_embeddings)))
                store.flush()
                stores[c.name] = WriterFilteredStore(store)
        dist.barrier(group=pg)
        if env.rank != 0:
            for c in cfgs:
                stores[c.name] = WriterFilteredStore(MmapStore.open(os.path.join(directory, f"{c.name}.bin")))
        return stores

    def _groups(self) -> Dict[str, Any]:
        """The sharded stores' process groups (created once, in the same order on every rank): the default
        one for the training thread, one for the lookahead stager's gathers. gloo: rows are CPU tensors."""
        if self._store_groups is None:
            self._store_groups = {
                "default": dist.new_group(backend="gloo"),
                STAGE_CHANNEL: dist.new_group(backend="gloo"),
            }
        return self._store_groups

    def _sharded_stores(
        self, cfgs: List[Any], optimizer: CacheOptimizerConfig, env: ShardingEnv, shard_of_rank: List[int]
    ) -> Dict[str, EmbeddingStore]:
        """Row shards: shard ``shard_of_rank[r]`` is served by rank ``r``. A shard served by one rank lives in
        its memory (a memory-mapped file under ``store_dir`` when given); a shard served by several ranks (one
        per host) in a memory-mapped file the first of them creates under ``store_dir``, else ``/dev/shm``."""
        pg = env.process_group
        groups = self._groups()
        num_shards = max(shard_of_rank) + 1
        shard = shard_of_rank[env.rank]
        servers = [r for r, s in enumerate(shard_of_rank) if s == shard]
        shared = len(servers) > 1
        creator = env.rank == servers[0]
        seed = self.seed or 0
        directory: Optional[str] = None
        disk = self.store_kind is StoreKind.DISK
        if creator and (shared or self.store_dir is not None or disk):
            base = (
                self.store_dir
                if disk
                else self.store_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
            )
            keep = self.keep_stores and self.store_dir is not None
            directory = self._new_store_dir(base, f"shard{shard}_", keep=keep)
        locals_: Dict[str, EmbeddingStore] = {}
        bounds = {c.name: row_bounds(c.num_embeddings, num_shards)[shard : shard + 2] for c in cfgs}
        budgets = self._host_budgets(
            {c.name: (bounds[c.name][1] - bounds[c.name][0]) * _row_bytes(c, optimizer) for c in cfgs}
        )
        for c in cfgs:
            lo, hi = bounds[c.name]
            widths = optimizer.state_widths(c.embedding_dim)
            if hi == lo:  # fewer rows than shards: this shard is empty, no id is ever routed to it
                locals_[c.name] = EmptyShardStore(c.name, c.embedding_dim, widths)
            elif disk and directory is not None:
                path = os.path.join(directory, f"{c.name}.rows")
                locals_[c.name] = self._disk_store(path, c, optimizer, budgets[c.name], (lo, hi))
            elif directory is not None:
                store = MmapStore(os.path.join(directory, f"{c.name}.bin"), hi - lo, c.embedding_dim, widths,
                                  name=c.name, seed=seed, row_offset=lo, table_rows=c.num_embeddings)  # fmt: skip
                if shared:  # initialise every chunk before the other ranks of the host open it
                    for a in range(0, hi - lo, 1 << 16):
                        store.gather(torch.arange(a, min(a + (1 << 16), hi - lo)))
                    store.flush()
                locals_[c.name] = store
            elif not shared:
                locals_[c.name] = TensorStore(hi - lo, c.embedding_dim, widths, name=c.name, seed=seed,
                                              row_offset=lo, table_rows=c.num_embeddings)  # fmt: skip
        if env.world_size > num_shards:  # some shard has several servers (the same on every rank)
            paths: List[Any] = [None] * env.world_size
            dist.all_gather_object(paths, directory, group=pg)
            dist.barrier(group=pg)
            for c in cfgs:
                if c.name not in locals_:
                    locals_[c.name] = MmapStore.open(os.path.join(str(paths[servers[0]]), f"{c.name}.bin"))
        stores: Dict[str, EmbeddingStore] = {}
        for c in cfgs:
            sharded = RowShardedStore(
                locals_[c.name],
                c.num_embeddings,
                row_bounds(c.num_embeddings, num_shards),
                shard_of_rank,
                group=groups["default"],
                channel_groups={STAGE_CHANNEL: groups[STAGE_CHANNEL]},
            )
            stores[c.name] = WriterFilteredStore(sharded)
        return stores


def _row_bytes(cfg: Any, optimizer: CacheOptimizerConfig) -> int:
    """Bytes of one stored row of table ``cfg``: weight and optimizer state, float32."""
    return 4 * (cfg.embedding_dim + sum(optimizer.state_widths(cfg.embedding_dim).values()))


def _store_kind(
    store: Optional[str],
    store_dir: Optional[str],
    host_budget_bytes: Optional[Union[int, Dict[str, int]]],
    disk_options: Optional[Dict[str, Any]],
) -> StoreKind:
    """The sharder's ``store``, checked against the options that go with it."""
    if store is not None and store not in STORE_KINDS:
        raise ConfigError(f"store must be one of {list(STORE_KINDS)} but got {store!r}")
    kind = (
        StoreKind(store) if store is not None else StoreKind.MMAP if store_dir is not None else StoreKind.RAM
    )
    if kind is StoreKind.RAM and store_dir is not None:
        raise ConfigError("store='ram' keeps no files: drop store_dir, or choose store='mmap' or 'disk'")
    if kind is StoreKind.MMAP and store_dir is None:
        raise ConfigError("store='mmap' needs store_dir (the directory of the memory-mapped files)")
    if kind is not StoreKind.DISK and (host_budget_bytes is not None or disk_options):
        raise ConfigError(
            f"host_budget_bytes and disk_options are for store='disk' but store is {kind.value!r}; "
            "set store: disk or drop them"
        )
    if kind is StoreKind.DISK:
        if host_budget_bytes is None:
            raise ConfigError("store='disk' needs host_budget_bytes (the host tier's bytes on each rank)")
        budgets = host_budget_bytes.values() if isinstance(host_budget_bytes, dict) else [host_budget_bytes]
        if any(int(b) <= 0 for b in budgets):
            raise ConfigError(f"host_budget_bytes must be positive but got {host_budget_bytes}")
        opts = dict(disk_options or {})
        unknown = sorted(
            set(opts) - {"direct_io", "io_threads", "preallocate", "host_policy", "disk_prefetch_depth"}
        )
        if unknown:
            raise ConfigError(
                "disk_options takes direct_io, io_threads, preallocate, host_policy and disk_prefetch_depth, "
                f"not {unknown}"
            )
        check_host_policy(opts.get("host_policy", "lru"), opts.get("disk_prefetch_depth", 0))
    return kind
