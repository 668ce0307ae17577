"""The order in which resident TorchRec training returns each collection's pooled features.

With several ranks TorchRec's ``ShardedEmbeddingBagCollection`` returns its KeyedTensor's keys in shard order (per
sharding type, the table-wise tables rank by rank), which depends on where its planner puts each table. A model
that reads the KeyedTensor by position (``kt.values()``) trains on the columns in that order. The cached job plans
differently (cached tables at their cache size, then data-parallel), so, to feed such a model what resident
training feeds it, :func:`resident_plan_and_orders` plans the model as the resident job does (TorchRec's default
sharders, the strategy's constraints) and reads TorchRec's key order for each collection from that plan:
:func:`~torchrec_lookahead.distributed.lookahead_sharding_plan` keeps that plan for the collections without cached
tables (TorchRec then returns the resident order itself) and the cached collections return their keys in it.
"""

from __future__ import annotations

import copy
import logging
import weakref
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embeddingbag import (
    ShardedEmbeddingBagCollection,
    create_sharding_infos_by_sharding_device_group,
)
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingEnv, ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from torchrec_lookahead.distributed._tables import table_configs
from torchrec_lookahead.distributed.topology import sharding_planner

__all__: List[str] = []

log = logging.getLogger(__name__)

#: per unsharded EmbeddingBagCollection with cached tables: its pooled keys in resident TorchRec's order
_OUTPUT_ORDERS: weakref.WeakKeyDictionary[nn.Module, List[str]] = weakref.WeakKeyDictionary()


def set_output_order(module: nn.Module, order: Optional[List[str]]) -> None:
    """Tell the lookahead sharder the order in which resident training returns ``module``'s pooled keys (``None``:
    forget an earlier plan's)."""
    if order is None:
        _OUTPUT_ORDERS.pop(module, None)
    else:
        _OUTPUT_ORDERS[module] = list(order)


def output_order(module: nn.Module) -> Optional[List[str]]:
    """The order :func:`set_output_order` gave ``module`` (``None``: none given)."""
    return _OUTPUT_ORDERS.get(module)


def resident_plan_and_orders(
    module: nn.Module,
    topology: Topology,
    constraints: Mapping[str, ParameterConstraints],
    compute_kernel: Optional[str],
    sharding_types: Sequence[str],
    pg: Optional[dist.ProcessGroup],
) -> Optional[Tuple[ShardingPlan, Dict[str, List[str]]]]:
    """The plan TorchRecStrategy's resident job makes of ``module`` and, per EmbeddingBagCollection (by module
    path), the keys its sharded module returns, in order; ``None`` where TorchRec's planner cannot place the
    tables whole (the tables the cache makes trainable: there is no resident job to match)."""
    cons = dict(constraints)
    if compute_kernel is not None:
        for m in module.modules():  # every table, as TorchRecStrategy constrains the resident job's
            if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection)):
                for c in table_configs(m):
                    cons.setdefault(
                        c.name,
                        ParameterConstraints(
                            sharding_types=list(sharding_types), compute_kernels=[compute_kernel]
                        ),
                    )
    planner = sharding_planner(topology, cons)
    quiet = logging.getLogger("torchrec.distributed.planner")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # a resident plan that does not fit is expected, not an error
    try:
        # Planned on rank 0 and broadcast, failure included: TorchRec's collective_plan raises on rank 0 only,
        # and a failure kept from the others would leave them waiting for the plan (their collectives out of step).
        plan: Optional[ShardingPlan] = None
        if pg is None or dist.get_rank(pg) == 0:
            try:
                plan = planner.plan(module, get_default_sharders())
            except Exception as e:  # noqa: BLE001 - any planner failure: keep the cached job's own plan and order
                log.debug("no resident plan to order the pooled features by: %s", e)
        if pg is not None and dist.get_world_size(pg) > 1:
            box = [plan]
            dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
            plan = box[0]
    finally:
        quiet.setLevel(level)
    if plan is None:
        return None
    try:
        return plan, _orders(
            module, plan, ShardingEnv(topology.world_size, dist.get_rank(pg) if pg else 0, pg)
        )
    except Exception as e:  # noqa: BLE001 - TorchRec's sharding classes change between releases: keep our order
        log.debug("no resident order of the pooled features: %s", e)
        return None


def _orders(module: nn.Module, plan: ShardingPlan, env: ShardingEnv) -> Dict[str, List[str]]:
    """Per EmbeddingBagCollection of ``plan`` (by module path), the keys TorchRec's sharded module returns."""
    orders: Dict[str, List[str]] = {}
    for path, module_plan in plan.plan.items():
        ebc = module.get_submodule(path)
        if not isinstance(ebc, EmbeddingBagCollection) or not isinstance(
            module_plan, EmbeddingModuleShardingPlan
        ):
            continue
        infos = create_sharding_infos_by_sharding_device_group(
            ebc, copy.deepcopy(dict(module_plan)), "embedding_bags.", None
        )
        names: List[str] = []
        for group in infos.values():
            sharding = ShardedEmbeddingBagCollection.create_embedding_bag_sharding(
                group, env, torch.device("meta"), permute_embeddings=True
            )
            names.extend(sharding.embedding_names())
        orders[path] = names
    return orders
