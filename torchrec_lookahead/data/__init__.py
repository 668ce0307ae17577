"""DataModules and datasets yielding TorchRec batches (dense features, KeyedJaggedTensor, labels), and the
adapters that read other batch types (:class:`BatchAdapter`)."""

from torchrec_lookahead.data._threads import LoaderStats
from torchrec_lookahead.data.adapter import BatchAdapter, DictBatchAdapter
from torchrec_lookahead.data.batch import LookaheadBatch
from torchrec_lookahead.data.capacity import CapacityCheck
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
from torchrec_lookahead.data.lookahead_loader import LookaheadLoader
from torchrec_lookahead.data.readers import CriteoTSVParser, MovieLensParser, TaobaoParser
from torchrec_lookahead.data.resumable import ResumableBatchLoader
from torchrec_lookahead.data.synthetic import CriteoSyntheticDataset, SyntheticCriteoConfig
from torchrec_lookahead.data.text import LineBatchDataset
from torchrec_lookahead.data.wrapper import WrappedDataModule

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
    "LookaheadBatch",
    "BatchAdapter",
    "DictBatchAdapter",
    "LookaheadLoader",
    "LoaderStats",
    "CapacityCheck",
    "CriteoTSVParser",
    "MovieLensParser",
    "TaobaoParser",
    "CriteoSyntheticDataset",
    "SyntheticCriteoConfig",
    "LineBatchDataset",
]
