"""docs/configuration.md lists every argument of the classes a config names (a new argument left out of it, or
one renamed in the code, fails here) and the defaults it states for the main ones."""

from __future__ import annotations

import inspect
import re

import pytest

from torchrec_lookahead import LookaheadTrainPipeline
from torchrec_lookahead.callbacks import CacheMonitor, EmbeddingModelSummary, PredictionWriter
from torchrec_lookahead.data import (
    AvazuDataModule,
    CriteoSyntheticDataModule,
    CriteoTSVDataModule,
    LookaheadDataModule,
    MovieLensDataModule,
    MovieLensHistoryDataModule,
    TaobaoDataModule,
)
from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
from torchrec_lookahead.fae import HotColdDataModule, HotColdScheduler
from torchrec_lookahead.models import DCNModule, DeepFMModule, DLRMModule, SequenceModule
from torchrec_lookahead.modules import CacheOptimizerConfig
from torchrec_lookahead.strategies import HierarchicalStrategy, TorchRecStrategy

from .conftest import REPO

DOC = (REPO / "docs" / "configuration.md").read_text()
#: linked from the DataModule (named once, under data), or Python-only plumbing of the caller
NOT_SETTINGS = {"self", "kwargs", "summarize_kwargs", "num_embeddings_per_feature", "num_dense_features"}
CLASSES = [
    LookaheadDataModule,
    LookaheadEmbeddingBagCollectionSharder,
    TorchRecStrategy,
    HierarchicalStrategy,
    HotColdDataModule,
    HotColdScheduler,
    CacheMonitor,
    PredictionWriter,
    EmbeddingModelSummary,
    CacheOptimizerConfig,
    LookaheadTrainPipeline,
    CriteoSyntheticDataModule,
    CriteoTSVDataModule,
    MovieLensDataModule,
    MovieLensHistoryDataModule,
    TaobaoDataModule,
    AvazuDataModule,
    DLRMModule,
    DCNModule,
    DeepFMModule,
    SequenceModule,
]


@pytest.mark.parametrize("cls", CLASSES, ids=[c.__name__ for c in CLASSES])
def test_configuration_page_lists_every_argument(cls):
    names = [n for n in inspect.signature(cls.__init__).parameters if n not in NOT_SETTINGS]
    missing = [n for n in names if not re.search(rf"(`{n}[`.]|\b{n}:|\b{n}=)", DOC)]
    assert not missing, f"docs/configuration.md does not list {cls.__name__}'s {missing}"


@pytest.mark.parametrize(
    "cls, line",
    [
        (LookaheadDataModule, "horizon: 64"),
        (LookaheadDataModule, "prefetch_depth: 1"),
        (LookaheadDataModule, "queue_depth: 8"),
        (LookaheadDataModule, "capacity_check_seconds: 20"),
        (LookaheadDataModule, "stop_timeout_s: 60"),
        (LookaheadDataModule, "planner_nice: 19"),
        (TorchRecStrategy, "full_checkpoint_every: 8"),
        (TorchRecStrategy, "init_seed: 0"),
    ],
)
def test_configuration_page_states_the_defaults_of_the_code(cls, line):
    name, value = line.split(": ")
    default = inspect.signature(cls.__init__).parameters[name].default
    assert float(default) == float(value) and re.search(rf"#? *{re.escape(line)}\b", DOC), (cls, line)
