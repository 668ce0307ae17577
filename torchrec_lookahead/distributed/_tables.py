"""The per-table modules and configs of a TorchRec collection, and the ``apply_optimizer_in_backward``
declarations on them (how TorchRec's sharders find each table's fused optimizer)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

from torch import nn
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

__all__ = ["table_parameters", "table_configs", "copy_in_backward_optimizers", "in_backward_optimizer"]

_IN_BACKWARD_ATTRS = ("_optimizer_classes", "_optimizer_kwargs", "_in_backward_optimizers")


Collection = Union[EmbeddingBagCollection, EmbeddingCollection]


def table_parameters(module: Collection) -> nn.ModuleDict:
    """The per-table modules of a TorchRec collection: ``embedding_bags`` of an EmbeddingBagCollection,
    ``embeddings`` of an EmbeddingCollection."""
    return module.embedding_bags if isinstance(module, EmbeddingBagCollection) else module.embeddings


def table_configs(module: Collection) -> List[BaseEmbeddingConfig]:
    """The table configs of a TorchRec EmbeddingBagCollection or EmbeddingCollection."""
    if isinstance(module, EmbeddingBagCollection):
        return list(module.embedding_bag_configs())
    return list(module.embedding_configs())


def in_backward_optimizer(weight: object) -> Optional[Tuple[Any, Dict[str, Any]]]:
    """The first ``apply_optimizer_in_backward`` declaration on a table's weight, as (optimizer class, its
    keyword arguments), or ``None``: TorchRec keeps them in attributes it sets on the parameter."""
    classes = getattr(weight, "_optimizer_classes", None)
    if not classes:
        return None
    kwargs = getattr(weight, "_optimizer_kwargs", None) or [{}]
    return classes[0], dict(kwargs[0])


def copy_in_backward_optimizers(src: nn.Module, dst: nn.Module, names: List[str]) -> None:
    """Give the tables ``names`` of collection ``dst`` the ``apply_optimizer_in_backward`` declarations of
    ``src``'s (how TorchRec's sharders find each table's fused optimizer)."""
    for name in names:
        a, b = table_parameters(src)[name].weight, table_parameters(dst)[name].weight
        for attr in _IN_BACKWARD_ATTRS:
            if hasattr(a, attr):
                setattr(b, attr, getattr(a, attr))
