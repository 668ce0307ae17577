"""``PredictionWriter``: the probabilities of ``predict`` in a file, one per rank.

LightningCLI's ``predict`` subcommand keeps nothing of what the model returns; with this callback in the
config (or ``--trainer.callbacks+=torchrec_lookahead.callbacks.PredictionWriter``) it writes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from typing_extensions import override

from torchrec_lookahead._checks import check_output_file
from torchrec_lookahead._disk_space import free_bytes, out_of_space
from torchrec_lookahead.errors import ConfigError

__all__ = ["PredictionWriter"]


class PredictionWriter(BasePredictionWriter):
    """Write the predictions of a ``predict`` run, in batch order, as one tensor saved with ``torch.save``.

    Args:
        path: the file; with several ranks each writes ``<stem>.rank<r><suffix>`` (its own samples).

    Example:
        >>> PredictionWriter("predictions.pt").path.name
        'predictions.pt'
    """

    def __init__(self, path: str = "predictions.pt") -> None:
        super().__init__(write_interval="epoch")
        self.path = Path(path)

    def rank_path(self, rank: int, world_size: int) -> Path:
        """Where rank ``rank`` of ``world_size`` writes."""
        if world_size == 1:
            return self.path
        return self.path.with_name(f"{self.path.stem}.rank{rank}{self.path.suffix}")

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse a path that cannot be written before anything is predicted, not after (the predictions lost).

        Raises:
            ConfigError: this rank's path is a directory, lies under a file, or is in a directory that cannot be
                written (and, from ``write_on_epoch_end``, when its disk is full).
        """
        if stage == "predict":
            check_output_file(
                "path of PredictionWriter", str(self.rank_path(trainer.global_rank, trainer.world_size))
            )

    @override
    def write_on_epoch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        predictions: Sequence[Any],
        batch_indices: Optional[Sequence[Any]],
    ) -> None:
        # one dataloader: a list of per-batch tensors; several: a list per dataloader
        batches = (
            [p for group in predictions for p in group]
            if predictions and isinstance(predictions[0], list)
            else predictions
        )
        out = torch.cat([p.reshape(-1).cpu() for p in batches]) if batches else torch.empty(0)
        path = self.rank_path(trainer.global_rank, trainer.world_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        free = free_bytes(path.parent)  # before: a failed write holds its bytes
        try:
            torch.save(out, tmp)
            tmp.replace(path)  # nothing half-written at ``path``
        except BaseException as e:
            tmp.unlink(missing_ok=True)  # nor beside it
            if isinstance(e, Exception) and out_of_space(e):
                room = "" if free is None else f"; {free:,} bytes were free there"
                raise ConfigError(
                    f"path of PredictionWriter '{path}' cannot be written: no space left on its disk (the "
                    f"predictions take about {out.numel() * out.element_size():,} bytes{room}); nothing was "
                    "written: free space or choose another path"
                ) from e
            raise
