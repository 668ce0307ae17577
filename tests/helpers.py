"""Test helpers: tiny Trainer runs and comparable weights."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Type

import lightning.pytorch as pl
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

import torchrec_lookahead.strategies  # noqa: F401
from torchrec_lookahead.data import CriteoSyntheticDataModule
from torchrec_lookahead.models import DLRMModule
from torchrec_lookahead.optim import DenseOptimizerSpec, EmbeddingOptimizerSpec

from .conftest import tiny_data_args


def local_state(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The module's state dict with sharded tensors replaced by this rank's shards (cloned)."""
    out: Dict[str, torch.Tensor] = {}
    for k, v in module.state_dict().items():
        if isinstance(v, ShardedTensor):
            for i, shard in enumerate(v.local_shards()):
                out[f"{k}#{i}"] = shard.tensor.detach().clone()
        elif isinstance(v, torch.Tensor):
            out[k] = v.detach().clone()
    return out


def max_abs_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def make_model(
    dm: CriteoSyntheticDataModule,
    emb: str = "rowwise_adagrad",
    model_cls: Type[DLRMModule] = DLRMModule,
    **kw: Any,
) -> DLRMModule:
    return model_cls(
        dm.num_embeddings_per_feature,
        dm.num_dense_features,
        embedding_dim=8,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
        embedding_optimizer=EmbeddingOptimizerSpec(emb, lr=0.05),
        dense_optimizer=DenseOptimizerSpec("adagrad", lr=0.05),
        **kw,
    )


def _trainer(
    tmp_path: Any, max_steps: int, callbacks: Optional[List[pl.Callback]], **trainer_kw: Any
) -> pl.Trainer:
    """A quiet one-process CPU Trainer (tests override any argument, e.g. ``limit_val_batches``)."""
    from torchrec_lookahead.verify import QUIET_TRAINER_ARGS

    kw: Dict[str, Any] = {
        **QUIET_TRAINER_ARGS,
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": max_steps,
        "max_epochs": None,
        "enable_checkpointing": True,
        "default_root_dir": str(tmp_path),
    }
    kw.update(trainer_kw)
    return pl.Trainer(callbacks=callbacks or [], **kw)


def fit(
    tmp_path: Any,
    max_steps: int,
    ckpt_path: Optional[str] = None,
    callbacks: Optional[List[pl.Callback]] = None,
    data: Optional[Dict[str, Any]] = None,
    emb: str = "rowwise_adagrad",
    **trainer_kw: Any,
) -> tuple[pl.Trainer, DLRMModule]:
    pl.seed_everything(0, verbose=False)
    dm = CriteoSyntheticDataModule(**tiny_data_args(**(data or {})))
    model = make_model(dm, emb=emb)
    trainer = _trainer(tmp_path, max_steps, callbacks, **{"strategy": "torchrec", **trainer_kw})
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return trainer, model


TINY_CAPACITY = {"t_cat_2": 140, "t_cat_11": 120, "t_cat_15": 110}


def fit_cached(
    tmp_path: Any,
    max_steps: int,
    capacity: Optional[Dict[str, int]] = None,
    policy: str = "belady",
    emb: str = "rowwise_adagrad",
    data: Optional[Dict[str, Any]] = None,
    ckpt_path: Optional[str] = None,
    callbacks: Optional[List[pl.Callback]] = None,
    wrap: bool = True,
    lookahead_kw: Optional[Dict[str, Any]] = None,
    sharder_kw: Optional[Dict[str, Any]] = None,
    model_cls: Type[DLRMModule] = DLRMModule,
    strategy_kw: Optional[Dict[str, Any]] = None,
    **trainer_kw: Any,
) -> tuple[pl.Trainer, DLRMModule]:
    """Train the tiny model with ``capacity`` cached (resident when empty), as the CLI would."""
    from torchrec_lookahead.data import LookaheadDataModule
    from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
    from torchrec_lookahead.strategies import TorchRecStrategy

    capacity = TINY_CAPACITY if capacity is None else capacity
    pl.seed_everything(0, verbose=False)
    inner = CriteoSyntheticDataModule(**tiny_data_args(**(data or {})))
    dm: pl.LightningDataModule = inner
    sharders = None
    if capacity:
        sharders = [LookaheadEmbeddingBagCollectionSharder(capacity=capacity, **(sharder_kw or {}))]
        if wrap:
            dm = LookaheadDataModule(
                inner, horizon=8, prefetch_depth=1, policy=policy, **(lookahead_kw or {})
            )
    model = make_model(inner, emb=emb, model_cls=model_cls)
    trainer = _trainer(
        tmp_path,
        max_steps,
        callbacks,
        strategy=TorchRecStrategy(sharders=sharders, **(strategy_kw or {})),
        **trainer_kw,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return trainer, model


def weights(model: DLRMModule) -> Dict[str, torch.Tensor]:
    """Comparable weights of a cached or resident model (see ``torchrec_lookahead.verify``)."""
    from torchrec_lookahead.verify import comparable_state

    return comparable_state(model)


def check_mid_epoch_resume(fit: Any, tmp_path: Any, every: int = 5, steps: int = 10, **fit_kw: Any) -> Any:
    """``fit(path, max_steps, ckpt_path=None, callbacks=None, **fit_kw) -> (trainer, model, scheduler, dm)``
    checkpointed every ``every`` steps and resumed from each of those checkpoints before ``steps`` (the latest and
    the older ones) to step ``steps`` equals ``steps`` uninterrupted steps: weights bit for bit, the scheduler's
    counts. Returns the uninterrupted run's checkpoint directory."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=every, save_top_k=-1)
    _, full, sched_full, _ = fit(tmp_path / "full", max_steps=steps, callbacks=[ckpt], **fit_kw)
    for at in range(every, steps, every):
        path = tmp_path / "ckpt" / f"epoch=0-step={at}.ckpt"
        trainer, resumed, sched, _ = fit(
            tmp_path / f"resumed{at}", max_steps=steps, ckpt_path=str(path), **fit_kw
        )
        assert trainer.global_step == steps
        assert sched.trained == sched_full.trained and sched.swaps == sched_full.swaps
        assert max_abs_diff(local_state(full.model), local_state(resumed.model)) == 0.0, at
    return tmp_path / "ckpt"


def small_sequence_config(
    tmp_path: Any,
    pooling: str = "attention",
    devices: int = 1,
    rows: int = 900,
    options: str = "capacity: {t_movie: 400, t_user: 40}",
) -> Any:
    """A config file layered over ``configs/movielens_sequence_lookahead.yaml``: a synthetic ratings file (40
    users, skewed movies, shuffled times) and, by default (``options`` of the lookahead sharder), caches smaller
    than the ids they serve."""
    import random

    rnd = random.Random(0)
    lines = ["userId,movieId,rating,timestamp"]
    for _ in range(rows):
        movie = int(rnd.paretovariate(1.2)) % 3000
        lines.append(f"{rnd.randrange(40)},{movie},{rnd.choice([2.0, 4.5])},{rnd.randrange(10**6)}")
    ratings = tmp_path / "ratings.csv"
    ratings.write_text("\n".join(lines) + "\n")
    small = tmp_path / "small.yaml"
    small.write_text(
        f"""
trainer:
  devices: {devices}
  strategy:
    class_path: torchrec_lookahead.strategies.TorchRecStrategy
    init_args:
      sharders:
      - class_path: torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder
        init_args: {{{options}}}
model: {{init_args: {{pooling: {pooling}}}}}
data:
  init_args:
    datamodule:
      init_args: {{train_files: {ratings}, movies_file: null, batch_size: 32, num_embeddings: [64, 4096, 4]}}
"""
    )
    return small
