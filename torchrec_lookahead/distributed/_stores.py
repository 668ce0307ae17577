"""The host stores of the cached tables, made from the sharder's store options: one store per table on one
rank (in RAM, a memory-mapped file or a disk store), and on several ranks one store per host shared by its
ranks or row shards reached with collectives (the sharder's ``store_sharding``)."""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torchrec.distributed.types import ShardingEnv

from torchrec_lookahead._checks import check_int
from torchrec_lookahead.distributed._groups import CacheGroups
from torchrec_lookahead.distributed._store_dirs import StoreDirs
from torchrec_lookahead.errors import CapacityError, ConfigError
from torchrec_lookahead.modules import CacheOptimizerConfig
from torchrec_lookahead.store import DiskStore, MmapStore, RowShardedStore, TensorStore, row_bounds
from torchrec_lookahead.store.channels import STAGE_CHANNEL
from torchrec_lookahead.store.disk_store import check_host_policy
from torchrec_lookahead.store.sharded_store import EmptyShardStore
from torchrec_lookahead.store.types import EmbeddingStore

__all__ = [
    "StoreSharding",
    "STORE_SHARDINGS",
    "StoreKind",
    "STORE_KINDS",
    "StoreOptions",
    "HostStores",
    "store_kind",
    "HostSharedStore",
]


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


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    """The sharder's host-store options, as they are when the stores are made (see
    :class:`~torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder`)."""

    kind: StoreKind
    sharding: StoreSharding
    stores: Mapping[str, EmbeddingStore]
    store_dir: Optional[str]
    keep_stores: bool
    host_budget_bytes: Optional[Union[int, Dict[str, int]]]
    disk_options: Mapping[str, Any]
    seed: int


class HostStores:
    """Makes the host stores of one collection's cached tables.

    Args:
        options: the sharder's store options.
        dirs: the sharder's store directories (one run directory, owner locks).
        groups: the sharder's process groups (the row-sharded stores').
    """

    def __init__(self, options: StoreOptions, dirs: StoreDirs, groups: CacheGroups) -> None:
        self.options = options
        self.dirs = dirs
        self.groups = groups

    def make(
        self, cfgs: List[Any], optimizer: CacheOptimizerConfig, env: ShardingEnv
    ) -> Dict[str, EmbeddingStore]:
        """The host stores of the cached tables ``cfgs`` (absent: the cache makes an in-RAM one)."""
        if env.world_size > 1:
            # LRPP: one shared host store per table. The kernel is the one-rank kernel (FBGEMM's where it has
            # the optimizer): its backward runs over the exchange batch (distributed/exact_sync.py).
            return self._shared_stores(cfgs, optimizer, env)
        budgets = self._host_budgets({c.name: c.num_embeddings * row_bytes(c, optimizer) for c in cfgs})
        return {c.name: s for c in cfgs if (s := self._store(c, optimizer, budgets[c.name])) is not None}

    def _store(
        self, cfg: Any, optimizer: CacheOptimizerConfig, host_budget: Tuple[int, Tuple[int, int]]
    ) -> Optional[EmbeddingStore]:
        """The one-rank store of table ``cfg`` (``None``: the cache makes an in-RAM one)."""
        if cfg.name in self.options.stores:
            return self.options.stores[cfg.name]
        if self.options.kind is StoreKind.RAM:
            return None
        run_dir = self.dirs.run_dir(self.options.store_dir, keep=self.options.keep_stores)
        if self.options.kind is StoreKind.DISK:
            return self._disk_store(os.path.join(run_dir, f"{cfg.name}.rows"), cfg, optimizer, host_budget)
        return MmapStore(
            os.path.join(run_dir, f"{cfg.name}.bin"),
            cfg.num_embeddings,
            cfg.embedding_dim,
            optimizer.state_widths(cfg.embedding_dim),
            name=cfg.name,
            seed=self.options.seed,
        )

    def _host_budgets(self, table_bytes: Dict[str, int]) -> Dict[str, Tuple[int, Tuple[int, int]]]:
        """Each table's share of ``host_budget_bytes`` (0 unless ``store="disk"``), with how one int is split
        (``(total, share)`` of the tables' bytes; ``(0, 0)`` where the budget is per table), for messages."""
        budget = self.options.host_budget_bytes
        if self.options.kind is not StoreKind.DISK or budget is None:
            return dict.fromkeys(table_bytes, (0, (0, 0)))
        if isinstance(budget, dict):
            missing = sorted(set(table_bytes) - set(budget))
            if missing:
                raise ConfigError(
                    f"host_budget_bytes gives no budget to the cached tables {missing}; give every cached table "
                    "one, or one int for all"
                )
            return {t: (int(budget[t]), (0, 0)) for t in table_bytes}
        total = max(1, sum(table_bytes.values()))
        return {t: (int(budget) * b // total, (total, b)) for t, b in table_bytes.items()}

    def _disk_store(
        self,
        path: str,
        cfg: Any,
        optimizer: CacheOptimizerConfig,
        budget: Tuple[int, Tuple[int, int]],
        rows: Optional[Tuple[int, int]] = None,
    ) -> DiskStore:
        """A disk store of table ``cfg`` (of its rows ``[lo, hi)`` when ``rows`` is given) with ``budget`` (its
        share of ``host_budget_bytes`` and how one int is split: :meth:`_host_budgets`)."""
        host_budget, split = budget
        lo, hi = rows or (0, cfg.num_embeddings)
        widths = optimizer.state_widths(cfg.embedding_dim)
        one_row = row_bytes(cfg, optimizer)
        if host_budget < one_row:
            raise CapacityError(
                f"the host tier of table '{cfg.name}' gets {host_budget:,} bytes of host_budget_bytes="
                f"{self.options.host_budget_bytes}, below one row ({one_row} bytes); raise host_budget_bytes"
                + (
                    f" to at least {-(-one_row * split[0] // split[1]):,} (one int is split by table size)"
                    if split[1]
                    else ""
                ),
                table=cfg.name,
                needed=1,
                available=0,
                tier="host",
            )
        return DiskStore(
            path,
            hi - lo,
            cfg.embedding_dim,
            widths,
            name=cfg.name,
            seed=self.options.seed,
            host_budget_bytes=host_budget,
            budget_split=split,
            row_offset=lo,
            table_rows=cfg.num_embeddings,
            **self.options.disk_options,
        )

    def _shared_stores(
        self, cfgs: List[Any], optimizer: CacheOptimizerConfig, env: ShardingEnv
    ) -> Dict[str, EmbeddingStore]:
        """The host stores of a multi-rank job (see ``store_sharding``): one memory-mapped store per table
        shared by the ranks of the host, or row shards reached with collectives."""
        if self.options.stores:  # checked on every rank, before any collective
            raise ConfigError("explicit stores= are not supported with several ranks; use store_dir=")
        local = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
        if self.options.sharding is StoreSharding.ROW_WISE or self.options.kind is StoreKind.DISK:
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
            base = _shared_memory_dir(self.options.store_dir)
            holder[0] = self.dirs.new(
                base, "", keep=self.options.keep_stores and self.options.store_dir is not None
            )
        dist.broadcast_object_list(holder, src=0, group=pg)
        directory = str(holder[0])
        stores: Dict[str, EmbeddingStore] = {}
        for c in cfgs:
            path = os.path.join(directory, f"{c.name}.bin")
            if env.rank == 0:
                store = HostSharedStore(
                    path,
                    c.num_embeddings,
                    c.embedding_dim,
                    optimizer.state_widths(c.embedding_dim),
                    name=c.name,
                    seed=self.options.seed,
                )
                stores[c.name] = _initialised(store)
        dist.barrier(group=pg)
        if env.rank != 0:
            for c in cfgs:
                stores[c.name] = HostSharedStore.open(os.path.join(directory, f"{c.name}.bin"))
        return stores

    def _sharded_stores(
        self, cfgs: List[Any], optimizer: CacheOptimizerConfig, env: ShardingEnv, shard_of_rank: List[int]
    ) -> Dict[str, EmbeddingStore]:
        """Row shards: shard ``shard_of_rank[r]`` is served by rank ``r``. A shard served by one rank lives in
        its memory (a memory-mapped file under ``store_dir`` when given); a shard served by several ranks (one
        per host) in a memory-mapped file the first of them creates under ``store_dir``, else ``/dev/shm``."""
        pg = env.process_group
        groups = self.groups.stores()
        num_shards = max(shard_of_rank) + 1
        shard = shard_of_rank[env.rank]
        servers = [r for r, s in enumerate(shard_of_rank) if s == shard]
        shared = len(servers) > 1
        creator = env.rank == servers[0]
        seed = self.options.seed
        directory: Optional[str] = None
        disk = self.options.kind is StoreKind.DISK
        if creator and (shared or self.options.store_dir is not None or disk):
            base = self.options.store_dir if disk else _shared_memory_dir(self.options.store_dir)
            keep = self.options.keep_stores and self.options.store_dir is not None
            directory = self.dirs.new(base, f"shard{shard}_", keep=keep)
        locals_: Dict[str, EmbeddingStore] = {}
        bounds = {c.name: row_bounds(c.num_embeddings, num_shards)[shard : shard + 2] for c in cfgs}
        budgets = self._host_budgets(
            {c.name: (bounds[c.name][1] - bounds[c.name][0]) * row_bytes(c, optimizer) for c in cfgs}
        )
        for c in cfgs:
            lo, hi = bounds[c.name]
            widths = optimizer.state_widths(c.embedding_dim)
            if hi == lo:  # fewer rows than shards: this shard is empty, no id is ever routed to it
                locals_[c.name] = EmptyShardStore(c.name, c.embedding_dim, widths, keeps_files=disk)
            elif disk and directory is not None:
                path = os.path.join(directory, f"{c.name}.rows")
                locals_[c.name] = self._disk_store(path, c, optimizer, budgets[c.name], (lo, hi))
            elif directory is not None:
                path = os.path.join(directory, f"{c.name}.bin")
                store = MmapStore(path, hi - lo, c.embedding_dim, widths, **_shard_of(c, seed, lo))
                locals_[c.name] = _initialised(store) if shared else store
            elif not shared:
                locals_[c.name] = TensorStore(hi - lo, c.embedding_dim, widths, **_shard_of(c, seed, lo))
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
            stores[c.name] = sharded
        return stores


class HostSharedStore(MmapStore):
    """A memory-mapped store the ranks of one host share (``store_sharding: host`` on one host); each rank writes
    the rows the sharded collection names (see ``CachedCollection.share_stores``).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     store = HostSharedStore(os.path.join(d, "t.bin"), 4, 2, {}, name="t")
        ...     store.keep_files()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        torchrec_lookahead.errors.ConfigError: table 't' is in a store the ranks of this host share; ...
    """

    def keep_files(self) -> None:
        """Refused: checkpoint pieces are one rank's rows.

        Raises:
            ConfigError: always.
        """
        raise ConfigError(
            f"table '{self.name}' is in a store the ranks of this host share; checkpoints keep in-memory "
            "tables as pieces with one row shard per rank (store_sharding: row_wise)"
        )


def _initialised(store: MmapStore) -> MmapStore:
    """``store`` with every chunk initialised and flushed: what the other ranks of the host open must hold the
    initial values already."""
    for lo in range(0, store.num_embeddings, 1 << 16):
        store.gather(torch.arange(lo, min(lo + (1 << 16), store.num_embeddings)))
    store.flush()
    return store


def _shared_memory_dir(store_dir: Optional[str]) -> Optional[str]:
    """Where store files the ranks of a host share go: ``store_dir``, else ``/dev/shm`` where there is one
    (else the temp directory)."""
    return store_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)


def row_bytes(cfg: Any, optimizer: CacheOptimizerConfig) -> int:
    """Bytes of one stored row of table ``cfg``: weight and optimizer state, float32."""
    return 4 * (cfg.embedding_dim + sum(optimizer.state_widths(cfg.embedding_dim).values()))


def store_kind(
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
        if "io_threads" in opts:
            check_int("disk_options io_threads", opts["io_threads"], 1, "give the threads issuing disk reads")
        check_host_policy(opts.get("host_policy", "lru"), opts.get("disk_prefetch_depth", 0))
        for flag, allowed in (("direct_io", (True, False, None)), ("preallocate", (True, False))):
            if flag in opts and not any(opts[flag] is a for a in allowed):
                names = ", ".join("null" if a is None else str(a).lower() for a in allowed)
                raise ConfigError(f"disk_options {flag} must be one of {names} but got {opts[flag]!r}")
        if opts.get("disk_prefetch_depth", 0) and opts.get("host_policy", "lru") != "lookahead":
            raise ConfigError(
                "disk_options disk_prefetch_depth reads rows ahead under host_policy: lookahead only, but "
                f"host_policy is {opts.get('host_policy', 'lru')!r}; set host_policy: lookahead or drop it"
            )
    return kind


def _shard_of(config: Any, seed: int, row_offset: int) -> Dict[str, Any]:
    """The keyword arguments that place a row shard's store in its table (name, seed, first row, table rows)."""
    return {"name": config.name, "seed": seed, "row_offset": row_offset, "table_rows": config.num_embeddings}
