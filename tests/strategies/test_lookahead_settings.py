"""The horizon, prefetch depth and policy are stated once, in the LookaheadDataModule: the budget planner sizes the
caches for them, and a sharder whose ``planner_options`` give others is refused before anything is planned."""

from __future__ import annotations

import pytest

from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.oracle import LookaheadSettings, Policy

TINY = "configs/dlrm_tiny_lookahead.yaml"


def test_the_sharder_takes_the_loader_settings_planner_options_leave_out():
    sharder = LookaheadEmbeddingBagCollectionSharder(
        device_budget_bytes=1 << 20, planner_options={"num_sample_batches": 4, "prefetch_depth": 2}
    )
    sharder.use_lookahead_settings(LookaheadSettings(horizon=16, prefetch_depth=2, policy="lru"), "loader")
    assert sharder.planner_options == {
        "num_sample_batches": 4,
        "horizon": 16,
        "prefetch_depth": 2,
        "policy": "lru",
    }


def test_the_window_policys_window_and_ways_reach_the_planners_oracle():
    """The budget planner sized a ``window``-policy cache for the oracle's default window and ways (8 and 8), not
    the ones the loader plans with; a value ``oracle_options`` gives otherwise is refused, naming both."""
    settings = LookaheadSettings(horizon=16, policy="window", window=3, ways=2)
    sharder = LookaheadEmbeddingBagCollectionSharder(
        device_budget_bytes=1 << 20, planner_options={"oracle_options": {"window": 3}}
    )
    sharder.use_lookahead_settings(settings, "LookaheadDataModule")
    assert sharder.planner_options["oracle_options"] == {"window": 3, "ways": 2}
    other = LookaheadEmbeddingBagCollectionSharder(
        device_budget_bytes=1 << 20, planner_options={"oracle_options": {"ways": 8}}
    )
    with pytest.raises(
        ConfigError, match="oracle_options ways=8 .* differs from ways=2 of LookaheadDataModule"
    ):
        other.use_lookahead_settings(settings, "LookaheadDataModule")
    belady = LookaheadEmbeddingBagCollectionSharder(device_budget_bytes=1 << 20)
    belady.use_lookahead_settings(LookaheadSettings(horizon=16), "LookaheadDataModule")
    assert "oracle_options" not in belady.planner_options


@pytest.mark.parametrize(
    "given, expected",
    [
        ({"horizon": 32}, "planner_options horizon=32 of LookaheadEmbeddingBagCollectionSharder differs from "
         "horizon=16 of LookaheadDataModule: the caches would be sized for one horizon and trained with the other; "
         "state it once, in LookaheadDataModule, and drop it from planner_options (or make the two equal)"),
        ({"prefetch_depth": 0}, "planner_options prefetch_depth=0 of LookaheadEmbeddingBagCollectionSharder "
         "differs from prefetch_depth=1 of LookaheadDataModule"),
        ({"policy": Policy.LRU}, "planner_options policy=<Policy.LRU: 'lru'> of "
         "LookaheadEmbeddingBagCollectionSharder differs from policy='belady'"),
    ],
)  # fmt: skip
def test_planner_options_that_differ_from_the_loader_are_refused_naming_both_values(given, expected):
    sharder = LookaheadEmbeddingBagCollectionSharder(device_budget_bytes=1 << 20, planner_options=given)
    with pytest.raises(ConfigError) as e:
        sharder.use_lookahead_settings(LookaheadSettings(horizon=16), "LookaheadDataModule")
    assert str(e.value).startswith(expected), str(e.value)


def test_a_config_stating_the_horizon_once_plans_the_caches_for_the_data_modules_horizon(tmp_path):
    from torchrec_lookahead.launch import build_cli

    sharders = (
        '--trainer.strategy.init_args.sharders=[{"class_path": '
        '"torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder", "init_args": '
        '{"capacity": null, "device_budget_bytes": 40000, "planner_options": {"num_sample_batches": 4}}}]'
    )
    cli = build_cli(["--config", TINY, sharders, "--trainer.max_steps=1", "--trainer.limit_val_batches=0",
                     f"--trainer.default_root_dir={tmp_path}"])  # fmt: skip
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    (sharder,) = cli.trainer.strategy._sharders
    assert sharder.cache_plan is not None
    assert (sharder.cache_plan.horizon, sharder.cache_plan.prefetch_depth) == (8, 1)  # the tiny data's
    assert str(sharder.cache_plan.policy) in ("belady", "Policy.BELADY")
