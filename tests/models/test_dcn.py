import pytest

from torchrec_lookahead import ConfigError
from torchrec_lookahead.models import DCNModule


def test_bad_cross_network_sizes_are_refused():
    with pytest.raises(ConfigError, match="dcn_num_layers >= 1 but got 0"):
        DCNModule({"a": 3}, 2, embedding_dim=4, dense_arch_layer_sizes=[4], dcn_num_layers=0)
    with pytest.raises(ConfigError, match="dcn_low_rank_dim"):
        DCNModule({"a": 3}, 2, embedding_dim=4, dense_arch_layer_sizes=[4], dcn_low_rank_dim=-1)
    with pytest.raises(ConfigError, match="embedding_dim"):  # DLRM's own checks apply
        DCNModule({"a": 3}, 2, embedding_dim=4, dense_arch_layer_sizes=[8])


@pytest.mark.slow
def test_the_bundled_cached_config_trains_as_the_resident_model_bit_for_bit():
    from torchrec_lookahead.verify import verify

    result = verify("configs/dcn_lookahead.yaml", steps=12)  # the whole epoch
    assert result["steps"] == 12 and result["passed"], result
    assert result["max_abs_weight_diff"] == 0.0 == result["max_abs_loss_diff"], result
    assert result["tensors"] > 26, result  # the 26 tables and the dense layers, cross network included
