"""A user's model that reads its pooled embeddings by position (``kt.values()``), trained resident and cached on
several ranks, for the key-order test (``test_resident_order.py``).

Run under torchrun (rank 0 writes ``<out>/result.json``)::

    python -m torch.distributed.run --nproc_per_node=2 -m tests.distributed.resident_order_runs <out>
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

# A small and a larger table: TorchRec's planner puts them on different ranks, and its sharded collection then
# returns ['d', 'a', 'b'] where the collection's feature order is ['a', 'b', 'd'].
TABLES = {"ta": (97, ["a", "b"]), "tc": (300, ["d"])}
ROWS = {"a": 97, "b": 97, "d": 300}


class PositionalModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.ebc: Any = None
        self.keys: List[str] = []
        self.top = nn.Linear(1 + 8 * 3, 1)

    def configure_model(self) -> None:
        if self.ebc is None:
            tables = [
                EmbeddingBagConfig(name=t, embedding_dim=8, num_embeddings=n, feature_names=f)
                for t, (n, f) in TABLES.items()
            ]
            self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
            apply_optimizer_in_backward(RowWiseAdagrad, self.ebc.parameters(), {"lr": 0.05})

    def training_step(self, batch: Dict[str, Any], idx: int) -> torch.Tensor:
        pooled = self.ebc(batch["sparse"])
        self.keys = list(pooled.keys())
        # by position, as many models do
        logits = self.top(torch.cat([batch["dense"], pooled.values()], dim=1)).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch["labels"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(
            [p for _, p in in_backward_optimizer_filter(self.named_parameters())], lr=0.05
        )


def batches(rank: int) -> List[Dict[str, Any]]:
    g = torch.Generator().manual_seed(10 + rank)
    out = []
    for _ in range(6):
        lengths = torch.randint(0, 4, (3 * 8,), generator=g)
        values = [
            (torch.rand(int(lengths[i * 8 : (i + 1) * 8].sum()), generator=g) ** 2 * ROWS[f]).long()
            for i, f in enumerate(ROWS)
        ]
        out.append(
            {
                "dense": torch.rand(8, 1, generator=g),
                "sparse": KeyedJaggedTensor(keys=list(ROWS), values=torch.cat(values), lengths=lengths),
                "labels": (torch.rand(8, generator=g) < 0.3).float(),
            }
        )
    return out


class Data(pl.LightningDataModule):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.batches = batches(rank)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.batches, batch_size=None)  # type: ignore[arg-type]


def train(cached: bool, rank: int) -> Dict[str, Any]:
    from torchrec_lookahead.data import LookaheadDataModule
    from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
    from torchrec_lookahead.runtime import DictBatchAdapter
    from torchrec_lookahead.strategies import TorchRecStrategy
    from torchrec_lookahead.verify import QUIET_TRAINER_ARGS, comparable_state

    pl.seed_everything(0, verbose=False)
    model = PositionalModule()
    data: pl.LightningDataModule = Data(rank)
    sharders = None
    if cached:
        sharders = [LookaheadEmbeddingBagCollectionSharder(capacity={"tc": 280})]
        data = LookaheadDataModule(data, horizon=4, batch_adapter=DictBatchAdapter())
    trainer = pl.Trainer(
        **{**QUIET_TRAINER_ARGS, "accelerator": "cpu", "devices": 2, "max_epochs": 1},
        strategy=TorchRecStrategy(sharders=sharders),
    )
    trainer.fit(model, datamodule=data)
    trainer.strategy.flush_caches()
    return {"weights": comparable_state(model), "keys": model.keys}


def main(out: str) -> None:
    from torchrec_lookahead.launch import shutdown_distributed

    rank = int(os.environ["RANK"])
    resident = train(False, rank)
    cached = train(True, rank)
    if dist.get_rank() == 0:
        w_r, w_c = resident["weights"], cached["weights"]
        result = {
            "differ": sorted(k for k in w_r if k not in w_c or not torch.equal(w_r[k], w_c[k])),
            "resident_keys": resident["keys"],
            "cached_keys": cached["keys"],
        }
        Path(out, "result.json").write_text(json.dumps(result))
    shutdown_distributed(exit_code=0)


if __name__ == "__main__":
    main(sys.argv[1])
