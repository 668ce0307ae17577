"""The cache's in-backward optimizer as TorchRec's optimizers see it (:class:`CacheFusedOptimizer`), and the fused
optimizers of a module's TorchRec submodules (:func:`fused_optimizers`)."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
from torch import nn
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.optim.fused import FusedOptimizer, FusedOptimizerModule
from torchrec.optim.keyed import KeyedOptimizer

from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.modules import CachedCollection

__all__ = ["CacheFusedOptimizer", "fused_optimizers"]


class CacheFusedOptimizer(FusedOptimizer):
    """The cache's in-backward optimizer as TorchRec's optimizers see it: one parameter group whose ``lr`` is
    handed to the cache's kernels on ``zero_grad()`` and ``step()``, exactly as TorchRec's fused optimizer hands
    its group's ``lr`` to its TBE, so a learning-rate scheduler acting on the model's ``fused_optimizer`` (or on
    an optimizer combining it, as ``DLRMModule.configure_optimizers`` builds) schedules the cached tables too.

    It owns no optimizer state: the rows and their state live in the cache and its stores (and in the module's
    state dict), so checkpoints keep their keys. Its group holds one empty placeholder tensor, keyed
    ``learning_rate``, so that TorchRec can tell the groups of several such optimizers apart when it saves and
    restores parameter groups (it matches groups by their parameters' keys).

    Args:
        cache: the cached collection.
    """

    def __init__(self, cache: CachedCollection[BaseEmbeddingConfig, object]) -> None:
        self._cache = cache
        anchor = torch.empty(0)
        super().__init__({"learning_rate": anchor}, {}, [{"params": [anchor], "lr": cache.learning_rate}])

    def _push(self) -> None:
        lr = list(self.param_groups)[0]["lr"]
        if lr != self._cache.learning_rate:
            self._cache.set_learning_rate(lr)

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._push()

    def step(self, closure: Any = None) -> None:
        self._push()

    def set_optimizer_step(self, step: int) -> None:
        """Set the optimizer iteration of the cache's kernels (Adam's bias correction), as TorchRec's fused
        optimizer sets its TBE's."""
        self._cache.set_optimizer_step(step)

    def update_hyper_parameters(self, params_dict: Dict[str, Any]) -> None:
        """Set hyper-parameters as TorchRec's fused optimizer does; the cache supports ``lr``.

        Raises:
            ConfigError: another hyper-parameter (it would silently diverge from the resident tables).
        """
        unknown = sorted(set(params_dict) - {"lr"})
        if unknown:
            raise ConfigError(
                f"the lookahead cache's optimizer can update only 'lr' during training, not {unknown}; set them "
                "in the optimizer configuration instead"
            )
        if "lr" in params_dict:
            list(self.param_groups)[0]["lr"] = params_dict["lr"]
            self._push()


def fused_optimizers(module: nn.Module, path: str = "") -> List[Tuple[str, KeyedOptimizer]]:
    """The fused optimizers of ``module``'s submodules, keyed by path, as DistributedModelParallel collects
    them (it stops at the first FusedOptimizerModule on each branch)."""
    if isinstance(module, FusedOptimizerModule):
        return [(path, module.fused_optimizer)]
    out: List[Tuple[str, KeyedOptimizer]] = []
    for name, child in module.named_children():
        out += fused_optimizers(child, f"{path}.{name}" if path else name)
    return out
