"""Sharding plans with cached tables: TorchRec's planner places the resident tables; cached tables become
data-parallel ``CUSTOMIZED_KERNEL`` entries that :class:`LookaheadEmbeddingBagCollectionSharder` builds."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ParameterSharding,
    ShardingPlan,
)
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    EmbeddingBagCollectionInterface,
    EmbeddingCollection,
    EmbeddingCollectionInterface,
)

from torchrec_lookahead.distributed._resident_order import resident_plan_and_orders, set_output_order
from torchrec_lookahead.distributed._tables import copy_in_backward_optimizers, table_configs
from torchrec_lookahead.distributed.ec_sharder import LookaheadEmbeddingCollectionSharder
from torchrec_lookahead.distributed.sharded_collection import CUSTOMIZED
from torchrec_lookahead.distributed.sharder import LookaheadEmbeddingBagCollectionSharder, lookahead_planning
from torchrec_lookahead.distributed.topology import sharding_planner
from torchrec_lookahead.errors import ConfigError, SetupError, first_line

__all__ = ["lookahead_sharding_plan", "embedding_tables", "with_default_sharders", "check_all_sharded"]


def with_default_sharders(sharders: Sequence[ModuleSharder[nn.Module]]) -> List[ModuleSharder[nn.Module]]:
    """``sharders`` followed by TorchRec's default sharder of every module type none of them handles.

    ``DistributedModelParallel(sharders=[...])`` shards only the module types of the sharders it is given: a
    list holding just the lookahead sharder would leave an ``EmbeddingCollection`` (or any other embedding
    module) unsharded. Sharders given first win for their module type. A lookahead EBC sharder brings its
    :class:`~torchrec_lookahead.distributed.LookaheadEmbeddingCollectionSharder` sibling (same capacities,
    stores and optimizer), so its capacity can name ``EmbeddingCollection`` tables too.

    Example:
        >>> from torchrec.modules.embedding_modules import EmbeddingCollection
        >>> from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
        >>> sharders = with_default_sharders([LookaheadEmbeddingBagCollectionSharder(capacity={"t": 64})])
        >>> type(sharders[0]).__name__
        'LookaheadEmbeddingBagCollectionSharder'
        >>> [type(s).__name__ for s in sharders if s.module_type is EmbeddingCollection]  # sharing its config
        ['LookaheadEmbeddingCollectionSharder']
        >>> sum(s.module_type is EmbeddingBagCollection for s in sharders)  # TorchRec's EBC sharder not added
        1
    """
    out = list(sharders)
    given = {s.module_type for s in out}
    if EmbeddingCollection not in given:  # the lookahead EBC sharder's sibling caches EmbeddingCollections
        source = next((s for s in out if isinstance(s, LookaheadEmbeddingBagCollectionSharder)), None)
        if source is not None:
            out.append(LookaheadEmbeddingCollectionSharder(source))
            given.add(EmbeddingCollection)
    return out + [d for d in get_default_sharders() if d.module_type not in given]


def check_all_sharded(module: nn.Module) -> None:
    """Refuse a model in which ``DistributedModelParallel`` left an embedding module unsharded.

    An unsharded collection would still train, but outside TorchRec's sharded kernels and fused optimizers:
    silently different from the resident job.

    Raises:
        ConfigError: names every unsharded embedding module and its type.
    """
    root = module.module if isinstance(module, DistributedModelParallel) else module
    left = [
        f"{name or '<root>'} ({type(m).__name__})"
        for name, m in root.named_modules()
        if isinstance(m, (EmbeddingBagCollectionInterface, EmbeddingCollectionInterface))
    ]
    if left:
        raise ConfigError(
            f"embedding module(s) {left} were left unsharded: no sharder handles their type. Pass a sharder for "
            "each type, or build the list with torchrec_lookahead.distributed.with_default_sharders([...]) to "
            "keep TorchRec's default sharders beside the lookahead one"
        )


def embedding_tables(module: nn.Module) -> List[str]:
    """Names of every table of every EmbeddingBagCollection and EmbeddingCollection in ``module``."""
    return [c.name for c in embedding_table_configs(module)]


def embedding_table_configs(module: nn.Module) -> List[BaseEmbeddingConfig]:
    """The table configs of every EmbeddingBagCollection and EmbeddingCollection in ``module``, in module order
    (list them before ``DistributedModelParallel`` replaces the collections)."""
    return [c for m in module.modules() if isinstance(m, _COLLECTIONS) for c in table_configs(m)]


_COLLECTIONS = (EmbeddingBagCollection, EmbeddingCollection)


def check_cached_features_unshared(module: nn.Module, cached: Mapping[str, int]) -> None:
    """Refuse a feature that a cached table reads beside another table: the lookahead loader replaces a cached
    table's feature values by cache slots in the batch, which every other reader of the feature would then read
    as ids (wide & deep models with one ``item`` feature in two collections).

    Raises:
        ConfigError: such a feature; the message names it and its tables.

    Example:
        >>> from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
        >>> def ebc(name):
        ...     table = EmbeddingBagConfig(name=name, embedding_dim=4, num_embeddings=10, feature_names=["item"])
        ...     return EmbeddingBagCollection(tables=[table], device=torch.device("meta"))
        >>> check_cached_features_unshared(nn.ModuleList([ebc("deep"), ebc("wide")]), {"deep": 5})
        Traceback (most recent call last):
        ...
        torchrec_lookahead.errors.ConfigError: feature 'item' is read by the cached table 'deep' and by ['wide']: ...
    """
    readers: Dict[str, List[str]] = {}
    for m in module.modules():
        if isinstance(m, _COLLECTIONS):
            for c in table_configs(m):
                for f in c.feature_names or [c.name]:
                    readers.setdefault(f, []).append(c.name)
    for f, names in readers.items():
        first = next((t for t in names if t in cached), None)
        if first is None or len(names) == 1:
            continue
        others = list(names)
        others.remove(first)
        raise ConfigError(
            f"feature {f!r} is read by the cached table {first!r} and by {others}: the cache hands a cached "
            "table's feature to the model as cache slots, which the other tables would read as ids; give each "
            f"of them a feature of its own (a copy of {f!r} under another key in the batch), or keep "
            f"{[t for t in names if t in cached]} resident"
        )


def _cache_sized(module: nn.Module, cached: Mapping[str, int]) -> nn.Module:
    tables = [
        dataclasses.replace(c, num_embeddings=min(int(cached[c.name]), c.num_embeddings))
        if c.name in cached
        else c
        for c in table_configs(module)
    ]
    meta = torch.device("meta")
    proxy: nn.Module
    if isinstance(module, EmbeddingBagCollection):
        proxy = EmbeddingBagCollection(tables=tables, is_weighted=module.is_weighted(), device=meta)
    else:
        proxy = EmbeddingCollection(tables=tables, device=meta, need_indices=module.need_indices())  # type: ignore[operator]
    copy_in_backward_optimizers(module, proxy, [c.name for c in tables])
    return proxy


def _with_cache_sized_tables(
    module: nn.Module, cached: Mapping[str, int]
) -> Tuple[nn.Module, Callable[[], None]]:
    """``module`` with every collection holding cached tables swapped for one whose cached tables have
    ``capacity`` rows, and the function that swaps the originals back."""
    if isinstance(module, _COLLECTIONS):
        return _cache_sized(module, cached), lambda: None
    swaps = []
    for parent in list(module.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, _COLLECTIONS) and any(c.name in cached for c in table_configs(child)):
                setattr(parent, child_name, _cache_sized(child, cached))
                swaps.append((parent, child_name, child))

    def restore() -> None:
        for parent, child_name, child in swaps:
            setattr(parent, child_name, child)

    return module, restore


def _check_fused_dims(
    module: nn.Module, cached: Mapping[str, int], cons: Mapping[str, ParameterConstraints]
) -> None:
    """Refuse a resident table that only FBGEMM's fused kernels may train and whose dimension they cannot take
    (TorchRec asserts it while sharding, a raw ``AssertionError``); the cache checks its own tables."""
    for c in embedding_table_configs(module):
        kernels = cons[c.name].compute_kernels if c.name in cons else None
        if c.name in cached or not kernels or c.embedding_dim % 4 == 0:
            continue
        if all(str(getattr(k, "value", k)).startswith("fused") for k in kernels):
            raise ConfigError(
                f"table '{c.name}' has embedding_dim {c.embedding_dim}; FBGEMM's kernel needs a multiple of 4: use "
                f"{-(-c.embedding_dim // 4) * 4}"
            )


def _plan(planner: Any, module: nn.Module, sharders: List[ModuleSharder[nn.Module]]) -> ShardingPlan:
    """``planner.plan``, its failure to place the tables (TorchRec's ``PlannerError``, a 20-line report) as one
    :class:`ConfigError` line: what does not fit, and what to do."""
    try:
        return planner.plan(module, sharders)
    except PlannerError as e:
        text = str(e)
        table = re.search(r"of table (\S+?),", text)
        need = re.search(r"storage requirement for model parallel: Storage\(([^)]*)\)", text)
        have = re.search(r"storage available for model parallel: Storage\(([^)]*)\)", text)
        detail = f"; table {table.group(1)!r} fits on no rank" if table else ""
        if need and have:
            detail += f"; the tables need {need.group(1)}, the ranks have {have.group(1)}"
        why = first_line(e, 200).rstrip(" .")
        raise ConfigError(
            f"TorchRec's planner could not place the tables ({why}{detail}): cache the largest tables (the "
            "lookahead sharder's capacity or device_budget_bytes) or give the job more devices or memory"
        ) from e


def collective_plan(
    planner: Any, module: nn.Module, sharders: List[ModuleSharder[nn.Module]], pg: Optional[dist.ProcessGroup]
) -> ShardingPlan:
    """TorchRec's ``collective_plan`` (planned on rank 0, broadcast), whose failure reaches every rank: TorchRec's
    raises on rank 0 only and leaves the others waiting for the plan's broadcast (a hang until the process
    group's timeout). ``pg``: the ranks' group (``None``: the default group).

    Raises:
        SetupError: on the other ranks, rank 0's planner failed (rank 0 raises the planner's own error).
    """
    if dist.get_world_size(pg) == 1:
        return _plan(planner, module, sharders)
    box: List[Any] = [None]
    error: Optional[Exception] = None
    if dist.get_rank(pg) == 0:
        try:
            box[0] = _plan(planner, module, sharders)
        except Exception as e:  # noqa: BLE001 - broadcast, then raised here as it is
            error, box[0] = e, f"{type(e).__name__}: {first_line(e, 300)}"
    dist.broadcast_object_list(box, src=0 if pg is None else dist.get_global_rank(pg, 0), group=pg)
    if error is not None:
        raise error
    if isinstance(box[0], str):
        raise SetupError(
            f"rank 0 could not plan the sharding ({box[0]}); see rank 0's error for what to change"
        )
    return box[0]


def _follow_resident_order(
    plan: ShardingPlan,
    module: nn.Module,
    cached: Mapping[str, int],
    topology: Topology,
    constraints: Mapping[str, ParameterConstraints],
    compute_kernel: Optional[str],
    sharding_types: Sequence[str],
    pg: Optional[dist.ProcessGroup],
) -> None:
    """With several ranks, have every EmbeddingBagCollection return its keys in the order resident training's
    does (a model may read them by position): the collections without cached tables take the resident job's
    placement, the cached ones are told the resident order (``distributed/_resident_order.py``)."""
    found = resident_plan_and_orders(module, topology, constraints, compute_kernel, sharding_types, pg)
    if found is None:
        return
    resident_plan, orders = found
    for path, module_plan in resident_plan.plan.items():
        sub = module.get_submodule(path)
        if not isinstance(sub, EmbeddingBagCollection) or path not in orders:
            continue
        if any(c.name in cached for c in sub.embedding_bag_configs()):
            set_output_order(sub, orders[path])
        elif path in plan.plan:
            plan.plan[path] = module_plan


def lookahead_sharding_plan(
    module: nn.Module,
    sharders: List[ModuleSharder[nn.Module]],
    cached: Mapping[str, int],
    topology: Topology,
    constraints: Optional[Dict[str, ParameterConstraints]] = None,
    compute_kernel: Optional[str] = "fused",
    sharding_types: Optional[List[str]] = None,
    pg: Optional[dist.ProcessGroup] = None,
) -> ShardingPlan:
    """A TorchRec sharding plan in which the tables of ``cached`` use the lookahead cache.

    TorchRec's planner places every table (cached ones as cheap table-wise placeholders); the cached tables'
    entries are then replaced by data-parallel ``CUSTOMIZED_KERNEL`` shardings on every rank.

    Raises:
        ConfigError: ``cached`` or ``constraints`` name a table the model does not have, or a capacity exceeds
            its table's rows.
    """
    tables = embedding_tables(module)
    unknown = sorted(set(cached) - set(tables)) + sorted(set(constraints or {}) - set(tables))
    if unknown:
        raise ConfigError(f"Unknown table(s) {unknown}; the model's tables are {tables}")
    rows = {c.name: int(c.num_embeddings) for c in embedding_table_configs(module)}
    over = sorted(t for t, c in cached.items() if int(c) > rows[t])
    if over:
        t = over[0]
        raise ConfigError(
            f"capacity of table {t!r} is {int(cached[t]):,} rows but the table has {rows[t]:,}; give at most "
            f"{rows[t]:,} (a cache of the whole table), or leave the table out of capacity to keep it resident"
        )
    check_cached_features_unshared(module, cached)
    cons = dict(constraints or {})
    free = sorted(t for t in tables if t not in cached and t not in cons)
    if (
        compute_kernel is None and free
    ):  # TorchRec's estimators cannot price the lookahead sharder's own kernel
        raise ConfigError(
            f"compute_kernel: null (TorchRec's planner choosing the kernels) cannot plan the resident tables "
            f"{free[:5]}{' ...' if len(free) > 5 else ''} beside cached ones; set compute_kernel (fused, the "
            "default), or give those tables constraints"
        )
    types = list(sharding_types or ["table_wise", "row_wise"])
    for t in tables:
        if t in cached:
            cons[t] = ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
        elif compute_kernel is not None:
            cons.setdefault(t, ParameterConstraints(sharding_types=types, compute_kernels=[compute_kernel]))
    _check_fused_dims(module, cached, cons)
    planner = sharding_planner(topology, cons)
    # TorchRec's planner sees cached tables at their cache size: a cached table may be far larger than any
    # device (that is the point), and only `capacity` rows of it will ever be on one.
    target, restore = _with_cache_sized_tables(module, cached)
    try:
        with lookahead_planning():
            if pg is not None:
                plan = collective_plan(planner, target, sharders, pg)
            else:
                plan = _plan(planner, target, sharders)
    finally:
        restore()
    for m in module.modules():  # an order left by an earlier plan of the module
        set_output_order(m, None)
    if topology.world_size > 1:
        _follow_resident_order(plan, module, cached, topology, constraints or {}, compute_kernel, types, pg)
    ranks = list(range(topology.world_size))
    for module_plan in plan.plan.values():
        if not isinstance(module_plan, EmbeddingModuleShardingPlan):
            continue
        for name in list(module_plan.keys()):
            if name in cached:
                module_plan[name] = ParameterSharding(
                    sharding_type="data_parallel", compute_kernel=CUSTOMIZED, ranks=ranks
                )
    return plan
