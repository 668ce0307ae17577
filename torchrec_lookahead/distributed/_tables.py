"""The per-table modules and configs of a TorchRec collection, and the ``apply_optimizer_in_backward``
declarations on them (how TorchRec's sharders find each table's fused optimizer)."""

from __future__ import annotations

from typing import Any, List

from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection

__all__ = ["table_parameters", "table_configs", "copy_in_backward_optimizers"]

_IN_BACKWARD_ATTRS = ("_optimizer_classes", "_optimizer_kwargs", "_in_backward_optimizers")


def table_parameters(module: nn.Module) -> nn.ModuleDict:
    """The per-table modules of a TorchRec collection: ``embedding_bags`` of an EmbeddingBagCollection,
    ``embeddings`` of an EmbeddingCollection."""
    found = getattr(module, "embedding_bags", None)
    return found if isinstance(found, nn.ModuleDict) else module.embeddings  # type: ignore[return-value]


def table_configs(module: nn.Module) -> List[Any]:
    """The table configs of a TorchRec EmbeddingBagCollection or EmbeddingCollection."""
    if isinstance(module, EmbeddingBagCollection):
        return list(module.embedding_bag_configs())
    return list(module.embedding_configs())  # type: ignore[operator]


def copy_in_backward_optimizers(src: nn.Module, dst: nn.Module, names: List[str]) -> None:
    """Give the tables ``names`` of collection ``dst`` the ``apply_optimizer_in_backward`` declarations of
    ``src``'s (how TorchRec's sharders find each table's fused optimizer)."""
    for name in names:
        a, b = table_parameters(src)[name].weight, table_parameters(dst)[name].weight
        for attr in _IN_BACKWARD_ATTRS:
            if hasattr(a, attr):
                setattr(b, attr, getattr(a, attr))
