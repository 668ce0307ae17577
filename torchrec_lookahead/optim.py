"""Optimizer choices for embedding tables and dense layers, by name.

Embedding optimizers map to TorchRec optimizer classes, which TorchRec's sharders turn into FBGEMM fused
optimizers (``apply_optimizer_in_backward``), and to the FBGEMM ``EmbOptimType`` the cache uses, so resident
and cached tables are updated by the same kernel with the same arguments.

Example:
    >>> spec = EmbeddingOptimizerSpec("rowwise_adagrad", lr=0.1)
    >>> spec.emb_opt_type().name
    'EXACT_ROWWISE_ADAGRAD'
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Optional, Tuple, Type

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.optim import CombinedOptimizer
from torchrec.optim import optimizers as trec_optim
from torchrec.optim import rowwise_adagrad as _rowwise

from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.modules.config import OPTIMIZER_NAMES

__all__ = [
    "EmbeddingOptimizerName",
    "DenseOptimizerName",
    "EmbeddingOptimizerSpec",
    "DenseOptimizerSpec",
    "StepOnceCombinedOptimizer",
]


class EmbeddingOptimizerName(str, enum.Enum):
    """Supported embedding optimizers (row-wise Adagrad is TorchRec's default for recommendation); the same
    names as :data:`~torchrec_lookahead.modules.config.OPTIMIZER_NAMES`, which the cache's optimizer takes too."""

    SGD = "sgd"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAGRAD = "adagrad"
    ADAM = "adam"


class DenseOptimizerName(str, enum.Enum):
    """Supported dense-layer optimizers."""

    SGD = "sgd"
    ADAGRAD = "adagrad"
    ADAM = "adam"


def _enum(cls: Type[enum.Enum], value: Any, arg: str) -> Any:
    try:
        return cls(value.value if isinstance(value, enum.Enum) else value)
    except ValueError:
        valid = [m.value for m in list(cls)]
        raise ConfigError(f"Expected {arg} to be one of {valid} but got {value!r}") from None


@dataclass
class EmbeddingOptimizerSpec:
    """An embedding optimizer by name with its arguments.

    Args:
        name: ``sgd``, ``rowwise_adagrad``, ``adagrad`` or ``adam``.
        lr: learning rate.
        eps: epsilon of the adaptive optimizers.
        betas: Adam's betas.
        weight_decay: L2 weight decay.
    """

    name: str = "rowwise_adagrad"
    lr: float = 0.05
    eps: float = 1e-8
    betas: Tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        self.name = _enum(EmbeddingOptimizerName, self.name, "embedding optimizer").value
        if not self.lr > 0:
            raise ConfigError(f"Expected embedding learning rate > 0 but got {self.lr}")
        if not self.eps > 0:
            raise ConfigError(f"Expected eps > 0 but got {self.eps}")

    def optimizer_class(self) -> Type[torch.optim.Optimizer]:
        """The TorchRec optimizer class for ``apply_optimizer_in_backward``; TorchRec's sharders fuse it into
        the embedding kernel (FBGEMM)."""
        return {
            EmbeddingOptimizerName.SGD: trec_optim.SGD,
            EmbeddingOptimizerName.ROWWISE_ADAGRAD: _rowwise.RowWiseAdagrad,
            EmbeddingOptimizerName.ADAGRAD: trec_optim.Adagrad,
            EmbeddingOptimizerName.ADAM: trec_optim.Adam,
        }[EmbeddingOptimizerName(self.name)]

    def optimizer_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments for :meth:`optimizer_class`, named as FBGEMM's fused optimizers name them
        (TorchRec renames ``lr`` to ``learning_rate`` and passes the rest through)."""
        p = self.fused_params()
        p["lr"] = p.pop("learning_rate")
        p.pop("optimizer")
        return p

    def build_unfused(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """An ordinary (non-fused) torch optimizer of the same kind, for unsharded training."""
        n = EmbeddingOptimizerName(self.name)
        ps = list(params)
        if n is EmbeddingOptimizerName.SGD:
            return torch.optim.SGD(ps, lr=self.lr, weight_decay=self.weight_decay)
        if n is EmbeddingOptimizerName.ROWWISE_ADAGRAD:
            return _rowwise.RowWiseAdagrad(ps, lr=self.lr, eps=self.eps, weight_decay=self.weight_decay)
        if n is EmbeddingOptimizerName.ADAGRAD:
            return torch.optim.Adagrad(ps, lr=self.lr, eps=self.eps, weight_decay=self.weight_decay)
        b1, b2 = self.betas
        return torch.optim.Adam(ps, lr=self.lr, eps=self.eps, betas=(b1, b2), weight_decay=self.weight_decay)

    def emb_opt_type(self) -> EmbOptimType:
        """The FBGEMM fused optimizer type (:data:`~torchrec_lookahead.modules.config.OPTIMIZER_NAMES`)."""
        return OPTIMIZER_NAMES[EmbeddingOptimizerName(self.name).value]

    def fused_params(self) -> Dict[str, Any]:
        """FBGEMM fused parameters (for a sharder's ``fused_params``)."""
        p: Dict[str, Any] = {
            "optimizer": self.emb_opt_type(),
            "learning_rate": self.lr,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
        }
        if EmbeddingOptimizerName(self.name) is EmbeddingOptimizerName.ADAM:
            p["beta1"], p["beta2"] = self.betas
        return p


@dataclass
class DenseOptimizerSpec:
    """A dense-layer optimizer by name.

    Args:
        name: ``sgd``, ``adagrad`` or ``adam``.
        lr: learning rate.
        kwargs: extra keyword arguments of the torch optimizer.
    """

    name: str = "adagrad"
    lr: float = 0.05
    kwargs: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.name = _enum(DenseOptimizerName, self.name, "dense optimizer").value
        if not self.lr > 0:
            raise ConfigError(f"Expected dense learning rate > 0 but got {self.lr}")

    def build(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """A torch optimizer over ``params``."""
        cls = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}[self.name]
        return cls(list(params), lr=self.lr, **self.kwargs)


class StepOnceCombinedOptimizer(CombinedOptimizer):
    """TorchRec's :class:`~torchrec.optim.CombinedOptimizer` that evaluates Lightning's closure once.

    ``CombinedOptimizer.step(closure)`` hands the closure to every inner optimizer, so under Lightning's
    automatic optimization forward and backward would run once per inner optimizer. Here the closure runs
    once and then every inner optimizer steps (the fused embedding optimizer has already applied its update
    in the backward pass).
    """

    def step(self, closure: Optional[Any] = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for _, opt in self.optimizers:
            opt.step()
        return loss
