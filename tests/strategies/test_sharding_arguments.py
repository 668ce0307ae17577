"""The torchrec strategy's ``sharders`` checked when the strategy is built."""

import pytest

from torchrec_lookahead import ConfigError
from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
from torchrec_lookahead.strategies import TorchRecStrategy


def test_sharders_items_must_be_torchrec_sharders():
    path = "torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder"
    with pytest.raises(ConfigError, match=r"sharders\[0\] must be a TorchRec ModuleSharder but got str '"):
        TorchRecStrategy(sharders=[path])
    good = LookaheadEmbeddingBagCollectionSharder(capacity={"t": 4})
    with pytest.raises(ConfigError, match=r"sharders\[1\] must be a TorchRec ModuleSharder but got dict"):
        TorchRecStrategy(sharders=[good, {"class_path": path}])
    assert TorchRecStrategy(sharders=[good])._sharders == [good]
