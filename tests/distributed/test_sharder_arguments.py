"""The lookahead sharder's arguments given as a config would give them (dicts, booleans), checked when the
sharder is built: accepted as the typed objects, or refused with a ConfigError naming what to give."""

import numpy as np
import pytest

from torchrec_lookahead import ConfigError
from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
from torchrec_lookahead.modules import CacheOptimizerConfig

Sharder = LookaheadEmbeddingBagCollectionSharder


def test_optimizer_dict_is_built_into_the_cache_optimizer_config():
    s = Sharder(capacity={"t": 4}, optimizer={"optimizer": "rowwise_adagrad", "learning_rate": 0.05})
    typed = Sharder(capacity={"t": 4}, optimizer=CacheOptimizerConfig("rowwise_adagrad", learning_rate=0.05))
    assert s.optimizer == typed.optimizer == CacheOptimizerConfig("rowwise_adagrad", learning_rate=0.05)
    assert s.fused_params == typed.fused_params


@pytest.mark.parametrize(
    "optimizer, match",
    [
        (
            {"optimizer": "sgd", "lr": 0.1},
            r"optimizer has unknown keys \['lr'\]; its keys are \['optimizer', 'learning_rate'",
        ),
        ({"optimizer": "adamw"}, r"optimizer: optimizer must be one of"),
        ("sgd", r"optimizer must be CacheOptimizerConfig\(...\) or a dict of its keys"),
    ],
)
def test_optimizer_that_builds_no_config_is_refused(optimizer, match):
    with pytest.raises(ConfigError, match=match):
        Sharder(capacity={"t": 4}, optimizer=optimizer)


def test_planner_options_keys_are_the_planners_arguments():
    s = Sharder(device_budget_bytes=1 << 20, planner_options={"num_sample_batches": 3, "floor_headroom": 1.5})
    assert s.planner_options == {"num_sample_batches": 3, "floor_headroom": 1.5}
    with pytest.raises(
        ConfigError,
        match=r"planner_options has unknown keys \['num_samples'\]; LookaheadPlanner takes \['horizon'.*"
        r"'num_sample_batches'",
    ):
        Sharder(device_budget_bytes=1 << 20, planner_options={"num_samples": 3})
    with pytest.raises(
        ConfigError, match=r"\['device_budget_bytes'\].*give device_budget_bytes to the sharder itself"
    ):
        Sharder(device_budget_bytes=1 << 20, planner_options={"device_budget_bytes": 3})
    with pytest.raises(ConfigError, match=r"planner_options must be a dict"):
        Sharder(device_budget_bytes=1 << 20, planner_options=["num_sample_batches", 3])


@pytest.mark.parametrize("name", ["keep_stores", "delayed_sync", "fuse_resident"])
def test_boolean_arguments_refuse_strings(name):
    with pytest.raises(ConfigError, match=rf"{name} must be True or False but got 'false'"):
        Sharder(capacity={"t": 4}, **{name: "false"})
    with pytest.raises(ConfigError, match=rf"{name} must be True or False but got 0"):
        Sharder(capacity={"t": 4}, **{name: 0})
    assert getattr(Sharder(capacity={"t": 4}, **{name: False}), name) is False
    assert getattr(Sharder(capacity={"t": 4}, **{name: np.bool_(True)}), name) is True


def test_fuse_resident_keeps_none():
    assert Sharder(capacity={"t": 4}, fuse_resident=None).fuse_resident is None
