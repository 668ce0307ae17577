"""The cache's optimizer read from the tables' ``apply_optimizer_in_backward`` declarations."""

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from torchrec_lookahead import ConfigError
from torchrec_lookahead.distributed._optimizers import cache_optimizer_from_module


def _ebc(**optimizers):
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=t, embedding_dim=4, num_embeddings=10, feature_names=[f"f_{t}"])
            for t in ("ta", "tb", "tc")
        ],
        device=torch.device("meta"),
    )
    for table, (cls, kw) in optimizers.items():
        apply_optimizer_in_backward(cls, [ebc.embedding_bags[table].weight], dict(kw))
    return ebc


def test_cached_tables_declaring_different_optimizers_are_refused_naming_the_difference():
    """The message printed every table's whole config (two dataclass reprs, ~700 characters): it names the
    table and the settings that differ."""
    ebc = _ebc(
        ta=(RowWiseAdagrad, {"lr": 0.05}),
        tb=(torch.optim.SGD, {"lr": 0.3}),
        tc=(torch.optim.SGD, {"lr": 0.3}),
    )
    with pytest.raises(ConfigError) as e:
        cache_optimizer_from_module(ebc, ["ta", "tb"])
    assert str(e.value) == (
        "Cached tables declare different optimizers: table 'tb' has optimizer exact_sgd, not exact_row_wise_adagrad; "
        "learning_rate 0.3, not 0.05 (table 'ta'); declare one optimizer for every cached table, or leave the "
        "others resident"
    )
    # a resident table may differ
    assert cache_optimizer_from_module(ebc, ["tb", "tc"]).learning_rate == pytest.approx(0.3)
