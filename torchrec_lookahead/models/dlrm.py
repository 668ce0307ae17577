"""DLRM as a LightningModule: TorchRec's ``DLRM`` with BCE loss, AUC and log-loss.

The embedding tables are built on the ``meta`` device in :meth:`DLRMModule.configure_model`; the
``torchrec`` strategy shards them with ``DistributedModelParallel`` (which materialises them), and the
embedding optimizer is declared on the table parameters with TorchRec's ``apply_optimizer_in_backward`` so
that any sharder fuses it into the embedding kernel. Under another strategy the tables are materialised on
the module's device and trained by an ordinary optimizer of the same kind.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import torch
import torchmetrics
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from typing_extensions import override

from torchrec_lookahead.errors import ConfigError, SetupError
from torchrec_lookahead.optim import DenseOptimizerSpec, EmbeddingOptimizerSpec, StepOnceCombinedOptimizer

__all__ = ["DLRMModule", "table_configs"]


def table_configs(num_embeddings_per_feature: Dict[str, int], embedding_dim: int) -> List[EmbeddingBagConfig]:
    """One table per feature, named ``t_<feature>``.

    Raises:
        ConfigError: a table size below 1 or an empty mapping.

    Example:
        >>> [t.name for t in table_configs({"a": 10, "b": 5}, 4)]
        ['t_a', 't_b']
    """
    if not num_embeddings_per_feature:
        raise ConfigError("num_embeddings_per_feature is empty; the model needs at least one sparse feature")
    out = []
    for feature, n in num_embeddings_per_feature.items():
        if int(n) < 1:
            raise ConfigError(
                f"Table size for feature '{feature}' must be a positive integer but got {n}; give every table >= 1 row"
            )
        out.append(
            EmbeddingBagConfig(
                name=f"t_{feature}",
                embedding_dim=embedding_dim,
                num_embeddings=int(n),
                feature_names=[feature],
            )
        )
    return out


class DLRMModule(pl.LightningModule):
    """TorchRec DLRM trained on batches of :class:`~torchrec.datasets.utils.Batch`.

    Args:
        num_embeddings_per_feature: rows of each sparse feature's table (the CLI links it from the data).
        num_dense_features: dense inputs per sample (linked from the data by the CLI).
        embedding_dim: embedding width (also the last dense-arch layer).
        dense_arch_layer_sizes: bottom MLP; its last size must equal ``embedding_dim``.
        over_arch_layer_sizes: top MLP; its last size must be 1.
        embedding_optimizer: the embedding tables' optimizer.
        dense_optimizer: the dense layers' optimizer.

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
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if num_embeddings_per_feature is None:
            raise ConfigError(
                "num_embeddings_per_feature is required: pass the DataModule's num_embeddings_per_feature "
                "(the CLI links it automatically)"
            )
        if num_dense_features < 1:
            raise ConfigError(f"Expected num_dense_features >= 1 but got {num_dense_features}")
        self.dense_arch_layer_sizes = list(dense_arch_layer_sizes or [64, embedding_dim])
        self.over_arch_layer_sizes = list(over_arch_layer_sizes or [64, 32, 1])
        if self.dense_arch_layer_sizes[-1] != embedding_dim:
            raise ConfigError(
                f"The last dense_arch_layer_sizes entry must equal embedding_dim={embedding_dim} but got "
                f"{self.dense_arch_layer_sizes}"
            )
        if len(self.over_arch_layer_sizes) < 2:
            raise ConfigError(
                f"over_arch_layer_sizes needs at least two layers (TorchRec's OverArch) but got {self.over_arch_layer_sizes}"
            )
        if self.over_arch_layer_sizes[-1] != 1:
            raise ConfigError(
                f"The last over_arch_layer_sizes entry must be 1 but got {self.over_arch_layer_sizes}"
            )
        self.tables = table_configs(dict(num_embeddings_per_feature), embedding_dim)
        self.num_dense_features = num_dense_features
        self.embedding_optimizer = embedding_optimizer or EmbeddingOptimizerSpec()
        self.dense_optimizer = dense_optimizer or DenseOptimizerSpec()
        self.model: Optional[nn.Module] = None
        self.loss_fn = nn.BCEWithLogitsLoss()
        self.val_auc = torchmetrics.classification.BinaryAUROC()
        self.test_auc = torchmetrics.classification.BinaryAUROC()
        self.val_logloss = torchmetrics.MeanMetric()
        self.test_logloss = torchmetrics.MeanMetric()

    def build_model(self, device: torch.device, dense_device: Optional[torch.device] = None) -> DLRM:
        """The unsharded DLRM with its tables on ``device`` (``meta`` for sharding) and its dense layers on
        ``dense_device`` (default ``device``; real tensors, so that they are initialised from the seed
        before any table is)."""
        ebc = EmbeddingBagCollection(tables=self.tables, device=device)
        dense_device = dense_device or device
        return DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=self.num_dense_features,
            dense_arch_layer_sizes=self.dense_arch_layer_sizes,
            over_arch_layer_sizes=self.over_arch_layer_sizes,
            dense_device=dense_device,
        )

    def _sharded(self) -> bool:
        trainer = self._trainer
        return trainer is not None and getattr(trainer.strategy, "shards_embeddings", False)

    @override
    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self._sharded():
            model = self.build_model(torch.device("meta"), dense_device=self.trainer.strategy.root_device)
            ebc = model.sparse_arch.embedding_bag_collection
            apply_optimizer_in_backward(
                self.embedding_optimizer.optimizer_class(),
                ebc.parameters(),
                self.embedding_optimizer.optimizer_kwargs(),
            )
        else:
            model = self.build_model(self.device)
        self.model = model

    def _require_model(self) -> nn.Module:
        if self.model is None:
            raise SetupError(
                "The model is not built yet; call configure_model() (the Trainer does it in fit/validate)"
            )
        return self.model

    @override
    def forward(self, dense_features: torch.Tensor, sparse_features: Any) -> torch.Tensor:  # type: ignore[override]
        return self._require_model()(dense_features, sparse_features).squeeze(-1)

    def _step(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self(batch.dense_features, batch.sparse_features)
        return self.loss_fn(logits, batch.labels), logits

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:  # type: ignore[override]
        loss, _ = self._step(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch.labels.numel())
        return loss

    def _eval_step(self, batch: Batch, prefix: str) -> torch.Tensor:
        loss, logits = self._step(batch)
        auc = self.val_auc if prefix == "val" else self.test_auc
        logloss = self.val_logloss if prefix == "val" else self.test_logloss
        auc.update(torch.sigmoid(logits.detach()), batch.labels.long())
        logloss.update(loss.detach(), weight=batch.labels.numel())
        n = batch.labels.numel()
        self.log(f"{prefix}/auc", auc, prog_bar=True, on_step=False, on_epoch=True, batch_size=n)
        self.log(f"{prefix}/logloss", logloss, prog_bar=True, on_step=False, on_epoch=True, batch_size=n)
        return loss

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:  # type: ignore[override]
        return self._eval_step(batch, "val")

    @override
    def test_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:  # type: ignore[override]
        return self._eval_step(batch, "test")

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        model = self._require_model()
        fused = getattr(model, "fused_optimizer", None)
        if fused is None:
            if self._sharded():
                raise SetupError(
                    "The torchrec strategy did not shard the model; no fused embedding optimizer found"
                )
            emb = self.embedding_optimizer
            ebc_params = list(model.sparse_arch.parameters())  # type: ignore[union-attr]
            ebc_ids = {id(p) for p in ebc_params}
            dense = [p for p in model.parameters() if id(p) not in ebc_ids]
            opt = emb.build_unfused(ebc_params)
            dense_opt = self.dense_optimizer.build(dense)
            return _ChainedOptimizer([opt, dense_opt])
        dense_params = dict(in_backward_optimizer_filter(model.named_parameters()))
        dense_opt = KeyedOptimizerWrapper(dense_params, lambda ps: self.dense_optimizer.build(ps))
        return StepOnceCombinedOptimizer([("embeddings", fused), ("dense", dense_opt)])


class _ChainedOptimizer(torch.optim.Optimizer):
    """Several torch optimizers stepped as one (closure evaluated once); for unsharded training."""

    def __init__(self, optimizers: List[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
        super().__init__(params, {})
        self.param_groups = [g for o in optimizers for g in o.param_groups]

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        for o, s in zip(self.optimizers, state_dict["optimizers"]):
            o.load_state_dict(s)
