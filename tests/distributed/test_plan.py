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


def test_tables_torchrec_cannot_place_are_one_config_error_line_not_its_planner_report():
    """TorchRec's PlannerError is a 20-line report; the refusal names the table, the storage and what to do."""
    tables = [
        EmbeddingBagConfig(name="big", embedding_dim=16, num_embeddings=1000, feature_names=["f"]),
        EmbeddingBagConfig(name="huge", embedding_dim=16, num_embeddings=10**11, feature_names=["g"]),
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    sharder = LookaheadEmbeddingBagCollectionSharder(capacity={"big": 10})
    with pytest.raises(ConfigError) as err:
        lookahead_sharding_plan(ebc, [sharder], {"big": 10}, Topology(world_size=1, compute_device="cpu"))
    text = str(err.value)
    assert "\n" not in text and text.startswith("TorchRec's planner could not place the tables"), text
    assert "table 'huge' fits on no rank" in text and "ddr = 5960.465 GB" in text, text
    assert text.endswith("cache the largest tables (the lookahead sharder's capacity or device_budget_bytes) "
                         "or give the job more devices or memory"), text  # fmt: skip
