"""The process groups the lookahead cache makes: every ``dist.new_group`` of the sharder, in one object it holds.

``new_group`` is a collective of the whole job: every rank must create the same groups in the same order.
Sharding runs identically on every rank, so creating each group at its first use, once, keeps that order.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch.distributed as dist
from torchrec.distributed.types import ShardingEnv

from torchrec_lookahead.store.channels import STAGE_CHANNEL

__all__ = ["CacheGroups"]


class CacheGroups:
    """The cache's process groups of one sharder, each created once, at its first use."""

    def __init__(self) -> None:
        self._delayed: Dict[Tuple[int, ...], Any] = {}
        self._stores: Optional[Dict[str, Any]] = None

    def delayed(self, env: ShardingEnv) -> Any:
        """The process group of delayed synchronisation: one per set of ranks, created once (by every rank,
        in the same order, as sharding runs identically on every rank) with the backend of ``env``'s group."""
        pg = env.process_group
        ranks = tuple(dist.get_process_group_ranks(pg)) if pg is not None else tuple(range(env.world_size))
        if ranks not in self._delayed:
            backend = dist.get_backend(pg) if pg is not None else dist.get_backend()
            self._delayed[ranks] = dist.new_group(ranks=list(ranks), backend=backend)
        return self._delayed[ranks]

    def stores(self) -> Dict[str, Any]:
        """The sharded stores' process groups (created once, in the same order on every rank): the default
        one for the training thread, one for the lookahead stager's gathers. gloo: rows are CPU tensors."""
        if self._stores is None:
            self._stores = {
                "default": dist.new_group(backend="gloo"),
                STAGE_CHANNEL: dist.new_group(backend="gloo"),
            }
        return self._stores
