"""The cache optimizer takes the package's embedding optimizer names, and FBGEMM's as aliases."""

import pytest
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.modules import OPTIMIZER_NAMES, CacheOptimizerConfig
from torchrec_lookahead.optim import EmbeddingOptimizerName, EmbeddingOptimizerSpec


def test_every_embedding_optimizer_name_builds_the_cache_optimizer_its_spec_runs():
    assert set(OPTIMIZER_NAMES) == {n.value for n in EmbeddingOptimizerName}
    for name in EmbeddingOptimizerName:
        spec = EmbeddingOptimizerSpec(name.value)
        assert (
            CacheOptimizerConfig(name.value).optimizer is spec.emb_opt_type() is OPTIMIZER_NAMES[name.value]
        )


@pytest.mark.parametrize(
    "alias,name",
    [("exact_sgd", "sgd"), ("exact_row_wise_adagrad", "rowwise_adagrad"), ("EXACT_ADAGRAD", "adagrad")],
)
def test_fbgemm_names_are_aliases(alias, name):
    assert CacheOptimizerConfig(alias) == CacheOptimizerConfig(name)
    assert CacheOptimizerConfig(EmbOptimType(OPTIMIZER_NAMES[name])) == CacheOptimizerConfig(name)


def test_an_unknown_name_is_refused_with_the_valid_ones():
    with pytest.raises(
        ConfigError, match=r"optimizer must be one of \[.*'exact_row_wise_adagrad'.*\] but got 'lamb'"
    ):
        CacheOptimizerConfig("lamb")
