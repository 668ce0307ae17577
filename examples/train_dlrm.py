"""Train TorchRec's DLRM under Lightning with ``strategy="torchrec"``, without the CLI.

.venv/bin/python examples/train_dlrm.py --steps 50
"""

from __future__ import annotations

import argparse
from typing import Dict, Optional, Sequence

import lightning.pytorch as pl

import torchrec_lookahead.strategies  # noqa: F401  (registers strategy="torchrec")
from torchrec_lookahead.data import CriteoSyntheticDataModule
from torchrec_lookahead.models import DLRMModule


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, float]:
    """Train for ``--steps`` steps and return the final metrics."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--root", default="logs")
    args = p.parse_args(argv)
    pl.seed_everything(0)
    dm = CriteoSyntheticDataModule(
        batch_size=args.batch_size, num_train_batches=args.steps, num_val_batches=4
    )
    model = DLRMModule(dm.num_embeddings_per_feature, dm.num_dense_features, embedding_dim=16)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy="torchrec", max_epochs=1, default_root_dir=args.root
    )
    trainer.fit(model, datamodule=dm)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


if __name__ == "__main__":
    print(main())
