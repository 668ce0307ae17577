"""Train TorchRec's DLRM under Lightning through the lookahead cache, without the CLI.

Three things differ from the resident job (``--resident`` trains that one): the strategy's sharder, the
DataModule wrapper and the callback. The large tables live in host memory; the device keeps a cache sized by
the planner for ``--cache-mb`` of device memory, filled ahead of each step from the next ``horizon`` batches.
The results are those of the resident job, bit for bit (``python -m torchrec_lookahead verify``).

.venv/bin/python examples/train_dlrm.py --steps 50
"""

from __future__ import annotations

import argparse
from typing import Dict, Optional, Sequence

import lightning.pytorch as pl

from torchrec_lookahead.callbacks import CacheMonitor
from torchrec_lookahead.data import CriteoSyntheticDataModule, LookaheadDataModule
from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
from torchrec_lookahead.models import DLRMModule
from torchrec_lookahead.strategies import TorchRecStrategy


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, float]:
    """Train for ``--steps`` steps and return the final metrics (the cache's among them unless ``--resident``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--cache-mb", type=float, default=2.0, help="device memory for the cached tables")
    p.add_argument("--horizon", type=int, default=64, help="batches the cache plans ahead")
    p.add_argument("--resident", action="store_true", help="every table on the device (the baseline)")
    p.add_argument("--log-every", type=int, default=10, help="steps between two logs of the metrics")
    p.add_argument("--root", default="logs")
    args = p.parse_args(argv)
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size), ("--horizon", args.horizon),
                        ("--log-every", args.log_every), ("--cache-mb", args.cache_mb)):  # fmt: skip
        if not value > 0:
            p.error(f"{flag} must be positive but got {value}")
    pl.seed_everything(0)
    data = CriteoSyntheticDataModule(
        batch_size=args.batch_size, num_train_batches=args.steps, num_val_batches=4
    )
    model = DLRMModule(data.num_embeddings_per_feature, data.num_dense_features, embedding_dim=16)
    if args.resident:
        strategy, datamodule, callbacks = TorchRecStrategy(), data, []
    else:
        # 1. the sharder: the planner picks the tables to cache and their rows for the device budget
        sharder = LookaheadEmbeddingBagCollectionSharder(device_budget_bytes=int(args.cache_mb * 2**20))
        strategy = TorchRecStrategy(sharders=[sharder])
        # 2. the DataModule wrapper: plans the cache `horizon` batches ahead, stages rows in the background
        datamodule = LookaheadDataModule(data, horizon=args.horizon)
        # 3. the callback: hit rate, rows moved, bytes, samples/s (TensorBoard and callback_metrics)
        callbacks = [CacheMonitor()]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        callbacks=callbacks,
        max_epochs=1,
        log_every_n_steps=args.log_every,
        default_root_dir=args.root,
    )
    trainer.fit(model, datamodule=datamodule)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


if __name__ == "__main__":
    print(main())
