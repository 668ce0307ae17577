"""Bad hierarchical configurations fail with typed errors before training, naming the valid values."""

from __future__ import annotations

from typing import Any, Dict

import lightning.pytorch as pl
import pytest
import torch

from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.models import DLRMModule
from torchrec_lookahead.strategies import HierarchicalStrategy


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"group_size": 0}, "group_size to be a positive integer"),
        ({"sync_every": 0}, "sync_every to be a positive integer"),
        ({"sync_every": 1.5}, "sync_every to be a positive integer"),
        ({"elastic_alpha": 0.0}, r"elastic_alpha in \(0, 1\]"),
        ({"elastic_alpha": 1.5}, r"elastic_alpha in \(0, 1\]"),
        ({"averaging": "median"}, r"\['easgd', 'mean'\]"),
        ({"compression": "fp8"}, r"\['none', 'bf16', 'int8'\]"),
        ({"placement": "diagonal"}, "'auto', 'replicate'"),
        ({"placement": {"over_arch.model.1": "sideways"}}, r"\['colwise', 'rowwise', 'replicate'\]"),
        ({"background": "yes"}, "background to be True or False"),
        ({"average_at_end": 1}, "average_at_end to be True or False"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs: Dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        HierarchicalStrategy(**kwargs)


def test_registered_as_hierarchical() -> None:
    trainer = pl.Trainer(strategy="hierarchical", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, HierarchicalStrategy)


def test_group_size_that_does_not_divide_the_world_is_refused_when_the_trainer_is_built() -> None:
    with pytest.raises(ConfigError, match=r"group_size=3 does not divide the world size 4.*\[1, 2, 4\]"):
        pl.Trainer(strategy=HierarchicalStrategy(group_size=3), accelerator="cpu", devices=4, logger=False)


def test_compression_on_a_backend_that_cannot_carry_it_is_refused() -> None:
    s = HierarchicalStrategy(compression="int8", process_group_backend="mpi")
    with pytest.raises(ConfigError, match=r"backend is 'mpi'"):
        pl.Trainer(strategy=s, accelerator="cpu", devices=1, logger=False)


def _dlrm() -> torch.nn.Module:
    m = DLRMModule(
        {"a": 10, "b": 5}, 13, embedding_dim=8, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[15, 1]
    )
    return m.build_model(torch.device("meta"), torch.device("cpu"))


@pytest.mark.parametrize(
    "placement, match",
    [
        ({"dense_arch.model._mlp.7._linear": "colwise"}, "does not have"),
        ({"sparse_arch.embedding_bag_collection": "colwise"}, "EmbeddingBagCollection; only dense nn.Linear"),
        ({"dense_arch.model._mlp.0": "rowwise"}, "Perceptron"),
        ({"over_arch.model.0._mlp.0._linear": "colwise"}, "15 output features over group_size=2"),
    ],
)
def test_bad_placements_are_refused_at_set_up(placement: Dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        HierarchicalStrategy(group_size=2, placement=placement).split_layers(_dlrm())


def test_user_placement_wins_over_the_tagger() -> None:
    model = _dlrm()
    s = HierarchicalStrategy(group_size=2, placement={"dense_arch.model._mlp.0._linear": "replicate"})
    layers = {x.path: x.placement.value for x in s.split_layers(model)}
    assert "dense_arch.model._mlp.0._linear" not in layers
    assert s.tagging is not None and "dense_arch.model._mlp.0._linear" in s.tagging.table()
