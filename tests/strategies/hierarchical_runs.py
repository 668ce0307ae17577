"""Runs for the hierarchical anchors, launched by the tests under torchrun: each named run fits the tiny DLRM
with one strategy and rank 0 writes every rank's final weights (full dense tensors, local table shards) to
``<out>/<name>.pt``.

    python -m torch.distributed.run --nproc_per_node=2 -m tests.strategies.hierarchical_runs OUT JSON

with JSON a list of ``{"name": ..., "strategy": {...} or "torchrec", "steps": N, "dense": "adagrad"}``, and
optionally ``ckpt_dir`` + ``ckpt_every`` (checkpoints), ``resume`` (a checkpoint to start from), ``log_dir``
(TensorBoard), ``num_nodes`` (launchers of WORLD_SIZE / num_nodes ranks each), ``epochs`` (with ``steps`` -1:
whole epochs), ``data`` (overrides of the tiny data set), ``validate`` (adds ``val/logloss`` after the fit).
A strategy's ``placement`` may name one of ``PLACEMENTS``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from torchrec_lookahead.data import CriteoSyntheticDataModule
from torchrec_lookahead.models import DLRMModule
from torchrec_lookahead.optim import DenseOptimizerSpec, EmbeddingOptimizerSpec
from torchrec_lookahead.strategies import HierarchicalStrategy
from torchrec_lookahead.verify import QUIET_TRAINER_ARGS

from ..conftest import tiny_data_args

# every dense layer split (two co-partitioned pairs): nothing is left for DDP
ALL_SPLIT = {
    "dense_arch.model._mlp.0._linear": "colwise",
    "dense_arch.model._mlp.1._linear": "rowwise",
    "over_arch.model.0._mlp.0._linear": "colwise",
    "over_arch.model.1": "rowwise",
}
# the dense arch's layers as a co-partitioned pair, the over arch replicated
PAIR = {"dense_arch.model._mlp.0._linear": "colwise", "dense_arch.model._mlp.1._linear": "rowwise"}
PLACEMENTS = {"split": None, "all_split": ALL_SPLIT, "pair": PAIR}
SPLIT = {
    "dense_arch.model._mlp.0._linear": "colwise",
    "dense_arch.model._mlp.1._linear": "rowwise",
    "over_arch.model.0._mlp.0._linear": "colwise",  # unpaired: the next layer is replicated (DDP)
    "over_arch.model.1": "replicate",
}


def _state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        k = ".".join(p for p in k.split(".") if p not in ("_dmp_wrapped_module", "module"))
        if isinstance(v, ShardedTensor):
            for i, shard in enumerate(v.local_shards()):
                out[f"{k}#{i}"] = shard.tensor.detach().clone()
        elif isinstance(v, DTensor):
            out[k] = v.full_tensor().detach().clone()
        elif isinstance(v, torch.Tensor):
            out[k] = v.detach().clone()
    return out


def run(spec: Dict[str, Any], devices: int) -> Dict[str, torch.Tensor]:
    pl.seed_everything(0, verbose=False)
    dm = CriteoSyntheticDataModule(**tiny_data_args(**spec.get("data", {})))
    model = DLRMModule(
        dm.num_embeddings_per_feature,
        dm.num_dense_features,
        embedding_dim=8,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
        embedding_optimizer=EmbeddingOptimizerSpec(spec.get("emb", "rowwise_adagrad"), lr=0.05),
        dense_optimizer=DenseOptimizerSpec(spec.get("dense", "adagrad"), lr=0.05),
    )
    strategy: Any = spec["strategy"]
    if isinstance(strategy, dict):
        kw = dict(strategy)
        if isinstance(kw.get("placement"), str) and kw["placement"] in PLACEMENTS:
            kw["placement"] = PLACEMENTS[kw["placement"]] or SPLIT
        strategy = HierarchicalStrategy(**kw)
    kw: Dict[str, Any] = {}
    if "ckpt_dir" in spec:  # a checkpoint every ckpt_every steps
        every = spec["ckpt_every"]
        ckpt = ModelCheckpoint(spec["ckpt_dir"], every_n_train_steps=every, save_top_k=-1)
        kw = {"enable_checkpointing": True, "callbacks": [ckpt]}
    if "log_dir" in spec:
        kw["logger"] = TensorBoardLogger(spec["log_dir"], name="", version="")
        kw["log_every_n_steps"] = 2
    nodes = int(spec.get("num_nodes", 1))
    kw["num_nodes"] = nodes
    trainer = pl.Trainer(**{**QUIET_TRAINER_ARGS, "accelerator": "cpu", "devices": devices // nodes,
                            "strategy": strategy, "max_steps": spec["steps"], "max_epochs": spec.get("epochs"),
                            **kw})  # fmt: skip
    trainer.fit(model, datamodule=dm, ckpt_path=spec.get("resume"))
    state = _state(model)
    if spec.get("validate"):  # the validation log-loss after the fit (the mean over the ranks' shards)
        trainer.limit_val_batches = 1.0
        state["val/logloss"] = torch.tensor(
            trainer.validate(model, datamodule=dm, verbose=False)[0]["val/logloss"]
        )
    return state


def main(out: str, runs: str) -> None:
    for spec in json.loads(runs):
        state = run(spec, int(torch.distributed.get_world_size()) if dist.is_initialized() else _world())
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, state)
        if dist.get_rank() == 0:
            torch.save(gathered, Path(out) / f"{spec['name']}.pt")
    # Every rank ends its process groups together: left to the interpreter's exit, a gloo group's worker threads
    # could be destroyed unjoined ("terminate called without an active exception", seen once on a loaded machine).
    dist.barrier()
    dist.destroy_process_group()


def _world() -> int:
    import os

    return int(os.environ["WORLD_SIZE"])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
