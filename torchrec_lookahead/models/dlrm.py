"""DLRM as a LightningModule: TorchRec's ``DLRM`` with BCE loss, AUC and log-loss (see
:class:`~torchrec_lookahead.models.TorchRecModule` for how it is built, sharded and trained)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.models.base import TorchRecModule, make_table_configs
from torchrec_lookahead.optim import DenseOptimizerSpec, EmbeddingOptimizerSpec

__all__ = ["DLRMModule", "make_table_configs"]


class DLRMModule(TorchRecModule):
    """TorchRec DLRM trained on batches of :class:`~torchrec.datasets.utils.Batch`.

    Args:
        num_embeddings_per_feature: rows of each sparse feature's table (the CLI links it from the data).
        num_dense_features: dense inputs per sample (linked from the data by the CLI).
        embedding_dim: embedding width (also the last dense-arch layer).
        dense_arch_layer_sizes: bottom MLP; its last size must equal ``embedding_dim``.
        over_arch_layer_sizes: top MLP; its last size must be 1.
        embedding_optimizer: the embedding tables' optimizer.
        dense_optimizer: the dense layers' optimizer.
        dropout: probability of dropout on the bottom MLP's output while training (0: none). Its masks come
            from torch's global random stream, which cached training keeps as resident training has it.

    Example:
        >>> m = DLRMModule({"cat_0": 10}, num_dense_features=2, embedding_dim=4, dense_arch_layer_sizes=[4])
        >>> m.configure_model()
        >>> from torchrec import KeyedJaggedTensor
        >>> kjt = KeyedJaggedTensor(keys=["cat_0"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
        >>> tuple(m(torch.zeros(2, 2), kjt).shape)
        (2,)
    """

    def __init__(
        self,
        num_embeddings_per_feature: Optional[Dict[str, int]] = None,
        num_dense_features: int = 13,
        embedding_dim: int = 16,
        dense_arch_layer_sizes: Optional[List[int]] = None,
        over_arch_layer_sizes: Optional[List[int]] = None,
        embedding_optimizer: Optional[EmbeddingOptimizerSpec] = None,
        dense_optimizer: Optional[DenseOptimizerSpec] = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(
            num_embeddings_per_feature,
            num_dense_features,
            embedding_dim,
            embedding_optimizer,
            dense_optimizer,
        )
        self.dense_arch_layer_sizes = list(dense_arch_layer_sizes or [64, embedding_dim])
        self.over_arch_layer_sizes = list(over_arch_layer_sizes or [64, 32, 1])
        if self.dense_arch_layer_sizes[-1] != embedding_dim:
            raise ConfigError(
                f"The last dense_arch_layer_sizes entry must equal embedding_dim={embedding_dim} but got "
                f"{self.dense_arch_layer_sizes}"
            )
        if len(self.over_arch_layer_sizes) < 2:
            raise ConfigError(
                "over_arch_layer_sizes needs at least two layers (TorchRec's OverArch) "
                f"but got {self.over_arch_layer_sizes}"
            )
        if not 0.0 <= float(dropout) < 1.0 or isinstance(dropout, bool):
            raise ConfigError(f"Expected dropout in [0, 1) but got {dropout!r}")
        self.dropout = float(dropout)
        if self.over_arch_layer_sizes[-1] != 1:
            raise ConfigError(
                f"The last over_arch_layer_sizes entry must be 1 but got {self.over_arch_layer_sizes}"
            )

    def build_model(self, device: torch.device, dense_device: Optional[torch.device] = None) -> DLRM:
        """The unsharded DLRM with its tables on ``device`` (``meta`` for sharding) and its dense layers on
        ``dense_device`` (default ``device``)."""
        ebc = EmbeddingBagCollection(tables=self.tables, device=device)
        dense_device = dense_device or device
        model = DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=self.num_dense_features,
            dense_arch_layer_sizes=self.dense_arch_layer_sizes,
            over_arch_layer_sizes=self.over_arch_layer_sizes,
            dense_device=dense_device,
        )
        if self.dropout:
            # A hook, not a module: the state-dict keys stay TorchRec's DLRM's.
            model.dense_arch.register_forward_hook(_Dropout(self.dropout))
        return model


class _Dropout:
    """Forward hook: dropout on a module's output while the module trains."""

    def __init__(self, p: float) -> None:
        self.p = p

    def __call__(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(output, self.p, module.training)
