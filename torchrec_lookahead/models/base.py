"""``TorchRecModule``: what every bundled LightningModule around a TorchRec model shares.

A subclass says how to build its TorchRec model (:meth:`TorchRecModule.build_model`); this class builds it on
the ``meta`` device for the ``torchrec`` strategy (``DistributedModelParallel`` materialises the tables, with any
sharder, the lookahead one included) and declares the embedding optimizer on every embedding collection with
TorchRec's ``apply_optimizer_in_backward``, so that the sharder fuses it into the embedding kernel. Under
another strategy the tables are materialised on the module's device and trained by an ordinary optimizer of
the same kind. Training, evaluation (BCE, AUC, log-loss) and prediction (``predict_step``: probabilities) are the same
for all.
"""

from __future__ import annotations

import abc
import os
from pathlib import Path
from typing import IO, Any, Dict, List, Optional, Union

import lightning.pytorch as pl
import torch
import torchmetrics
from lightning.pytorch.utilities.model_helpers import _restricted_classmethod
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from typing_extensions import override

from torchrec_lookahead._checks import check_dataclass
from torchrec_lookahead.errors import CheckpointError, ConfigError, SetupError
from torchrec_lookahead.optim import DenseOptimizerSpec, EmbeddingOptimizerSpec, StepOnceCombinedOptimizer

__all__ = ["TorchRecModule", "embedding_modules", "require_positive", "make_table_configs"]


def make_table_configs(
    num_embeddings_per_feature: Dict[str, int], embedding_dim: int
) -> List[EmbeddingBagConfig]:
    """One table per feature, named ``t_<feature>``.

    Raises:
        ConfigError: a table size below 1 or an empty mapping.

    Example:
        >>> [t.name for t in make_table_configs({"a": 10, "b": 5}, 4)]
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


def require_positive(**sizes: int) -> None:
    """Refuse any size below 1, naming it.

    Raises:
        ConfigError: ``Expected <name> >= 1 but got <value>`` for the first size below 1.

    Example:
        >>> require_positive(hidden_layer_size=0)
        Traceback (most recent call last):
        ...
        torchrec_lookahead.errors.ConfigError: Expected hidden_layer_size >= 1 but got 0
    """
    for name, value in sizes.items():
        if value < 1:
            raise ConfigError(f"Expected {name} >= 1 but got {value}")


def embedding_modules(model: nn.Module) -> List[nn.Module]:
    """The unsharded TorchRec embedding collections (``EmbeddingBagCollection``, ``EmbeddingCollection``) in
    ``model``, in module order.

    Example:
        >>> ebc = EmbeddingBagCollection(tables=make_table_configs({"a": 3}, 2))
        >>> embedding_modules(nn.Sequential(ebc)) == [ebc]
        True
    """
    return [m for m in model.modules() if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))]


class TorchRecModule(pl.LightningModule, abc.ABC):
    """A TorchRec model trained on batches of :class:`~torchrec.datasets.utils.Batch` with binary labels.

    The CLI and ``verify`` take any subclass; a subclass implements :meth:`build_model` and passes its own
    arguments on to this constructor.

    Args:
        num_embeddings_per_feature: rows of each sparse feature's table (the CLI links it from the data).
        num_dense_features: dense inputs per sample (linked from the data by the CLI).
        embedding_dim: embedding width.
        embedding_optimizer: the embedding tables' optimizer: an
            :class:`~torchrec_lookahead.optim.EmbeddingOptimizerSpec`, or a dict of its fields as a config
            writes it (``{"name": "rowwise_adagrad", "lr": 0.05}``).
        dense_optimizer: the dense layers' optimizer: a :class:`~torchrec_lookahead.optim.DenseOptimizerSpec`,
            or a dict of its fields (``{"name": "adagrad", "lr": 0.05}``).

    Raises:
        ConfigError: an optimizer is neither, or its dict has a key the spec does not (the message lists them).

    Attributes:
        output_is_probability: ``True`` where the TorchRec model ends in a sigmoid (its output is a
            probability, trained with BCE); ``False`` where it returns logits (BCE with logits).
    """

    output_is_probability: bool = False

    def __init__(
        self,
        num_embeddings_per_feature: Optional[Dict[str, int]] = None,
        num_dense_features: int = 13,
        embedding_dim: int = 16,
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
        require_positive(num_dense_features=num_dense_features, embedding_dim=embedding_dim)
        self.tables = make_table_configs(dict(num_embeddings_per_feature), embedding_dim)
        self.num_dense_features = num_dense_features
        # a dict is built into its spec as a config's {name: ..., lr: ...} is
        self.embedding_optimizer: EmbeddingOptimizerSpec = (
            EmbeddingOptimizerSpec()
            if embedding_optimizer is None
            else check_dataclass("embedding_optimizer", embedding_optimizer, EmbeddingOptimizerSpec)
        )
        self.dense_optimizer: DenseOptimizerSpec = (
            DenseOptimizerSpec()
            if dense_optimizer is None
            else check_dataclass("dense_optimizer", dense_optimizer, DenseOptimizerSpec)
        )
        self.model: Optional[nn.Module] = None
        self.loss_fn: nn.Module = nn.BCELoss() if self.output_is_probability else nn.BCEWithLogitsLoss()
        self.val_auc = torchmetrics.classification.BinaryAUROC()
        self.test_auc = torchmetrics.classification.BinaryAUROC()
        self.val_logloss = torchmetrics.MeanMetric()
        self.test_logloss = torchmetrics.MeanMetric()

    @_restricted_classmethod  # Lightning's: called on an instance, a TypeError (it returns a new model)
    def load_from_checkpoint(
        cls,
        checkpoint_path: Union[str, Path, IO],
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """Lightning's :meth:`~lightning.pytorch.core.LightningModule.load_from_checkpoint`, for a checkpoint
        file. A checkpoint of ``strategy='torchrec'`` is a directory (``torch.distributed.checkpoint``, sharded):
        export it to one file first (``python -m torchrec_lookahead export``), or resume from it with
        ``Trainer.fit(..., ckpt_path=...)``.

        Raises:
            CheckpointError: ``checkpoint_path`` is a directory.
        """
        if isinstance(checkpoint_path, (str, os.PathLike)) and os.path.isdir(checkpoint_path):
            path = os.fspath(checkpoint_path)
            what = (
                "a sharded checkpoint directory (torch.distributed.checkpoint, written by strategy='torchrec')"
                if os.path.isfile(os.path.join(path, ".metadata"))
                else "a directory, not a checkpoint file"
            )
            raise CheckpointError(
                f"{cls.__name__}.load_from_checkpoint: {path!r} is {what}; export it to one file "
                f"(`python -m torchrec_lookahead export --ckpt {path} --out model.ckpt`, or "
                "torchrec_lookahead.export.export_checkpoint) and load that, or resume from it with "
                "Trainer.fit(..., ckpt_path=...)"
            )
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    @abc.abstractmethod
    def build_model(self, device: torch.device, dense_device: Optional[torch.device] = None) -> nn.Module:
        """The unsharded TorchRec model, called as ``model(dense_features, sparse_features)`` with an output
        of shape (B, 1), its tables (built from :attr:`tables`) on ``device`` (``meta`` for sharding) and its
        dense layers on ``dense_device`` (default ``device``; real tensors, so that they are initialised from
        the seed before any table is)."""

    def _sharded(self) -> bool:
        trainer = self._trainer
        return trainer is not None and getattr(trainer.strategy, "shards_embeddings", False)

    @override
    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self._sharded():
            model = self.build_model(torch.device("meta"), dense_device=self.trainer.strategy.root_device)
            for collection in embedding_modules(model):
                apply_optimizer_in_backward(
                    self.embedding_optimizer.optimizer_class(),
                    collection.parameters(),
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
        """The model's output per sample, shape (B,): logits, or probabilities where
        :attr:`output_is_probability`."""
        return self._require_model()(dense_features, sparse_features).squeeze(-1)

    def probabilities(self, output: torch.Tensor) -> torch.Tensor:
        """Click probabilities from :meth:`forward`'s output."""
        return output if self.output_is_probability else torch.sigmoid(output)

    def _step(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        output = self(batch.dense_features, batch.sparse_features)
        return self.loss_fn(output, batch.labels), output

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:  # type: ignore[override]
        loss, _ = self._step(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch.labels.numel())
        return loss

    def _eval_step(self, batch: Batch, prefix: str) -> torch.Tensor:
        loss, output = self._step(batch)
        auc = self.val_auc if prefix == "val" else self.test_auc
        logloss = self.val_logloss if prefix == "val" else self.test_logloss
        auc.update(self.probabilities(output.detach()), batch.labels.long())
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
    def predict_step(self, batch: Batch, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:  # type: ignore[override]
        """Click probabilities of the batch's samples, shape (B,) (``predict``; write them with
        :class:`~torchrec_lookahead.callbacks.PredictionWriter`)."""
        return self.probabilities(self(batch.dense_features, batch.sparse_features).detach())

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        model = self._require_model()
        fused = getattr(model, "fused_optimizer", None)
        if fused is None:
            if self._sharded():
                raise SetupError(
                    "The torchrec strategy did not shard the model; no fused embedding optimizer found"
                )
            emb_params = [p for m in embedding_modules(model) for p in m.parameters()]
            emb_ids = {id(p) for p in emb_params}
            dense = [p for p in model.parameters() if id(p) not in emb_ids]
            opt = self.embedding_optimizer.build_unfused(emb_params)
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
