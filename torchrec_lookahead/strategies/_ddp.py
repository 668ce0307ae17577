"""DDP around the dense part of a ``DistributedModelParallel`` model, with DDP's current buffer arguments.

TorchRec's ``DefaultDataParallelWrapper`` builds DDP with ``broadcast_buffers=False``, which torch deprecates for
``forward_sync_buffers`` (with a warning on every run). The two differ at construction: ``forward_sync_buffers=False``
still broadcasts buffers from rank 0 once, and the sharded modules' buffers (the embedding kernels' rows and
optimizer state, the caches' slots) are rank-local. :class:`DenseDataParallelWrapper` therefore gives DDP the
sharded modules' buffers to ignore, besides their parameters: the dense buffers start equal on every rank (as
the dense parameters do), the sharded ones are left alone, and no buffer is synchronised in forward, as before.
"""

from __future__ import annotations

from typing import Iterator, Set

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.types import ShardedModule, ShardingEnv
from typing_extensions import override

from torchrec_lookahead._compat import ddp_no_buffer_sync
from torchrec_lookahead.errors import SetupError

__all__ = ["DenseDataParallelWrapper", "sharded_buffer_names"]


def sharded_buffer_names(module: nn.Module) -> Iterator[str]:
    """The names (as ``module.named_buffers()`` gives them) of the buffers inside ``module``'s sharded modules."""
    prefixes = [f"{name}." for name, m in module.named_modules() if isinstance(m, ShardedModule) and name]
    for name, _ in module.named_buffers():
        if any(name.startswith(p) for p in prefixes):
            yield name


class DenseDataParallelWrapper(DefaultDataParallelWrapper):
    """TorchRec's default data-parallel wrapper (DDP over the unsharded modules), building DDP with
    ``forward_sync_buffers=False`` and the sharded modules' buffers ignored (see the module docstring)."""

    @override
    def _ddp_wrap(
        self,
        dmp: DistributedModelParallel,
        env: ShardingEnv,
        device: torch.device,
        ddp_ignore_param_names: Set[str],
    ) -> None:
        pg = env.process_group
        if pg is None:
            raise SetupError(
                "DDP over the dense layers needs a process group (ShardingEnv.from_process_group)"
            )
        module = dmp._dmp_wrapped_module
        if not set(dict(dmp.named_parameters())) - ddp_ignore_param_names:
            return
        ignored = set(ddp_ignore_param_names) | set(sharded_buffer_names(module))
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            module=module, params_and_buffers_to_ignore=list(ignored)
        )
        if self._allreduce_comm_precision in ("fp16", "bf16"):
            raise SetupError(
                "allreduce_comm_precision is not supported by this wrapper; use TorchRec's default"
            )
        dmp._dmp_wrapped_module = DistributedDataParallel(
            module=module.to(device),
            device_ids=None if device.type == "cpu" else [device],
            process_group=pg,
            gradient_as_bucket_view=True,
            **ddp_no_buffer_sync(),  # forward_sync_buffers=False (torch 2.11: broadcast_buffers=False)
            static_graph=self._static_graph,
            find_unused_parameters=self._find_unused_parameters,
            bucket_cap_mb=self._bucket_cap_mb,
            **self._ddp_kwargs,
        )
