"""``lookahead_sharding_plan``'s refusals of what the cache cannot train as resident TorchRec would."""

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.planner import Topology

from torchrec_lookahead import ConfigError
from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder, lookahead_sharding_plan


def test_a_feature_a_cached_table_shares_with_another_table_is_refused_before_planning():
    """Wide & deep with one ``item`` feature in two collections: the batch's ``item`` values became cache slots,
    which the resident wide table read as ids (0.195 from resident training at step 0, without a word)."""

    def ebc(name: str) -> EmbeddingBagCollection:
        table = EmbeddingBagConfig(name=name, embedding_dim=4, num_embeddings=100, feature_names=["item"])
        return EmbeddingBagCollection(tables=[table], device=torch.device("meta"))

    model = nn.ModuleDict({"deep": ebc("deep_item"), "wide": ebc("wide_item")})
    sharder = LookaheadEmbeddingBagCollectionSharder(capacity={"deep_item": 10})
    topology = Topology(world_size=1, compute_device="cpu")
    for cached in ({"deep_item": 10}, {"wide_item": 10}, {"deep_item": 10, "wide_item": 10}):
        with pytest.raises(
            ConfigError, match=r"feature 'item' is read by the cached table '\w+' and by \['\w+'\]"
        ):
            lookahead_sharding_plan(model, [sharder], cached, topology)
    lookahead_sharding_plan(model, [sharder], {}, topology)  # both resident: nothing remapped


def test_a_resident_table_fbgemm_cannot_train_is_a_config_error_not_torchrecs_assertion():
    """A resident table of dimension 7 beside a cached one (fuse_resident=False, or several ranks): TorchRec's
    sharding raised a raw AssertionError ("local_cols=7 not divisible by 4")."""
    tables = [
        EmbeddingBagConfig(name="big", embedding_dim=8, num_embeddings=100, feature_names=["a"]),
        EmbeddingBagConfig(name="odd", embedding_dim=7, num_embeddings=20, feature_names=["b"]),
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    sharder = LookaheadEmbeddingBagCollectionSharder(capacity={"big": 10}, fuse_resident=False)
    topology = Topology(world_size=1, compute_device="cpu")
    with pytest.raises(
        ConfigError, match="table 'odd' has embedding_dim 7; FBGEMM's kernel needs a multiple of 4: use 8"
    ):
        lookahead_sharding_plan(ebc, [sharder], {"big": 10}, topology)
    # cached, the table is checked by the cache itself
    lookahead_sharding_plan(ebc, [sharder], {"big": 10, "odd": 5}, topology)
