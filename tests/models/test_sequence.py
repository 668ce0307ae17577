"""The sequence model: attention pooling against a per-sample reference, argument checks, and cached training
under Lightning equal to resident training (its EmbeddingCollection and EmbeddingBagCollection both cached)."""

import pytest
import torch
from torchrec import KeyedJaggedTensor
from torchrec.sparse.jagged_tensor import JaggedTensor

from torchrec_lookahead import ConfigError, DataError
from torchrec_lookahead.models import SequenceModule
from torchrec_lookahead.models.sequence import pool_history
from torchrec_lookahead.verify import verify

from ..conftest import REPO
from ..helpers import small_sequence_config


def test_attention_pooling_equals_a_per_sample_softmax():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 0, 1, 5])
    values = torch.randn(int(lengths.sum()), 8, generator=g)
    target = torch.randn(4, 8, generator=g)
    got = pool_history(JaggedTensor(values=values, lengths=lengths), target, "attention")
    start = 0
    for i, n in enumerate(lengths.tolist()):
        h = values[start : start + n]
        want = torch.softmax(h @ target[i] / 8**0.5, 0) @ h if n else torch.zeros(8)
        assert torch.allclose(got[i], want, atol=1e-6)
        start += n


def test_arguments_and_batches_are_checked():
    sizes = {"user": 10, "movie": 50, "history": 50}
    with pytest.raises(ConfigError, match=r"pooling must be one of \['attention', 'mean'\] but got 'max'"):
        SequenceModule(sizes, pooling="max")
    with pytest.raises(ConfigError, match="must end in 1"):
        SequenceModule(sizes, over_arch_layer_sizes=[8, 2])
    with pytest.raises(ConfigError, match=r"unknown \['clicks'\]"):
        SequenceModule(sizes, history_features={"clicks": "movie"})
    m = SequenceModule(sizes, embedding_dim=4, pooling="mean", over_arch_layer_sizes=[1])
    assert [t.name for t in m.sequence_tables] == ["t_movie"] and [t.name for t in m.tables] == ["t_user"]
    assert m.sequence_tables[0].feature_names == ["movie", "history"]
    m.configure_model()
    two_targets = KeyedJaggedTensor(
        ["user", "movie", "history"], torch.arange(6), lengths=torch.tensor([1, 1, 2, 0, 1, 1])
    )
    with pytest.raises(DataError, match="one id per sample"):
        m(torch.zeros(2, 1), two_targets)
    kjt = KeyedJaggedTensor(["user", "movie"], torch.arange(4), lengths=torch.tensor([1, 1, 1, 1]))
    with pytest.raises(DataError, match=r"\['history'\] are missing"):
        m(torch.zeros(2, 1), kjt)


@pytest.mark.parametrize("pooling", ["attention", "mean"])
def test_cached_sequence_model_trains_exactly_like_resident_under_lightning(tmp_path, monkeypatch, pooling):
    small = small_sequence_config(tmp_path, pooling=pooling)
    monkeypatch.chdir(REPO)
    out = verify([str(REPO / "configs" / "movielens_sequence_lookahead.yaml"), str(small)], steps=12)  # type: ignore[arg-type]
    assert out["passed"] and out["max_abs_weight_diff"] == 0.0 and out["steps"] == 12, out


def test_device_budget_planner_sizes_the_embedding_collection_table_too(tmp_path, monkeypatch):
    """With a device budget instead of capacities the planner sees the EC's table beside the EBC's; the
    planned run trains exactly like the resident one."""
    from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
    from torchrec_lookahead.launch import build_cli

    small = small_sequence_config(tmp_path, options="capacity: null, device_budget_bytes: 60000")
    monkeypatch.chdir(REPO)
    configs = [str(REPO / "configs" / "movielens_sequence_lookahead.yaml"), str(small)]
    out = verify(configs, steps=8)  # type: ignore[arg-type]
    assert out["passed"] and out["max_abs_weight_diff"] == 0.0, out
    cli = build_cli([a for c in configs for a in ("--config", c)] + ["--trainer.max_steps=1"])
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    sharder = next(
        s for s in cli.trainer.strategy._sharders if isinstance(s, LookaheadEmbeddingBagCollectionSharder)
    )
    assert "t_movie" in sharder.capacity, sharder.cache_plan


def test_pooled_features_are_read_by_key_whatever_order_the_collection_returns_them_in():
    """TorchRec's sharded EBC orders its output keys by shard with several ranks (e.g. ['site', 'user']): the model
    read the values by position, so resident and cached runs, whose plans place the tables differently, trained
    different models silently."""
    from torchrec.sparse.jagged_tensor import KeyedTensor

    sizes = {"user": 10, "site": 30, "movie": 50, "history": 50}
    m = SequenceModule(sizes, embedding_dim=4, pooling="mean", over_arch_layer_sizes=[1])
    m.configure_model()
    kjt = KeyedJaggedTensor(
        ["user", "site", "movie", "history"],
        torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]),
        lengths=torch.tensor([1, 1, 2, 0, 1, 1, 1, 1]),
    )
    dense = torch.rand(2, 1)
    expected = m(dense, kjt)
    ebc = m.model.ebc

    class ShardOrder(torch.nn.Module):
        def forward(self, features):
            out = ebc(features)
            keys = list(reversed(out.keys()))
            dims = [out[k].shape[1] for k in keys]
            return KeyedTensor(
                keys=keys, length_per_key=dims, values=torch.cat([out[k] for k in keys], dim=1)
            )

    m.model.ebc = ShardOrder()
    assert torch.equal(m(dense, kjt), expected)
