"""``WrappedDataModule``: a DataModule that changes how another one's training batches are served.

:class:`~torchrec_lookahead.data.LookaheadDataModule` (plans the cached tables ahead) and
:class:`~torchrec_lookahead.fae.HotColdDataModule` (regroups samples into hot and cold mini-batches) both
wrap a user's DataModule: everything but ``train_dataloader`` passes through to it (its batch hooks too), and
the model's table sizes and dense width are read from it (the CLI links them).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from torchrec_lookahead.errors import ConfigError

__all__ = [
    "WrappedDataModule",
    "trainer_datamodules",
    "overridden_batch_hooks",
    "innermost_datamodule",
    "BATCH_HOOKS",
    "PLANNED_BATCH_HOOKS",
]

#: Lightning's hooks around a batch's move to the device, which a DataModule and a LightningModule may override
BATCH_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")
#: those that see a training batch's sparse features as they are planned, cache slots (``transfer_batch_to_device``
#: only moves the batch, after the plan is applied)
PLANNED_BATCH_HOOKS = ("on_before_batch_transfer", "on_after_batch_transfer")


class WrappedDataModule(pl.LightningDataModule):
    """Pass-through of a wrapped DataModule's set-up, evaluation loaders, sizes and state.

    Args:
        datamodule: the wrapped DataModule (its training batches are what subclasses serve differently).

    Example:
        >>> from torchrec_lookahead.data import CriteoSyntheticDataModule
        >>> inner = CriteoSyntheticDataModule(batch_size=8, num_train_batches=2, scale=0.0001, min_rows=10)
        >>> WrappedDataModule(inner).num_dense_features
        13
    """

    def __init__(self, datamodule: pl.LightningDataModule) -> None:
        super().__init__()
        if not callable(getattr(datamodule, "train_dataloader", None)):
            raise ConfigError(
                f"datamodule must be a LightningDataModule (one with train_dataloader) but got "
                f"{type(datamodule).__name__}; wrap the DataModule that serves the training batches"
            )
        self.datamodule = datamodule
        # the wrapped DataModule's own batch hooks, and only those: Lightning runs a DataModule's hook instead of
        # the LightningModule's where the DataModule overrides it
        for hook in overridden_batch_hooks(datamodule, pl.LightningDataModule):
            setattr(self, hook, getattr(datamodule, hook))

    def __str__(self) -> str:
        # LightningDataModule's __str__ builds the training loader (a LookaheadDataModule's before the Trainer
        # exists); LightningCLI's argument links print a DataModule when it lacks a linked attribute.
        return f"{type(self).__name__}({type(self.datamodule).__name__})"

    @property
    def num_embeddings_per_feature(self) -> Dict[str, int]:
        return self.datamodule.num_embeddings_per_feature  # type: ignore[attr-defined, no-any-return]

    @property
    def num_dense_features(self) -> int:
        return self.datamodule.num_dense_features  # type: ignore[attr-defined, no-any-return]

    @override
    def prepare_data(self) -> None:
        self.datamodule.prepare_data()

    @override
    def setup(self, stage: str) -> None:
        self.datamodule.trainer = self.trainer
        self.datamodule.setup(stage)

    @override
    def teardown(self, stage: str) -> None:
        self.datamodule.teardown(stage)

    @override
    def val_dataloader(self) -> Any:
        return self.datamodule.val_dataloader()

    @override
    def test_dataloader(self) -> Any:
        return self.datamodule.test_dataloader()

    @override
    def predict_dataloader(self) -> Any:
        return self.datamodule.predict_dataloader()

    @override
    def state_dict(self) -> Dict[str, Any]:
        return {"datamodule": self.datamodule.state_dict()}

    @override
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.datamodule.load_state_dict(state_dict.get("datamodule", {}))


def innermost_datamodule(datamodule: pl.LightningDataModule) -> pl.LightningDataModule:
    """The user's DataModule inside ``datamodule`` and the wrappers around it (itself when it wraps none)."""
    while isinstance(datamodule, WrappedDataModule):
        datamodule = datamodule.datamodule
    return datamodule


def overridden_batch_hooks(obj: object, base: type, hooks: Tuple[str, ...] = BATCH_HOOKS) -> List[str]:
    """The batch ``hooks`` (default :data:`BATCH_HOOKS`) that ``obj``'s class overrides from ``base``.

    Example:
        >>> class Casting(pl.LightningDataModule):
        ...     def on_after_batch_transfer(self, batch, dataloader_idx):
        ...         return batch
        >>> overridden_batch_hooks(Casting(), pl.LightningDataModule)
        ['on_after_batch_transfer']
    """
    return [h for h in hooks if is_overridden(h, obj, base)]


def trainer_datamodules(
    trainer: Optional[pl.Trainer],
) -> Tuple[Optional[pl.LightningDataModule], Optional[pl.LightningDataModule]]:
    """The DataModule ``trainer`` trains on and the one it wraps (the same DataModule when it is not a
    :class:`WrappedDataModule`; ``None`` without a Trainer or a DataModule).

    Example:
        >>> trainer_datamodules(None)
        (None, None)
    """
    dm = getattr(trainer, "datamodule", None)  # set on the Trainer by Lightning's data connector
    return dm, (dm.datamodule if isinstance(dm, WrappedDataModule) else dm)
