"""DataModules and datasets yielding TorchRec batches (dense features, KeyedJaggedTensor, labels), and the
adapters that read other batch types (:class:`BatchAdapter`)."""

from torchrec_lookahead.data.criteo_spec import CRITEO_KAGGLE_CARDINALITIES, scaled_cardinalities
from torchrec_lookahead.data.datamodules import (
    CriteoSyntheticDataModule,
    CriteoTSVDataModule,
    MovieLensDataModule,
    RecDataModule,
    TaobaoDataModule,
)
from torchrec_lookahead.data.history import MovieLensHistoryDataModule, MovieLensHistoryParser
from torchrec_lookahead.data.lookahead import LookaheadDataModule
from torchrec_lookahead.data.readers import CriteoTSVParser, MovieLensParser, TaobaoParser
from torchrec_lookahead.data.resumable import ResumableBatchLoader
from torchrec_lookahead.data.synthetic import CriteoSyntheticDataset, SyntheticCriteoConfig
from torchrec_lookahead.data.text import LineBatchDataset
from torchrec_lookahead.data.wrapper import WrappedDataModule
from torchrec_lookahead.runtime.adapter import BatchAdapter, DictBatchAdapter

__all__ = [
    "WrappedDataModule",
    "CRITEO_KAGGLE_CARDINALITIES",
    "scaled_cardinalities",
    "RecDataModule",
    "CriteoSyntheticDataModule",
    "CriteoTSVDataModule",
    "MovieLensDataModule",
    "MovieLensHistoryDataModule",
    "MovieLensHistoryParser",
    "TaobaoDataModule",
    "ResumableBatchLoader",
    "LookaheadDataModule",
    "BatchAdapter",
    "DictBatchAdapter",
    "CriteoTSVParser",
    "MovieLensParser",
    "TaobaoParser",
    "CriteoSyntheticDataset",
    "SyntheticCriteoConfig",
    "LineBatchDataset",
]
