"""``TorchRecStrategy`` finds the model to shard in any LightningModule by walking its modules."""

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.strategies import TorchRecStrategy


def ebc(name: str) -> EmbeddingBagCollection:
    table = EmbeddingBagConfig(name=name, embedding_dim=4, num_embeddings=10, feature_names=[name])
    return EmbeddingBagCollection(tables=[table], device=torch.device("meta"))


class Holder(pl.LightningModule):
    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            setattr(self, name, child)


def test_the_one_child_holding_collections_is_found_whatever_its_name():
    nested = nn.Sequential(nn.Linear(2, 2), nn.ModuleDict({"deep": ebc("a")}))
    lm = Holder(head=nn.Linear(2, 2), recommender=nested, loss=nn.BCELoss())
    assert TorchRecStrategy()._model_name(lm) == "recommender"
    assert TorchRecStrategy(module_name="head")._model_name(lm) == "head"  # named: taken as given


def test_no_collection_or_several_holders_are_refused_naming_the_fix():
    with pytest.raises(ConfigError, match="Holder holds no TorchRec embedding collection.*configure_model"):
        TorchRecStrategy()._model_name(Holder(mlp=nn.Linear(2, 2)))
    with pytest.raises(ConfigError, match=r"several attributes \['query', 'item'\].*module_name"):
        TorchRecStrategy()._model_name(Holder(query=ebc("q"), item=ebc("i")))
