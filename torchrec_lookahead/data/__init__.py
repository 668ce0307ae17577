"""DataModules and datasets yielding TorchRec batches (dense features, KeyedJaggedTensor, labels). Batches of
other types are read through a :class:`~torchrec_lookahead.runtime.BatchAdapter`."""

from torchrec_lookahead.data.criteo_spec import CRITEO_KAGGLE_CARDINALITIES, scaled_cardinalities
from torchrec_lookahead.data.datamodules import (
    AvazuDataModule,
    CriteoSyntheticDataModule,
    CriteoTSVDataModule,
    MovieLensDataModule,
    RecDataModule,
    TaobaoDataModule,
)
from torchrec_lookahead.data.history import MovieLensHistoryDataModule, MovieLensHistoryParser
from torchrec_lookahead.data.lookahead import LookaheadDataModule, batch_adapter_of
from torchrec_lookahead.data.readers import AvazuParser, CriteoTSVParser, MovieLensParser, TaobaoParser
from torchrec_lookahead.data.resumable import ResumableBatchLoader
from torchrec_lookahead.data.synthetic import CriteoSyntheticDataset, SyntheticCriteoConfig
from torchrec_lookahead.data.text import LineBatchDataset
from torchrec_lookahead.data.wrapper import WrappedDataModule, trainer_datamodules

__all__ = [
    "WrappedDataModule",
    "trainer_datamodules",
    "batch_adapter_of",
    "CRITEO_KAGGLE_CARDINALITIES",
    "scaled_cardinalities",
    "RecDataModule",
    "CriteoSyntheticDataModule",
    "CriteoTSVDataModule",
    "MovieLensDataModule",
    "MovieLensHistoryDataModule",
    "MovieLensHistoryParser",
    "TaobaoDataModule",
    "AvazuDataModule",
    "ResumableBatchLoader",
    "LookaheadDataModule",
    "CriteoTSVParser",
    "MovieLensParser",
    "TaobaoParser",
    "AvazuParser",
    "CriteoSyntheticDataset",
    "SyntheticCriteoConfig",
    "LineBatchDataset",
]
