import pytest

from torchrec_lookahead import ConfigError
from torchrec_lookahead.models import DeepFMModule


def test_bad_widths_are_refused_and_the_loss_takes_probabilities():
    with pytest.raises(ConfigError, match="hidden_layer_size >= 1 but got 0"):
        DeepFMModule({"a": 3}, 2, embedding_dim=4, hidden_layer_size=0)
    with pytest.raises(ConfigError, match="deep_fm_dimension"):
        DeepFMModule({"a": 3}, 2, embedding_dim=4, deep_fm_dimension=0)
    import torch

    m = DeepFMModule({"a": 3}, 2, embedding_dim=4)
    assert isinstance(m.loss_fn, torch.nn.BCELoss)  # SimpleDeepFMNN ends in a sigmoid
    p = torch.tensor([0.25, 0.5])
    assert torch.equal(m.probabilities(p), p)


@pytest.mark.slow
def test_the_bundled_cached_config_trains_as_the_resident_model_bit_for_bit():
    from torchrec_lookahead.verify import verify

    result = verify("configs/deepfm_lookahead.yaml", steps=12)  # the whole epoch
    assert result["steps"] == 12 and result["passed"], result
    assert result["max_abs_weight_diff"] == 0.0 == result["max_abs_loss_diff"], result
