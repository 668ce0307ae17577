"""A user's own two-tower model, written the way TorchRec's examples write one: a plain LightningModule (not a
:class:`~torchrec_lookahead.models.TorchRecModule`), its TorchRec model under an attribute of its own choosing,
dict batches, no hook into this package. The CLI and ``verify`` tests train it cached and resident."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader
from torchrec import KeyedJaggedTensor
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

FEATURES = ("user", "item")


class Towers(nn.Module):
    """User and item towers over one ``EmbeddingBagCollection``; the score is their dot product."""

    def __init__(self, rows: Dict[str, int], dim: int, device: torch.device) -> None:
        super().__init__()
        self.embeddings = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=f"table_{f}", embedding_dim=dim, num_embeddings=rows[f], feature_names=[f]
                )
                for f in FEATURES
            ],
            device=device,
        )
        self.user_tower = nn.Sequential(nn.Linear(dim + 1, dim), nn.ReLU(), nn.Linear(dim, dim))
        self.item_tower = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.embeddings(sparse)
        user = self.user_tower(torch.cat([pooled["user"], dense], dim=1))
        item = self.item_tower(pooled["item"])
        return (user * item).sum(dim=1)


class TwoTowerModule(pl.LightningModule):
    """Click prediction from a user and an item, trained on ``{"dense", "sparse", "labels"}`` batches."""

    def __init__(self, num_users: int = 200, num_items: int = 300, dim: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.towers: Optional[Towers] = None

    def configure_model(self) -> None:
        if self.towers is not None:
            return
        sharded = getattr(self.trainer.strategy, "shards_embeddings", False)
        rows = {"user": self.hparams.num_users, "item": self.hparams.num_items}
        towers = Towers(rows, self.hparams.dim, torch.device("meta") if sharded else self.device)
        apply_optimizer_in_backward(RowWiseAdagrad, towers.embeddings.parameters(), {"lr": self.hparams.lr})
        self.towers = towers

    def training_step(self, batch: Dict[str, Any], batch_idx: int) -> torch.Tensor:
        assert self.towers is not None
        logits = self.towers(batch["dense"], batch["sparse"])
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch["labels"])
        self.log("train/loss", loss, batch_size=batch["labels"].numel())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # the tables' optimizer runs in the backward pass (TorchRec's fused kernel, or the cache's)
        dense = [p for _, p in in_backward_optimizer_filter(self.named_parameters())]
        return torch.optim.Adagrad(dense, lr=self.hparams.lr)


def dict_batches(num_batches: int, batch_size: int, rows: Dict[str, int], seed: int) -> List[Dict[str, Any]]:
    """Skewed user and item ids (one of each per sample, a few samples without an item), a dense feature and
    labels."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_batches):
        lengths = torch.stack(
            [torch.ones(batch_size, dtype=torch.long), (torch.rand(batch_size, generator=g) > 0.1).long()]
        )
        values = [
            (torch.rand(int(lengths[i].sum()), generator=g) ** 3 * rows[f]).long()
            for i, f in enumerate(FEATURES)
        ]
        sparse = KeyedJaggedTensor(keys=list(FEATURES), values=torch.cat(values), lengths=lengths.flatten())
        dense = torch.rand(batch_size, 1, generator=g)
        labels = (torch.rand(batch_size, generator=g) < 0.3).float()
        out.append({"dense": dense, "sparse": sparse, "labels": labels})
    return out


class DictDataModule(pl.LightningDataModule):
    """Training batches as dicts (what two-tower pipelines usually yield), not TorchRec ``Batch`` es."""

    def __init__(
        self,
        num_users: int = 200,
        num_items: int = 300,
        batch_size: int = 32,
        num_batches: int = 10,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.rows = {"user": num_users, "item": num_items}
        self.batches = dict_batches(num_batches, batch_size, self.rows, seed)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.batches, batch_size=None, shuffle=False)  # type: ignore[arg-type]


class DenseOnlyModule(pl.LightningModule):
    """A LightningModule without any TorchRec collection (refused by the ``torchrec`` strategy)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(1, 1)

    def training_step(self, batch: Dict[str, Any], batch_idx: int) -> torch.Tensor:
        return self.mlp(batch["dense"]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def two_tower_config(
    adapter: bool = True, model: str = "tests.two_tower.TwoTowerModule", rows: int = 50
) -> str:
    """A LightningCLI config training :class:`TwoTowerModule` on dict batches with both tables cached (``rows``
    cache rows each, for the global batch)."""
    adapter_args = (
        "\n    batch_adapter:\n      class_path: torchrec_lookahead.runtime.DictBatchAdapter"
        if adapter
        else ""
    )
    return f"""seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  strategy:
    class_path: torchrec_lookahead.strategies.TorchRecStrategy
    init_args:
      sharders:
        - class_path: torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder
          init_args:
            capacity: {{table_user: {rows}, table_item: {rows}}}
  max_epochs: 1
  logger: false
  enable_checkpointing: false
  default_root_dir: logs
model:
  class_path: {model}
data:
  class_path: torchrec_lookahead.data.LookaheadDataModule
  init_args:
    datamodule:
      class_path: tests.two_tower.DictDataModule
      init_args: {{num_batches: 12}}
    horizon: 4{adapter_args}
"""
