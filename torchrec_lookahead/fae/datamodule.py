"""The hot/cold DataModule: wraps any DataModule of TorchRec batches and serves FAE's all-hot and cold
mini-batches, calibrating (or loading) the hot set first."""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from torchrec_lookahead._checks import check_int, check_output_file
from torchrec_lookahead.data.wrapper import WrappedDataModule
from torchrec_lookahead.errors import CheckpointError, ConfigError, SetupError
from torchrec_lookahead.fae.calibrator import calibrate, recalibrate_counts
from torchrec_lookahead.fae.config import CalibrationConfig
from torchrec_lookahead.fae.hotset import HotSet, fingerprint
from torchrec_lookahead.fae.loader import HotColdLoader
from torchrec_lookahead.fae.lookahead import ColdBatches, HotColdLookaheadLoader, pinned_lookahead_loader
from torchrec_lookahead.fae.samples import Samples
from torchrec_lookahead.fae.stream import HotColdStream, classify_epoch
from torchrec_lookahead.runtime import CacheSession
from torchrec_lookahead.runtime.types import LookaheadFactory, PinnedLoaderOptions

__all__ = ["HotColdDataModule", "calibration_source", "RECALIBRATE"]

#: the values of ``HotColdDataModule(recalibrate=...)``: never (``None``) or between epochs
RECALIBRATE = (None, "epoch")

log = logging.getLogger(__name__)


def calibration_source(datamodule: pl.LightningDataModule) -> Any:
    """The global training stream to calibrate on: one rank's view of the whole data set.

    A :class:`~torchrec_lookahead.data.RecDataModule` builds its training dataset for a single rank (random
    access where it has it); any other DataModule gives its training loader.
    """
    make = getattr(datamodule, "_make_dataset", None)
    if callable(make):
        ds = make("train", 1, 0)
        if ds is not None:
            return ds
        return []
    return datamodule.train_dataloader()


def _world(group: Optional[Any] = None) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group), dist.get_rank(group)
    return 1, 0


def _gather(group: Optional[Any]) -> Any:
    def gather(s: Samples) -> Samples:
        world, _ = _world(group)
        parts: List[Any] = [None] * world
        dist.all_gather_object(parts, s.tensors(), group=group)
        return s.joined(parts)

    return gather


class HotColdDataModule(WrappedDataModule):
    """Wrap a DataModule of TorchRec batches so that training reads FAE's all-hot and cold mini-batches.

    In ``setup`` the hot set is loaded from ``hot_set`` when that file exists (and checked against the
    tables), otherwise calibrated on the training data (rank 0, then broadcast) and, with a ``hot_set`` path,
    saved there. Training batches are then regrouped by a
    :class:`~torchrec_lookahead.fae.stream.HotColdStream`; validation and test batches pass through.

    Args:
        datamodule: any DataModule yielding :class:`~torchrec.datasets.utils.Batch` es.
        hot_budget_bytes: per-rank bytes for the hot rows (weights plus optimizer state).
        hot_set: a saved hot set to load, or where to save the calibrated one.
        batch_size: rows per regrouped batch per rank (default: the rows of the wrapped DataModule's largest
            training batch).
        window: source batches of samples that may wait to be regrouped (memory bound, >= 2).
        sample_fraction: calibration sample (FAE: 5 %).
        num_chunks: Rand-Em Box chunks per table (FAE's box; the box grows from there, see ``box_tolerance``).
        chunk_rows: rows per chunk.
        box_tolerance: the box draws more chunks while its estimate's interval is wider than this share of the
            estimate (``None``: FAE's fixed box).
        box_max_share: the most chunks the box grows to, as a share of a table's chunks.
        confidence: t-interval confidence.
        small_table_bytes: tables smaller than this are wholly hot.
        calibration_seed: seed of the sample and the chunks.
        embedding_dim: embedding width (default: the model's ``embedding_dim``).
        optimizer: embedding optimizer name (default: the model's).
        recalibrate: ``None`` (default): the hot set is fixed. ``"epoch"``: when an epoch's last batch is handed
            out, the hot set is recomputed from the exact access counts of that epoch's (global) samples with the
            same budget and rules as the calibrator (:func:`~torchrec_lookahead.fae.calibrator.recalibrate_counts`)
            and is in force from the next epoch on (rows promoted and demoted; with pinned hot rows the strategy's
            epoch-start flush writes every row back and the new hot rows are pinned). The loaders are then rebuilt
            every epoch (``reload_dataloaders_every_n_epochs`` is set to 1; another value is refused), and the hot
            sets in force and next are part of the DataModule's checkpoint state.

    Example:
        >>> from torchrec_lookahead.data import CriteoSyntheticDataModule
        >>> inner = CriteoSyntheticDataModule(batch_size=64, num_train_batches=20, scale=0.0005)
        >>> dm = HotColdDataModule(inner, hot_budget_bytes=2 << 20, sample_fraction=0.5, embedding_dim=8)
        >>> dm.setup("fit")
        >>> loader = dm.train_dataloader()
        >>> sum(loader.batches_per_epoch().values()) == len(loader), next(iter(loader)).labels.shape[0]
        (True, 64)
    """

    def __init__(
        self,
        datamodule: pl.LightningDataModule,
        hot_budget_bytes: int,
        hot_set: Optional[str] = None,
        batch_size: Optional[int] = None,
        window: int = 64,
        sample_fraction: float = 0.05,
        num_chunks: int = 35,
        chunk_rows: int = 1024,
        box_tolerance: Optional[float] = 0.1,
        box_max_share: float = 0.25,
        confidence: float = 0.999,
        small_table_bytes: int = 1 << 20,
        calibration_seed: int = 0,
        embedding_dim: Optional[int] = None,
        optimizer: Optional[str] = None,
        recalibrate: Optional[str] = None,
    ) -> None:
        super().__init__(datamodule)
        if not any(
            recalibrate is v or (isinstance(recalibrate, str) and recalibrate == v) for v in RECALIBRATE
        ):
            raise ConfigError(
                f"Expected recalibrate None (a fixed hot set) or 'epoch' (re-estimated between epochs) but got "
                f"{recalibrate!r}"
            )
        self.recalibrate = recalibrate
        self.calibration: Dict[str, Any] = dict(
            hot_budget_bytes=hot_budget_bytes,
            sample_fraction=sample_fraction,
            num_chunks=num_chunks,
            chunk_rows=chunk_rows,
            box_tolerance=box_tolerance,
            box_max_share=box_max_share,
            confidence=confidence,
            small_table_bytes=small_table_bytes,
            seed=calibration_seed,
        )
        CalibrationConfig(**self.calibration, embedding_dim=embedding_dim or 1, optimizer=optimizer or "sgd")
        if batch_size is not None:
            check_int("batch_size", batch_size, 1, "give the rows of a batch, or leave it unset")
        check_int("window", window, 2, "give the source batches mixed into hot and cold batches")
        if hot_set is not None and not isinstance(hot_set, (str, os.PathLike)):
            raise ConfigError(
                f"Expected hot_set to be a file path (a hot set to load, or where to save one) but got {hot_set!r}"
            )
        hot_set = None if hot_set is None else os.fspath(hot_set)
        if hot_set is not None and not os.path.isfile(hot_set):  # calibrated, then saved there
            check_output_file("hot_set", hot_set)
        self.hot_set_path = hot_set
        self.batch_size = batch_size
        self.window = window
        self.embedding_dim = embedding_dim
        self.optimizer = optimizer
        self.hot_set: Optional[HotSet] = None
        #: the fingerprint of the fixed hot set a resumed checkpoint trained with (checked when the set is known)
        self._resumed_fingerprint: Optional[str] = None
        #: with ``recalibrate="epoch"``: the hot set of the next epoch, computed at the end of this one
        self.next_hot_set: Optional[HotSet] = None
        #: with ``recalibrate="epoch"``: per recalibration, the rows promoted and demoted per table and in all
        self.recalibrations: List[Dict[str, Any]] = []
        self.loader: Optional[HotColdLoader] = None
        self._num_samples: Optional[tuple[int, int]] = None
        self._source_batch = 0

    def calibration_config(self, model: Optional[pl.LightningModule] = None) -> CalibrationConfig:
        """The calibrator's settings, with the embedding width and optimizer taken from ``model`` unless given.

        Raises:
            ConfigError: neither this DataModule nor the model names the embedding width.
        """
        dim = self.embedding_dim
        if dim is None and model is not None:
            dim = model.hparams.get("embedding_dim")
        if dim is None:
            raise ConfigError(
                "HotColdDataModule needs the embedding width to size the hot set: pass embedding_dim or train a "
                "model with an 'embedding_dim' hyper-parameter"
            )
        opt = self.optimizer
        declared = getattr(model, "embedding_optimizer", None)  # the package's models name theirs
        if opt is None and declared is not None:
            opt = str(declared.name)
        return CalibrationConfig(
            **self.calibration, embedding_dim=int(dim), optimizer=opt or "rowwise_adagrad"
        )

    def _model(self) -> Optional[Any]:
        trainer = self.trainer
        return None if trainer is None else trainer.lightning_module

    def load_or_calibrate(self) -> HotSet:
        """The hot set: loaded from ``hot_set`` if that file exists, else calibrated (and saved there)."""
        sizes = self.num_embeddings_per_feature
        path = self.hot_set_path
        config = self.calibration_config(self._model())
        if path and os.path.isfile(path):
            hs = HotSet.load(path)
            hs.check_model(sizes)
            hs.check_budget(config)
            rank_zero_info(f"Loaded the hot set {path}: {sum(hs.hot_rows.values()):,} hot rows")
            return self._as_resumed(hs)
        world, rank = _world()
        hs_or_none: List[Optional[HotSet]] = [None]
        if rank == 0:
            made = calibrate(calibration_source(self.datamodule), sizes, config)
            if path:
                made.save(path)
            hs_or_none[0] = made
        if world > 1:
            dist.broadcast_object_list(hs_or_none, src=0)
        received = hs_or_none[0]
        if received is None:
            raise SetupError("The hot set was not received from rank 0")
        rank_zero_info("\n" + received.report())
        return self._as_resumed(received)

    def _as_resumed(self, hs: HotSet) -> HotSet:
        """``hs``, after checking it is the hot set the resumed checkpoint trained with (a fixed hot set is not
        saved in checkpoints, only its fingerprint: the loader's position counts hot and cold batches of it).

        Raises:
            CheckpointError: the checkpoint's hot set was another one.
        """
        expected = self._resumed_fingerprint
        if expected is not None and fingerprint(hs) != expected:
            raise CheckpointError(
                "the checkpoint was trained with another hot set than this run's (hot_budget_bytes, the hot_set "
                "file, recalibrate or the calibration settings differ): its loader position counts the other set's "
                "hot and cold batches; resume with the settings it was trained with, or start a new run from its "
                "weights"
            )
        return hs

    # The lookahead cache's plug-in (runtime.types.PinnedRowsSource): the hot rows pinned in the caches.
    def pinned_hot_ids(self) -> Dict[str, torch.Tensor]:
        """Table -> sorted hot ids, the rows the lookahead cache pins, after loading or calibrating the hot set
        now if ``setup`` has not (it is kept for training): the strategy takes them off a device budget while
        sharding."""
        if self.hot_set is None:
            self.hot_set = self.load_or_calibrate()
        return {name: table.hot_ids for name, table in self.hot_set.tables.items()}

    def cold_batches(self) -> ColdBatches:
        """The epoch's cold batches in order, from a new training loader: what the dynamic part of a cache with
        pinned hot rows serves, so the budget planner sizes it from them."""
        return ColdBatches(self.train_dataloader().stream)

    def pinned_loader(
        self, inner: Any, session: CacheSession, lookahead: LookaheadFactory, options: PinnedLoaderOptions
    ) -> HotColdLookaheadLoader:
        """The training loader with the hot rows pinned in the caches of ``session`` and the cold batches planned
        ahead (:func:`~torchrec_lookahead.fae.lookahead.pinned_lookahead_loader`); ``inner`` is this
        DataModule's training loader.

        Raises:
            ConfigError: a ``batch_adapter``, cDLRM averaging or the ``window`` policy (pinned rows support none).
            SetupError: no hot set yet (``setup("fit")`` not called).
            CapacityError: the hot rows leave a cached table no dynamic slot, or a cold window does not fit.
        """
        return pinned_lookahead_loader(inner, self.hot_set, session, lookahead, options)

    @override
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit" and self.recalibrate is not None and self.trainer is not None:
            every = getattr(self.trainer, "reload_dataloaders_every_n_epochs", 0)
            if every not in (0, 1):
                raise ConfigError(
                    f"recalibrate='epoch' changes the hot set, and so the number of hot and cold batches, every "
                    f"epoch: it rebuilds the training loader every epoch, but the Trainer has "
                    f"reload_dataloaders_every_n_epochs={every}; set it to 1 (or leave it out)"
                )
            setattr(self.trainer, "reload_dataloaders_every_n_epochs", 1)  # noqa: B010 (set by Lightning's connector)
        if stage == "fit" and self.hot_set is None:
            self.hot_set = self.load_or_calibrate()

    def _recalibrate(self, stream: HotColdStream) -> None:
        """The next epoch's hot set from the exact counts of the epoch ``stream`` has just read (identical on
        every rank: each rank's stream regroups the same all-gathered global samples)."""
        old = self.hot_set
        new = recalibrate_counts(
            stream.access_counts, stream.samples_read, self.calibration_config(self._model())
        )
        moved: Dict[str, Any] = {"samples": stream.samples_read, "tables": {}}
        for name, table in new.tables.items():
            before = old.tables[name].hot_ids if old is not None else torch.zeros(0, dtype=torch.int64)
            kept = int(torch.isin(table.hot_ids, before).sum())
            moved["tables"][name] = {
                "hot_rows": table.hot_rows,
                "promoted": table.hot_rows - kept,
                "demoted": int(before.numel()) - kept,
            }
        for key in ("hot_rows", "promoted", "demoted"):
            moved[key] = sum(t[key] for t in moved["tables"].values())
        self.recalibrations.append(moved)
        self.next_hot_set = new
        rank_zero_info(
            f"Recalibrated the hot set from {stream.samples_read:,} samples: {moved['hot_rows']:,} hot rows "
            f"({moved['promoted']:,} promoted, {moved['demoted']:,} demoted), in force from the next epoch"
        )

    @override
    def state_dict(self) -> Dict[str, Any]:
        state = super().state_dict()
        if self.recalibrate is None and self.hot_set is not None:
            state["hot_set_fingerprint"] = fingerprint(self.hot_set)
        if self.recalibrate is not None:
            for key, hs in (("hot_set", self.hot_set), ("next_hot_set", self.next_hot_set)):
                if hs is not None:
                    state[key] = hs.to_dict()
        return state

    @override
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore the wrapped DataModule and, with ``recalibrate``, the hot sets in force and next.

        Raises:
            CheckpointError: a saved hot set is not one.
            ConfigError: a saved hot set is for other tables.
        """
        super().load_state_dict(state_dict)
        saved = state_dict.get("hot_set")  # a recalibrating run's hot set in force
        if self.recalibrate is None or saved is None:
            # a fixed hot set's fingerprint; or the hot set of a recalibrating run, resumed without recalibrating;
            # or a fixed hot set's run resumed with recalibration: the loader position counts that set's batches
            self._resumed_fingerprint = state_dict.get("hot_set_fingerprint")
            if saved is not None:
                self._resumed_fingerprint = fingerprint(
                    HotSet.from_dict(saved, where="the checkpoint's hot_set")
                )
            if self.hot_set is not None:  # already in force (the caches were sized with it): check it now
                self._as_resumed(self.hot_set)
            if self.recalibrate is None:
                return
        sizes = self.num_embeddings_per_feature
        for key in ("hot_set", "next_hot_set"):
            hs = None
            if key in state_dict:
                hs = HotSet.from_dict(state_dict[key], where=f"the checkpoint's {key}")
                hs.check_model(sizes)
            if key == "hot_set" and hs is None:
                continue
            setattr(self, key, hs)
        self._num_samples = None

    def _batch_size(self) -> int:
        if self.batch_size is not None:
            return self.batch_size
        if not self._source_batch:
            raise ConfigError(
                "HotColdDataModule cannot tell the batch size (no training batches): pass batch_size"
            )
        return self._source_batch

    @override
    def train_dataloader(self) -> HotColdLoader:
        if self.next_hot_set is not None:  # recalibrated at the end of the last epoch
            self.hot_set, self.next_hot_set = self.next_hot_set, None
            self._num_samples = None
        if self.hot_set is None:
            self.hot_set = self.load_or_calibrate()
        masks = self.hot_set.masks()
        source = self.datamodule.train_dataloader()
        world, rank = _world()
        if self._num_samples is None:
            hot, total, largest = classify_epoch(iter(source), masks)
            if world > 1:
                t = torch.tensor([hot, total], dtype=torch.int64)
                dist.all_reduce(t)
                hot, total = int(t[0]), int(t[1])
            self._num_samples = (hot, total)
            self._source_batch = largest
            if math.isnan(self.hot_set.hot_sample_share):  # recalibrated from counts alone: measured here
                self.hot_set.hot_sample_share = hot / max(total, 1)
            rank_zero_info(f"Hot samples: {hot:,} of {total:,} ({100 * hot / max(total, 1):.1f}%)")
        stream = HotColdStream(
            lambda: iter(source),
            masks,
            self._batch_size(),
            window=self.window,
            num_samples=self._num_samples,
            rank=rank,
            world_size=world,
            gather=_gather(None) if world > 1 else None,
            count_accesses=self.recalibrate is not None,
        )
        self.loader = HotColdLoader(stream, on_epoch_end=self._recalibrate if self.recalibrate else None)
        return self.loader
