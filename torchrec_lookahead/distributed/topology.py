"""TorchRec's planner as this package builds it: the topology from TorchRec's ``TopologyFactory``, and the storage
reservation given the dense tensors' size.

TorchRec warns when a ``Topology`` is constructed directly (the factory validates the hardware configuration)
and when ``HeuristicalStorageReservation`` has to estimate the dense tensors' size itself (a known issue when
tensors are not materialised). :func:`make_topology` uses the factory, with the same values as a direct
``Topology`` of the same arguments; :class:`DenseEstimateStorageReservation` passes the estimate, computed as
TorchRec's heuristic computes it (six times the dense parameters' bytes, plus buffers), from tensor shapes, which
are right on the ``meta`` device too. Plans are those TorchRec's defaults give.

Example:
    >>> topology = make_topology(world_size=2, compute_device="cpu")
    >>> topology.world_size, topology.local_world_size
    (2, 2)
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Set

from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.planner.utils import sharder_name
from torchrec.distributed.types import ModuleSharder
from typing_extensions import override

__all__ = ["make_topology", "DenseEstimateStorageReservation", "sharding_planner"]

#: TorchRec's default extra storage margin of its planner (``heuristical_storage_reservation_percentage``)
RESERVED_PERCENTAGE = 0.15
#: TorchRec's heuristic for the dense part: parameter + optimizer state (~2x) + DDP buckets (~3x)
DENSE_PARAMETER_MULTIPLIER = 6.0


def make_topology(world_size: int, compute_device: str, local_world_size: Optional[int] = None) -> Topology:
    """A TorchRec ``Topology`` built through ``TopologyFactory`` (``local_world_size`` defaults to ``world_size``,
    as in ``Topology``)."""
    trainer = TrainerConfig(world_size=world_size, local_world_size=local_world_size)
    return TopologyFactory.create_topology(trainer, kernel_config=KernelConfig(compute_device=compute_device))


def _shardable_modules(module: nn.Module, sharders: List[ModuleSharder[nn.Module]]) -> Set[nn.Module]:
    """The modules the planner shards: the outermost ones a sharder handles (TorchRec's own walk)."""
    handled = {sharder_name(s.module_type) for s in sharders}
    found: Set[nn.Module] = set()

    def walk(m: nn.Module) -> None:
        if sharder_name(type(m)) in handled:
            found.add(m)
        else:
            for child in m.children():
                walk(child)

    walk(module)
    return found


def _size_bytes(module: nn.Module, multiplier: float) -> float:
    params = sum(multiplier * p.numel() * p.element_size() for p in module.parameters())
    return params + sum(b.numel() * b.element_size() for b in module.buffers())


class DenseEstimateStorageReservation(HeuristicalStorageReservation):
    """TorchRec's ``HeuristicalStorageReservation`` given the dense tensors' size (``dense_tensor_estimate``),
    computed from the module it plans as TorchRec's heuristic computes it: the reservation is the same, without
    TorchRec's warnings that the estimate may be wrong where tensors are not materialised (it is computed from
    shapes).

    Args:
        percentage: extra storage margin, as TorchRec's (default: its planner's 0.15).
    """

    def __init__(self, percentage: float = RESERVED_PERCENTAGE) -> None:
        with warnings.catch_warnings():
            # The warning recommends passing a dense_tensor_estimate, which reserve() does.
            warnings.filterwarnings("ignore", "HeuristicalStorageReservation is known", FutureWarning)
            super().__init__(percentage=percentage, parameter_multiplier=DENSE_PARAMETER_MULTIPLIER)

    @override
    def reserve(
        self,
        topology: Topology,
        batch_size: int,
        module: nn.Module,
        sharders: List[ModuleSharder[nn.Module]],
        constraints: Optional[Dict[str, ParameterConstraints]] = None,
    ) -> Topology:
        dense = _size_bytes(module, DENSE_PARAMETER_MULTIPLIER) - sum(
            _size_bytes(m, DENSE_PARAMETER_MULTIPLIER) for m in _shardable_modules(module, sharders)
        )
        # TorchRec treats an estimate of 0 as none given; a model without dense tensors reserves 1 byte.
        self._dense_tensor_estimate = max(1, round(dense))
        return super().reserve(topology, batch_size, module, sharders, constraints)


def sharding_planner(
    topology: Topology, constraints: Optional[Dict[str, ParameterConstraints]] = None
) -> EmbeddingShardingPlanner:
    """TorchRec's ``EmbeddingShardingPlanner`` with its default proposers and estimators, and the storage
    reservation given the dense estimate (:class:`DenseEstimateStorageReservation`)."""
    return EmbeddingShardingPlanner(
        topology=topology, constraints=constraints, storage_reservation=DenseEstimateStorageReservation()
    )
