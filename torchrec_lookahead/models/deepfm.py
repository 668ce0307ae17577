"""DeepFM as a LightningModule: TorchRec's ``SimpleDeepFMNN`` (a factorization machine beside a deep network
over the embeddings and the projected dense features). Its output layer ends in a sigmoid, so it is trained
with BCE on probabilities and served as TorchRec built it."""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torchrec.models.deepfm import SimpleDeepFMNN
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_lookahead.models.base import TorchRecModule, require_positive
from torchrec_lookahead.optim import DenseOptimizerSpec, EmbeddingOptimizerSpec

__all__ = ["DeepFMModule"]


class DeepFMModule(TorchRecModule):
    """TorchRec ``SimpleDeepFMNN`` trained on batches of :class:`~torchrec.datasets.utils.Batch`.

    Args:
        num_embeddings_per_feature: rows of each sparse feature's table (the CLI links it from the data).
        num_dense_features: dense inputs per sample (linked from the data by the CLI).
        embedding_dim: embedding width (the dense features are projected to it too).
        hidden_layer_size: hidden width of the dense projection.
        deep_fm_dimension: output width of DeepFM's deep part.
        embedding_optimizer: the embedding tables' optimizer.
        dense_optimizer: the dense layers' optimizer.

    Raises:
        ConfigError: a width below 1.

    Example:
        >>> m = DeepFMModule({"a": 10, "b": 5}, 2, embedding_dim=4, hidden_layer_size=8, deep_fm_dimension=3)
        >>> m.configure_model()
        >>> from torchrec import KeyedJaggedTensor
        >>> kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1]))
        >>> p = m(torch.zeros(2, 2), kjt)
        >>> tuple(p.shape), bool(((0 < p) & (p < 1)).all())
        ((2,), True)
    """

    output_is_probability = True

    def __init__(
        self,
        num_embeddings_per_feature: Optional[Dict[str, int]] = None,
        num_dense_features: int = 13,
        embedding_dim: int = 16,
        hidden_layer_size: int = 64,
        deep_fm_dimension: int = 16,
        embedding_optimizer: Optional[EmbeddingOptimizerSpec] = None,
        dense_optimizer: Optional[DenseOptimizerSpec] = None,
    ) -> None:
        super().__init__(
            num_embeddings_per_feature,
            num_dense_features,
            embedding_dim,
            embedding_optimizer,
            dense_optimizer,
        )
        require_positive(hidden_layer_size=hidden_layer_size, deep_fm_dimension=deep_fm_dimension)
        self.hidden_layer_size = hidden_layer_size
        self.deep_fm_dimension = deep_fm_dimension

    def build_model(
        self, device: torch.device, dense_device: Optional[torch.device] = None
    ) -> SimpleDeepFMNN:
        """The unsharded ``SimpleDeepFMNN``, tables on ``device``, dense layers on ``dense_device``."""
        ebc = EmbeddingBagCollection(tables=self.tables, device=device)
        with torch.device(dense_device or device):  # TorchRec builds its dense layers on the default device
            return SimpleDeepFMNN(
                num_dense_features=self.num_dense_features,
                embedding_bag_collection=ebc,
                hidden_layer_size=self.hidden_layer_size,
                deep_fm_dimension=self.deep_fm_dimension,
            )
