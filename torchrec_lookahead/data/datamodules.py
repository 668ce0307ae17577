"""Lightning DataModules yielding TorchRec batches: synthetic Criteo, Criteo TSV, MovieLens, Taobao,
Avazu.

All of them hand out whole batches through :class:`~torchrec_lookahead.data.resumable.ResumableBatchLoader`
(exact mid-epoch resume), split each global batch over the ranks of the run, and tell the model its inputs
through :attr:`RecDataModule.num_embeddings_per_feature` and :attr:`RecDataModule.num_dense_features`.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import IterableDataset
from torchrec.datasets.utils import Batch
from typing_extensions import override

from torchrec_lookahead._checks import check_int
from torchrec_lookahead.data.criteo_spec import DEFAULT_CAT_NAMES, INT_FEATURE_COUNT
from torchrec_lookahead.data.readers import (
    AVAZU_FEATURES,
    MOVIELENS_FEATURES,
    TAOBAO_FEATURES,
    AvazuParser,
    CriteoTSVParser,
    MovieLensParser,
    TaobaoParser,
    read_movielens_genres,
)
from torchrec_lookahead.data.resumable import ResumableBatchLoader
from torchrec_lookahead.data.synthetic import CriteoSyntheticDataset, SyntheticCriteoConfig
from torchrec_lookahead.data.text import LineBatchDataset, Row, check_files
from torchrec_lookahead.errors import ConfigError, DataError

__all__ = [
    "RecDataModule",
    "CriteoSyntheticDataModule",
    "CriteoTSVDataModule",
    "MovieLensDataModule",
    "TaobaoDataModule",
    "AvazuDataModule",
]


#: builds a batch from parsed rows (this rank's slice of a global batch)
RowParser = Callable[[List[Row]], Batch]


#: the splits each Lightning stage reads, with the trainer's ``limit_*_batches`` attribute of each and the
#: module's step without which Lightning does not read it
_STAGE_SPLITS = {
    "fit": (("train", "limit_train_batches", None), ("val", "limit_val_batches", "validation_step")),
    "validate": (("val", "limit_val_batches", "validation_step"),),
    "test": (("test", "limit_test_batches", "test_step"),),
    "predict": (("test", "limit_predict_batches", None),),
}
_ALL_SPLITS = (("train", None, None), ("val", None, None), ("test", None, None))


class RecDataModule(pl.LightningDataModule, abc.ABC):
    """Base of our DataModules: rank-aware, resumable loaders of TorchRec batches."""

    def __init__(self) -> None:
        super().__init__()
        self._datasets: Dict[str, IterableDataset] = {}

    @property
    @abc.abstractmethod
    def num_embeddings_per_feature(self) -> Dict[str, int]:
        """Rows of each sparse feature's table, in feature order."""

    @property
    @abc.abstractmethod
    def num_dense_features(self) -> int:
        """Dense features per sample."""

    @abc.abstractmethod
    def _make_dataset(self, split: str, world_size: int, rank: int) -> Optional[IterableDataset]:
        """The dataset of a split for one rank, or ``None`` when the split has no data."""

    def _ranks(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 1, 0
        return trainer.world_size, trainer.global_rank

    def _reads_none(self, limit_attr: Optional[str], step: Optional[str]) -> bool:
        """Whether the trainer reads no batches of a split: its ``limit_*_batches`` is 0, or the module has no
        ``step`` (``validation_step``, ``test_step``), as Lightning's evaluation loop decides."""
        trainer = self.trainer
        if trainer is None:
            return False
        limit = getattr(trainer, limit_attr, None) if limit_attr else None
        if isinstance(limit, (int, float)) and limit == 0:
            return True
        module = getattr(trainer, "lightning_module", None)
        return step is not None and module is not None and not is_overridden(step, module)

    @override
    def setup(self, stage: str) -> None:
        world, rank = self._ranks()
        # the splits the stage reads (the others are set up on first use): `fit` does not read the test files,
        # nor the val files with limit_val_batches 0 or no validation_step
        for split, limit_attr, step in _STAGE_SPLITS.get(stage, _ALL_SPLITS):
            if split not in self._datasets and not self._reads_none(limit_attr, step):
                ds = self._make_dataset(split, world, rank)
                if ds is not None:
                    self._datasets[split] = ds

    def dataset(self, split: str) -> IterableDataset:
        """The dataset of ``split`` (set up on first use)."""
        if split not in self._datasets:
            ds = self._make_dataset(split, *self._ranks())
            if ds is None:
                hint = ", or turn validation off (trainer.limit_val_batches: 0)" if split == "val" else ""
                raise ConfigError(
                    f"This DataModule has no {split!r} data; configure files or batches for it{hint}"
                )
            self._datasets[split] = ds
        return self._datasets[split]

    @override
    def train_dataloader(self) -> ResumableBatchLoader:
        return ResumableBatchLoader(self.dataset("train"))

    @override
    def val_dataloader(self) -> ResumableBatchLoader:
        return ResumableBatchLoader(self.dataset("val"))

    @override
    def test_dataloader(self) -> ResumableBatchLoader:
        return ResumableBatchLoader(self.dataset("test"))

    @override
    def predict_dataloader(self) -> ResumableBatchLoader:
        """The test split's batches (``predict`` scores the test data; the labels ride along)."""
        return ResumableBatchLoader(self.dataset("test"))


class CriteoSyntheticDataModule(RecDataModule):
    """Synthetic Criteo-shaped data (13 dense, 26 sparse features), streamed and deterministic by seed.

    Args:
        batch_size: rows per batch per rank.
        num_train_batches: batches per training epoch.
        num_val_batches: batches per validation run.
        num_test_batches: batches per test run.
        scale: factor on the published Kaggle table sizes (large tables only).
        min_rows: smallest scaled table.
        num_embeddings: explicit rows per table (26 values), overriding ``scale``.
        zipf_exponent: id popularity exponent per table.
        multi_hot: ``None`` (single-hot), an int, 26 ints, or ``"mlperf"``.
        seed: data seed.

    Example:
        >>> dm = CriteoSyntheticDataModule(batch_size=8, num_train_batches=2, scale=0.0001)
        >>> dm.setup("fit")
        >>> batch = next(iter(dm.train_dataloader()))
        >>> batch.labels.shape[0], dm.num_dense_features
        (8, 13)
    """

    def __init__(
        self,
        batch_size: int = 2048,
        num_train_batches: int = 200,
        num_val_batches: int = 20,
        num_test_batches: int = 20,
        scale: float = 0.01,
        min_rows: int = 1000,
        num_embeddings: Optional[List[int]] = None,
        zipf_exponent: float = 1.05,
        multi_hot: Optional[Union[int, List[int], str]] = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        fix = "give the batches of the split"
        self._batches = {
            split: check_int(f"num_{split}_batches", n, 0, fix)
            for split, n in (
                ("train", num_train_batches),
                ("val", num_val_batches),
                ("test", num_test_batches),
            )
        }
        self._config = SyntheticCriteoConfig(
            batch_size=batch_size,
            num_batches=num_train_batches,
            scale=scale,
            min_rows=min_rows,
            num_embeddings=num_embeddings,
            zipf_exponent=zipf_exponent,
            multi_hot=multi_hot,
            seed=seed,
        )

    @property
    def config(self) -> SyntheticCriteoConfig:
        """The stream's shape (one rank)."""
        return self._config

    @property
    def num_embeddings_per_feature(self) -> Dict[str, int]:
        return dict(zip(self._config.feature_names, self._config.table_sizes()))

    @property
    def num_dense_features(self) -> int:
        return INT_FEATURE_COUNT

    def _make_dataset(self, split: str, world_size: int, rank: int) -> Optional[IterableDataset]:
        if self._batches[split] <= 0:
            return None
        c = self._config
        cfg = SyntheticCriteoConfig(
            **{**c.__dict__, "num_batches": self._batches[split], "world_size": world_size, "rank": rank}
        )
        return CriteoSyntheticDataset(cfg, split=split)


def _files(x: Union[None, str, Sequence[str]]) -> Optional[List[str]]:
    if x is None:
        return None
    return check_files([x] if isinstance(x, str) else list(x))


class _FileDataModule(RecDataModule):
    """Shared plumbing of the file-backed DataModules."""

    delimiter = ","
    skip_header = 0

    def __init__(
        self,
        train_files: Union[str, Sequence[str]],
        val_files: Union[None, str, Sequence[str]],
        test_files: Union[None, str, Sequence[str]],
        batch_size: int,
        drop_last: Optional[bool],
    ) -> None:
        super().__init__()
        self.batch_size = check_int("batch_size", batch_size, 1, "give the rows of a batch per rank")
        self.drop_last = drop_last
        self._files = {"train": _files(train_files), "val": _files(val_files), "test": _files(test_files)}

    @abc.abstractmethod
    def _parser(self) -> RowParser:
        """The row parser."""

    def _dataset(self, *args: Any, **kwargs: Any) -> LineBatchDataset:
        """The line dataset of a split (a subclass may reorder or extend the rows)."""
        return LineBatchDataset(*args, **kwargs)

    def _make_dataset(self, split: str, world_size: int, rank: int) -> Optional[IterableDataset]:
        files = self._files[split]
        if not files:
            return None
        drop_last = self.drop_last if self.drop_last is not None else world_size > 1
        dataset = self._dataset(
            files,
            self._parser(),
            self.batch_size,
            delimiter=self.delimiter,
            skip_header=self.skip_header,
            world_size=world_size,
            rank=rank,
            drop_last=drop_last,
        )
        if len(dataset) == 0:  # counts the rows once (the count is kept for Lightning's len())
            rows = dataset.num_rows()
            if rows == 0:
                why = "hold no data rows; give files that hold data"
            else:
                fix = (
                    "use drop_last=False or a smaller batch_size"
                    if world_size == 1
                    else f"use a batch_size of at most {rows // world_size} (rows // ranks)"
                    if rows >= world_size
                    else "give files with at least one row per rank"
                )
                if split != "train":
                    fix += f", or do not read it (trainer.limit_{split}_batches: 0)"
                why = (
                    f"hold {rows} rows, fewer than one batch of {self.batch_size} x {world_size} ranks with "
                    f"drop_last; {fix}"
                )
            raise DataError(f"the {split} split would have no batches: the files {files} {why}")
        return dataset


class CriteoTSVDataModule(_FileDataModule):
    """The original Criteo TSV format (label, 13 integer, 26 hexadecimal categorical fields; empty allowed).

    Args:
        train_files: TSV file(s) for training, read in order.
        val_files: TSV file(s) for validation.
        test_files: TSV file(s) for testing.
        num_embeddings: rows per table: one int for all 26 tables, 26 ints, or a mapping feature -> rows.
        batch_size: rows per batch per rank.
        drop_last: drop a final partial batch (default: only with several ranks).
    """

    delimiter = "\t"

    def __init__(
        self,
        train_files: Union[str, List[str]],
        val_files: Union[None, str, List[str]] = None,
        test_files: Union[None, str, List[str]] = None,
        num_embeddings: Union[int, List[int], Dict[str, int]] = 100_000,
        batch_size: int = 512,
        drop_last: Optional[bool] = None,
    ) -> None:
        super().__init__(train_files, val_files, test_files, batch_size, drop_last)
        self.save_hyperparameters()
        sizes: Union[List[Any], Dict[str, int]] = (
            dict(num_embeddings)
            if isinstance(num_embeddings, dict)
            else list(num_embeddings)
            if isinstance(num_embeddings, (list, tuple))
            else [num_embeddings] * len(DEFAULT_CAT_NAMES)
        )
        self._parse = CriteoTSVParser(sizes)

    def _parser(self) -> CriteoTSVParser:
        return self._parse

    @property
    def num_embeddings_per_feature(self) -> Dict[str, int]:
        return dict(zip(self._parse.feature_names, self._parse.sizes))

    @property
    def num_dense_features(self) -> int:
        return INT_FEATURE_COUNT


class _ModuloDataModule(_FileDataModule):
    """A file DataModule whose parser takes raw ids modulo the tables of its ``_features`` and gives one dense
    feature."""

    _features: Sequence[str] = ()
    _parse: Union[MovieLensParser, TaobaoParser, AvazuParser]

    def _parser(self) -> RowParser:
        return self._parse

    @property
    def num_embeddings_per_feature(self) -> Dict[str, int]:
        return dict(zip(self._features, self._parse.sizes))

    @property
    def num_dense_features(self) -> int:
        return 1


class MovieLensDataModule(_ModuloDataModule):
    """MovieLens ratings in file order: user, movie and genres (multi-hot); label ``rating >= 4``.

    Args:
        train_files: ``ratings.csv`` file(s) (with header).
        val_files: validation file(s).
        test_files: test file(s).
        movies_file: ``movies.csv`` for genres (optional; a rated movie it lacks is a ``DataError``).
        num_embeddings: rows for ``user``, ``movie``, ``genres``.
        batch_size: rows per batch per rank.
        drop_last: drop a final partial batch (default: only with several ranks).
    """

    _features = MOVIELENS_FEATURES
    _parse: MovieLensParser

    def __init__(
        self,
        train_files: Union[str, List[str]],
        val_files: Union[None, str, List[str]] = None,
        test_files: Union[None, str, List[str]] = None,
        movies_file: Optional[str] = None,
        num_embeddings: Union[Sequence[int], Dict[str, int]] = (1024, 200_000, 32),
        batch_size: int = 512,
        drop_last: Optional[bool] = None,
    ) -> None:
        super().__init__(train_files, val_files, test_files, batch_size, drop_last)
        self.save_hyperparameters()
        genres = read_movielens_genres(movies_file) if movies_file else None
        self._parse = MovieLensParser(
            list(num_embeddings) if not isinstance(num_embeddings, dict) else num_embeddings,
            genres,
            movies_file,
        )


class TaobaoDataModule(_ModuloDataModule):
    """Taobao UserBehavior in file order: user, item, category; label buy/cart/fav vs pv.

    Args:
        train_files: ``UserBehavior.csv`` file(s) (no header).
        val_files: validation file(s).
        test_files: test file(s).
        num_embeddings: rows for ``user``, ``item``, ``category`` (raw ids are taken modulo these).
        batch_size: rows per batch per rank.
        drop_last: drop a final partial batch (default: only with several ranks).
    """

    _features = TAOBAO_FEATURES
    _parse: TaobaoParser

    def __init__(
        self,
        train_files: Union[str, List[str]],
        val_files: Union[None, str, List[str]] = None,
        test_files: Union[None, str, List[str]] = None,
        num_embeddings: Union[Sequence[int], Dict[str, int]] = (1_048_576, 5_242_880, 16_384),
        batch_size: int = 512,
        drop_last: Optional[bool] = None,
    ) -> None:
        super().__init__(train_files, val_files, test_files, batch_size, drop_last)
        self.save_hyperparameters()
        self._parse = TaobaoParser(
            list(num_embeddings) if not isinstance(num_embeddings, dict) else num_embeddings
        )


# rows of Avazu's tables by default: above the distinct values of the full ``train.csv``; one row per hour of day
_AVAZU_ROWS = {
    "C1": 16,
    "banner_pos": 8,
    "site_id": 8192,
    "site_domain": 8192,
    "site_category": 32,
    "app_id": 16384,
    "app_domain": 1024,
    "app_category": 64,
    "device_id": 4_194_304,
    "device_ip": 8_388_608,
    "device_model": 16384,
    "device_type": 8,
    "device_conn_type": 8,
    "C14": 4096,
    "C15": 1024,
    "C16": 1024,
    "C17": 4096,
    "C18": 4,
    "C19": 2048,
    "C20": 2048,
    "C21": 256,
    "hour_of_day": 24,
}
#: default rows of Avazu's tables, in :data:`~torchrec_lookahead.data.readers.AVAZU_FEATURES` order
AVAZU_DEFAULT_ROWS = tuple(_AVAZU_ROWS[f] for f in AVAZU_FEATURES)


class AvazuDataModule(_ModuloDataModule):
    """Avazu CTR ``train.csv`` in file order: its 21 categorical columns and the hour of day; label ``click``.

    Args:
        train_files: ``train.csv`` file(s) (with header).
        val_files: validation file(s).
        test_files: test file(s).
        num_embeddings: rows for the 22 features (``C1`` .. ``C21``, ``hour_of_day``; ids are taken modulo these).
        batch_size: rows per batch per rank.
        drop_last: drop a final partial batch (default: only with several ranks).
    """

    _features = AVAZU_FEATURES
    _parse: AvazuParser

    def __init__(
        self,
        train_files: Union[str, List[str]],
        val_files: Union[None, str, List[str]] = None,
        test_files: Union[None, str, List[str]] = None,
        num_embeddings: Union[Sequence[int], Dict[str, int]] = AVAZU_DEFAULT_ROWS,
        batch_size: int = 512,
        drop_last: Optional[bool] = None,
    ) -> None:
        super().__init__(train_files, val_files, test_files, batch_size, drop_last)
        self.save_hyperparameters()
        self._parse = AvazuParser(
            list(num_embeddings) if not isinstance(num_embeddings, dict) else num_embeddings
        )
