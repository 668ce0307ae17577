"""A plain ``DataLoader`` over a list of TorchRec ``Batch`` es, and a LightningModule that builds our DLRM,
TorchRec's ``DLRM_DCN`` or TorchRec's ``SimpleDeepFMNN`` (test fixtures, used by the CLI configs of the tests)."""

from __future__ import annotations

from typing import Any, Dict, List

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader
from torchrec import EmbeddingBagCollection, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.models.deepfm import SimpleDeepFMNN
from torchrec.models.dlrm import DLRM_DCN

from torchrec_lookahead.models import DLRMModule

ROWS = {"cat_0": 300, "cat_1": 120, "cat_2": 40}


def list_batches(num_batches: int, batch_size: int, num_dense: int, seed: int) -> List[Batch]:
    """Random batches: 1-3 ids per sample and feature, labels that depend on the first feature."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_batches):
        lengths = torch.randint(1, 4, (len(ROWS) * batch_size,), generator=g, dtype=torch.int32)
        parts, start = [], 0
        for i, rows in enumerate(ROWS.values()):
            n = int(lengths[i * batch_size : (i + 1) * batch_size].sum())
            parts.append(torch.randint(0, rows, (n,), generator=g))
            start += n
        kjt = KeyedJaggedTensor(keys=list(ROWS), values=torch.cat(parts), lengths=lengths)
        dense = torch.randn(batch_size, num_dense, generator=g)
        labels = (parts[0][:batch_size] % 2).float()
        out.append(Batch(dense_features=dense, sparse_features=kjt, labels=labels))
    return out


class ListBatchDataModule(pl.LightningDataModule):
    """Training batches from a list through a plain map-style ``DataLoader`` (Lightning adds its sampler)."""

    def __init__(self, num_batches: int = 24, batch_size: int = 8, num_dense: int = 4, seed: int = 0) -> None:
        super().__init__()
        self.batches = list_batches(num_batches, batch_size, num_dense, seed)
        self._num_dense = num_dense

    @property
    def num_embeddings_per_feature(self) -> Dict[str, int]:
        return dict(ROWS)

    @property
    def num_dense_features(self) -> int:
        return self._num_dense

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.batches, batch_size=None, collate_fn=lambda b: b)


class ArchModule(DLRMModule):
    """``DLRMModule`` with a choice of architecture: ``dlrm`` (ours), ``dcn`` (``DLRM_DCN``), ``deepfm``
    (``SimpleDeepFMNN``); each keeps its collection at ``sparse_arch.embedding_bag_collection``."""

    def __init__(self, *args: Any, arch: str = "dlrm", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.arch = arch

    def build_model(self, device: torch.device, dense_device: Any = None) -> nn.Module:  # type: ignore[override]
        if self.arch == "dlrm":
            return super().build_model(device, dense_device)
        ebc = EmbeddingBagCollection(tables=self.tables, device=device)
        dense_device = dense_device or device
        if self.arch == "dcn":
            return DLRM_DCN(
                embedding_bag_collection=ebc,
                dense_in_features=self.num_dense_features,
                dense_arch_layer_sizes=self.dense_arch_layer_sizes,
                over_arch_layer_sizes=self.over_arch_layer_sizes,
                dcn_num_layers=2,
                dcn_low_rank_dim=4,
                dense_device=dense_device,
            )
        with torch.device(dense_device):
            return SimpleDeepFMNN(
                num_dense_features=self.num_dense_features,
                embedding_bag_collection=ebc,
                hidden_layer_size=8,
                deep_fm_dimension=4,
            )
