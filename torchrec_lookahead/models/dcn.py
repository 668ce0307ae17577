"""DCN-v2 as a LightningModule: TorchRec's ``DLRM_DCN``, DLRM whose interaction is a low-rank cross network
(TorchRec's ``LowRankCrossNet``)."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torchrec.models.dlrm import DLRM_DCN
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_lookahead.models.base import require_positive
from torchrec_lookahead.models.dlrm import DLRMModule
from torchrec_lookahead.optim import DenseOptimizerSpec, EmbeddingOptimizerSpec

__all__ = ["DCNModule"]


class DCNModule(DLRMModule):
    """TorchRec ``DLRM_DCN`` (DCN-v2) trained on batches of :class:`~torchrec.datasets.utils.Batch`.

    Args:
        num_embeddings_per_feature: rows of each sparse feature's table (the CLI links it from the data).
        num_dense_features: dense inputs per sample (linked from the data by the CLI).
        embedding_dim: embedding width (also the last dense-arch layer).
        dense_arch_layer_sizes: bottom MLP; its last size must equal ``embedding_dim``.
        over_arch_layer_sizes: top MLP over the cross network's output; its last size must be 1.
        dcn_num_layers: cross layers.
        dcn_low_rank_dim: rank of each cross layer's weight (``W = U V``).
        embedding_optimizer: the embedding tables' optimizer.
        dense_optimizer: the dense layers' optimizer.

    Raises:
        ConfigError: a layer count or rank below 1 (or an architecture :class:`DLRMModule` refuses).

    Example:
        >>> m = DCNModule({"a": 10, "b": 5}, 2, embedding_dim=4, dense_arch_layer_sizes=[4], dcn_num_layers=2)
        >>> m.configure_model()
        >>> from torchrec import KeyedJaggedTensor
        >>> kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
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
        dcn_num_layers: int = 3,
        dcn_low_rank_dim: int = 16,
        embedding_optimizer: Optional[EmbeddingOptimizerSpec] = None,
        dense_optimizer: Optional[DenseOptimizerSpec] = None,
    ) -> None:
        super().__init__(
            num_embeddings_per_feature,
            num_dense_features,
            embedding_dim,
            dense_arch_layer_sizes,
            over_arch_layer_sizes,
            embedding_optimizer,
            dense_optimizer,
        )
        require_positive(dcn_num_layers=dcn_num_layers, dcn_low_rank_dim=dcn_low_rank_dim)
        self.dcn_num_layers = dcn_num_layers
        self.dcn_low_rank_dim = dcn_low_rank_dim

    def build_model(self, device: torch.device, dense_device: Optional[torch.device] = None) -> DLRM_DCN:
        """The unsharded ``DLRM_DCN``, tables on ``device``, dense layers on ``dense_device``."""
        return DLRM_DCN(
            embedding_bag_collection=EmbeddingBagCollection(tables=self.tables, device=device),
            dense_in_features=self.num_dense_features,
            dense_arch_layer_sizes=self.dense_arch_layer_sizes,
            over_arch_layer_sizes=self.over_arch_layer_sizes,
            dcn_num_layers=self.dcn_num_layers,
            dcn_low_rank_dim=self.dcn_low_rank_dim,
            dense_device=dense_device or device,
        )
