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

import contextlib
import contextvars
import copy
import dataclasses
import inspect
import logging
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Union

import torch
from torch import nn
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ParameterSharding, QuantizedCommCodecs, ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_lookahead._checks import (
    check_bool,
    check_bytes,
    check_choice,
    check_dataclass,
    check_dir,
    check_int,
    is_int,
)
from torchrec_lookahead.distributed._capacity import plan_capacity
from torchrec_lookahead.distributed._groups import CacheGroups
from torchrec_lookahead.distributed._optimizers import (
    cache_optimizer_from_kwargs,
    cache_optimizer_from_module,
    optimizer_differences,
    why_not_fusable,
)
from torchrec_lookahead.distributed._resident_order import output_order
from torchrec_lookahead.distributed._store_dirs import StoreDirs
from torchrec_lookahead.distributed._stores import (
    STORE_SHARDINGS,
    HostStores,
    StoreKind,
    StoreOptions,
    StoreSharding,
    store_kind,
)
from torchrec_lookahead.distributed._tables import copy_in_backward_optimizers
from torchrec_lookahead.distributed.sharded import ShardedLookaheadEmbeddingBagCollection
from torchrec_lookahead.distributed.sharded_collection import CUSTOMIZED
from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.modules import CachedEmbeddingBagCollection, CacheLayout, CacheOptimizerConfig
from torchrec_lookahead.oracle import LookaheadSettings, Policy
from torchrec_lookahead.store.types import EmbeddingStore

__all__ = ["LookaheadEmbeddingBagCollectionSharder", "lookahead_planning"]

log = logging.getLogger(__name__)

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


class LookaheadEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """TorchRec's EBC sharder, extended with the lookahead cache for ``CUSTOMIZED_KERNEL`` tables.

    Its arguments, by concern (the Args below follow this order):

    * cache size: ``capacity``, ``device_budget_bytes``, ``planner_options``, ``cache_layout``;
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
        planner_options: keyword arguments of the planner (``num_sample_batches``, ...; another key is
            refused). Its ``horizon``, ``prefetch_depth`` and ``policy`` are the loader's: under the ``torchrec``
            strategy those of the ``LookaheadDataModule`` (:meth:`use_lookahead_settings`); state them there,
            once (given here too, they must be equal).
        cache_layout: ``"pooled"`` (default): the cached tables of one kernel and dimension share one cache of
            the sum of their capacities, planned jointly, so rows go to whichever table the stream reads next;
            ``"per_table"``: every cached table keeps its own ``capacity`` rows
            (:class:`~torchrec_lookahead.modules.CacheLayout`).
        stores: explicit host stores per cached table.
        store: what holds the cached tables on the host: ``"ram"``, ``"mmap"`` (a memory-mapped file under
            ``store_dir``) or ``"disk"`` (a :class:`~torchrec_lookahead.store.DiskStore`: a file under ``store_dir``,
            default the temp directory, read with direct I/O under a host tier of ``host_budget_bytes``; with
            several ranks one row shard per rank, as ``store_sharding="row_wise"``; ``"host"`` is refused).
            Default: ``"mmap"`` when ``store_dir`` is given, else ``"ram"``.
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
            ``torchrec`` strategy's ``init_seed``, else 0 (under the strategy, a seed unlike its ``init_seed``
            is refused: the cached tables would start from other values than the resident ones).
        optimizer: the cache's fused optimizer (a :class:`~torchrec_lookahead.modules.CacheOptimizerConfig`, or a
            dict of its fields: ``{"optimizer": "rowwise_adagrad", "learning_rate": 0.05}``); by default the one
            declared on the table parameters with ``apply_optimizer_in_backward``, else ``fused_params``.
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
        cache_layout: Union[CacheLayout, str] = CacheLayout.POOLED,
    ) -> None:
        # a dict is built into the config as a config file's {optimizer: ..., learning_rate: ...} is
        optimizer = (
            None if optimizer is None else check_dataclass("optimizer", optimizer, CacheOptimizerConfig)
        )
        if fused_params is None and optimizer is not None:
            fused_params = optimizer.fused_params()
        super().__init__(fused_params=fused_params, qcomm_codecs_registry=qcomm_codecs_registry)
        if capacity is not None and not isinstance(capacity, Mapping):
            raise ConfigError(
                f"capacity must be a mapping of table name to cache rows (e.g. {{'t_cat_2': 1000}}) but got "
                f"{capacity!r}; or give device_budget_bytes to have the caches sized"
            )
        for t, c in (capacity or {}).items():
            if not is_int(c) or c < 1:
                raise ConfigError(f"capacity of table '{t}' must be a positive number of rows but got {c!r}")
        self.capacity: Dict[str, int] = {k: int(v) for k, v in (capacity or {}).items()}
        self.cache_layout = check_choice("cache_layout", cache_layout, CacheLayout)
        if device_budget_bytes is not None:
            check_int("device_budget_bytes", device_budget_bytes, 1, "give the device cache's bytes")
        if host_budget_bytes is not None:
            check_bytes("host_budget_bytes", host_budget_bytes, "give the host tier's bytes on each rank")
        if store_dir is not None:
            check_dir("store_dir", store_dir)
        if seed is not None:
            check_int("seed", seed, 0, "give a non-negative seed, or leave it unset")
        if device_budget_bytes is not None and self.capacity:
            raise ConfigError(
                "Give either capacity or device_budget_bytes to the lookahead sharder, not both (an override of one "
                "merges with a config's other: set the other to null, e.g. capacity: null)"
            )
        if cdlrm_average_every is not None:
            check_int(
                "cdlrm_average_every", cdlrm_average_every, 1, "average the replicas every N >= 1 steps"
            )
        self.cdlrm_average_every = cdlrm_average_every
        if store_sharding is not None and store_sharding not in STORE_SHARDINGS:
            raise ConfigError(
                f"store_sharding must be one of {list(STORE_SHARDINGS)} but got {store_sharding!r}"
            )
        self.store_sharding = StoreSharding(store_sharding or StoreSharding.HOST)
        self._groups = CacheGroups()
        self.delayed_sync = check_bool(
            "delayed_sync", delayed_sync, "the default True syncs in the background"
        )
        self.fuse_resident = (
            None
            if fuse_resident is None
            else check_bool(
                "fuse_resident", fuse_resident, "or None (the default) to fuse where that is exact"
            )
        )
        self.device_budget_bytes = device_budget_bytes
        #: the ``planner_options`` given (a copy), kept as given: each fit's are built from them
        self.given_planner_options = _check_planner_options(planner_options)
        #: what the budget planner runs with: the given options, plus those a fit's loader settings fill in
        #: (:meth:`use_lookahead_settings`)
        self.planner_options = copy.deepcopy(self.given_planner_options)
        _check_lookahead_options(self.planner_options)
        self.cache_plan: Optional[Any] = None
        self.optimizer = optimizer
        # the optimizer the model declares on the cached tables where the sharder's ``optimizer`` replaced another
        self.overridden_optimizer: Optional[CacheOptimizerConfig] = None
        self.stores = dict(stores or {})
        self.store_dir = store_dir
        self.keep_stores = check_bool("keep_stores", keep_stores, "the default False removes the stores")
        self.store_kind = store_kind(store, store_dir, host_budget_bytes, disk_options)
        if self.store_kind is StoreKind.DISK and store_sharding == StoreSharding.HOST:
            raise ConfigError(
                "store_sharding='host' with store='disk': the disk tier is row-sharded (one row shard per rank, "
                "its host tier in that rank's memory); leave store_sharding unset or use 'row_wise'"
            )
        self.host_budget_bytes = host_budget_bytes
        self.disk_options = dict(disk_options or {})
        self._dirs = StoreDirs()
        self.seed = seed
        #: whether ``seed`` was given (else the ``torchrec`` strategy sets it to its ``init_seed`` each time)
        self.seed_given = seed is not None

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

        if self.device_budget_bytes is None:
            raise ConfigError("plan_capacity() needs device_budget_bytes")
        self.capacity, self.cache_plan = plan_capacity(
            module, sample_batches, self.device_budget_bytes, self.optimizer, self.planner_options, pinned
        )
        return self.cache_plan

    def use_lookahead_settings(self, settings: LookaheadSettings, owner: str) -> None:
        """Size the caches for the horizon, prefetch depth and policy the loader plans with (``settings``, of
        ``owner``, e.g. the ``LookaheadDataModule``), and the ``window`` policy's ``window`` and ``ways`` (into
        ``planner_options["oracle_options"]``): those ``planner_options`` leaves out are taken from ``settings``,
        and those it gives must equal them. The ``torchrec`` strategy calls it before planning, at each fit:
        :attr:`planner_options` is built from the options given (:attr:`given_planner_options`, unchanged), and
        a device budget's plan made with other options is dropped, so a sharder reused for another fit plans for
        that fit's settings.

        Raises:
            ConfigError: ``planner_options`` gives a value that differs from the loader's; the message names both.

        Example:
            >>> from torchrec_lookahead.oracle import LookaheadSettings
            >>> sharder = LookaheadEmbeddingBagCollectionSharder(device_budget_bytes=1 << 20)
            >>> sharder.use_lookahead_settings(LookaheadSettings(horizon=32), "LookaheadDataModule")
            >>> sharder.planner_options["horizon"], sharder.planner_options["policy"]
            (32, 'belady')
            >>> cdlrm = LookaheadEmbeddingBagCollectionSharder(device_budget_bytes=1 << 20)
            >>> cdlrm.use_lookahead_settings(LookaheadSettings(32, policy="window", ways=4), "LookaheadDataModule")
            >>> cdlrm.planner_options["policy"], cdlrm.planner_options["oracle_options"]
            ('window', {'ways': 4})
            >>> cdlrm.use_lookahead_settings(LookaheadSettings(16), "another LookaheadDataModule")  # reused
            >>> cdlrm.planner_options, cdlrm.given_planner_options
            ({'horizon': 16, 'prefetch_depth': 1, 'policy': 'belady'}, {})
        """
        loader: Dict[str, Union[int, str]] = {
            "horizon": settings.horizon,
            "prefetch_depth": settings.prefetch_depth,
        }
        loader["policy"] = Policy(settings.policy).value
        # built anew from the options given: a sharder reused for another fit (another DataModule, a sweep) is
        # neither refused for the last fit's values nor planned with them
        options = copy.deepcopy(self.given_planner_options)
        for key, value in loader.items():
            given = options.get(key)
            if given is None:
                options[key] = value
                continue
            if (Policy(given).value if key == "policy" else int(given)) != value:
                raise ConfigError(
                    f"planner_options {key}={given!r} of {type(self).__name__} differs from {key}={value!r} of "
                    f"{owner}: the caches would be sized for one {key} and trained with the other; state it once, "
                    f"in {owner}, and drop it from planner_options (or make the two equal)"
                )
        # the window policy's window and ways reach the planner's oracle too
        window = {k: v for k, v in (("window", settings.window), ("ways", settings.ways)) if v is not None}
        if window:
            oracle = dict(options.get("oracle_options") or {})
            for key, value in window.items():
                given = oracle.setdefault(key, value)
                if given != value:
                    raise ConfigError(
                        f"planner_options oracle_options {key}={given!r} of {type(self).__name__} differs from "
                        f"{key}={value!r} of {owner}: the caches would be sized for one {key} and trained with the "
                        f"other; state it once, in {owner}"
                    )
            options["oracle_options"] = oracle
        if (
            self.device_budget_bytes is not None
            and self.cache_plan is not None
            and options != self.planner_options
        ):
            self.capacity, self.cache_plan = {}, None  # the last plan was made for other settings: plan again
        self.planner_options = options

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        """TorchRec's kernels, and inside :func:`lookahead_planning` the cache's for data-parallel tables.

        Raises:
            ConfigError: TorchRec's own planner asks (no ``lookahead_planning``) while this sharder has tables
                to cache (``capacity``, or ``device_budget_bytes`` not planned yet).
        """
        return self.cache_kernels(
            list(super().compute_kernels(sharding_type, compute_device_type)), sharding_type
        )

    def cache_kernels(self, kernels: List[str], sharding_type: str) -> List[str]:
        """``kernels`` (TorchRec's) plus the cache's where :func:`lookahead_planning` plans a data-parallel table;
        shared with the EmbeddingCollection sibling (see :meth:`compute_kernels`)."""
        if not _PLANNING.get():
            # a budget whose plan cached nothing (every table fits it) leaves TorchRec's planner every table
            if self.capacity or (self.device_budget_bytes is not None and self.cache_plan is None):
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
            cache_layout=self.cache_layout,
        )
        if fuse:
            _copy_resident_weights(module, cache, [c.name for c in resident_cfgs])
        return ShardedLookaheadEmbeddingBagCollection(
            configs,
            resident,
            cache,
            module.is_weighted(),
            output_order=output_order(module),
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
            delayed_group=self._groups.delayed(env) if delayed else None,
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
        declared = cache_optimizer_from_module(module, cached)
        if self.optimizer is not None and declared is not None:
            if dataclasses.replace(declared, kernel=self.optimizer.kernel) != self.optimizer:
                self.overridden_optimizer = declared
                log.warning(
                    "the sharder's optimizer replaces the one the model declares on its cached tables (%s): they "
                    "train with the sharder's, unlike resident training of this model; drop one of the two",
                    optimizer_differences(self.optimizer, declared),
                )
        optimizer = self.optimizer or declared
        if optimizer is None:
            fp = dict(self.fused_params or {})
            if "optimizer" not in fp:
                raise ConfigError(
                    "No optimizer for the cached tables: declare one with apply_optimizer_in_backward, or pass "
                    "optimizer=CacheOptimizerConfig(...) to the sharder"
                )
            optimizer = cache_optimizer_from_kwargs(fp["optimizer"], fp)
        return optimizer

    def cache_stores(
        self, cfgs: List[Any], optimizer: CacheOptimizerConfig, env: ShardingEnv
    ) -> Dict[str, EmbeddingStore]:
        """The host stores of the cached tables ``cfgs`` (absent: the cache makes an in-RAM one)."""
        options = StoreOptions(
            kind=self.store_kind,
            sharding=self.store_sharding,
            stores=self.stores,
            store_dir=self.store_dir,
            keep_stores=self.keep_stores,
            host_budget_bytes=self.host_budget_bytes,
            disk_options=self.disk_options,
            seed=self.seed or 0,
        )
        return HostStores(options, self._dirs, self._groups).make(cfgs, optimizer, env)

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
        why = why_not_fusable(module, resident_cfgs, params, env, optimizer, self.fused_params)
        if why is not None and self.fuse_resident:
            raise ConfigError(
                f"fuse_resident=True, but the resident tables cannot join the cache's kernel: {why}"
            )
        if why is not None:
            log.info("resident tables stay in TorchRec's sharded module: %s", why)
        return why is None


def _check_planner_options(options: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """``planner_options`` as a dict, its keys :class:`~torchrec_lookahead.distributed.planner.LookaheadPlanner`'s
    arguments (but ``device_budget_bytes``: the sharder's own)."""
    from torchrec_lookahead.distributed.planner import LookaheadPlanner

    allowed = [p for p in inspect.signature(LookaheadPlanner).parameters if p != "device_budget_bytes"]
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ConfigError(
            f"planner_options must be a dict of LookaheadPlanner arguments {allowed} but got {options!r}"
        )
    unknown = sorted(str(k) for k in options if k not in allowed)
    if unknown:
        extra = "; give device_budget_bytes to the sharder itself" if "device_budget_bytes" in unknown else ""
        raise ConfigError(
            f"planner_options has unknown keys {unknown}; LookaheadPlanner takes {allowed}{extra}"
        )
    return dict(options)


def _check_lookahead_options(options: Mapping[str, Any]) -> None:
    """The horizon, prefetch depth and policy ``planner_options`` gives, checked as the loader checks them."""
    if "horizon" in options:
        check_int("planner_options horizon", options["horizon"], 0, "give the batches the oracle reads ahead")
    if "prefetch_depth" in options:
        check_int("planner_options prefetch_depth", options["prefetch_depth"], 0, "give 0, 1 or more steps")
    if "policy" in options:
        check_choice("planner_options policy", options["policy"], Policy)
