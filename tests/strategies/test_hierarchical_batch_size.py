"""The tagger's cost model weighs the rows each rank reads per step: the strategy reads them from the DataModule,
through the lookahead and hot/cold wrappers. It read a ``batch_size`` attribute of the innermost DataModule only, so
the shipped config's synthetic Criteo DataModule (batch_size 512, kept in its config) and any FAE job were placed
for the default 1024 rows."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from torchrec_lookahead.data import CriteoSyntheticDataModule, LookaheadDataModule
from torchrec_lookahead.fae import HotColdDataModule
from torchrec_lookahead.strategies import HierarchicalStrategy


def _rows(dm: Any) -> int:
    s = HierarchicalStrategy(group_size=2)
    s._lightning_module = SimpleNamespace(_trainer=SimpleNamespace(datamodule=dm))  # what the set-up reads
    return s._cost_model().batch_size


@pytest.mark.parametrize(
    "wrap, rows",
    [
        (lambda d: d, 64),
        (lambda d: LookaheadDataModule(d), 64),
        (lambda d: LookaheadDataModule(HotColdDataModule(d, hot_budget_bytes=1 << 20)), 64),
        (lambda d: LookaheadDataModule(HotColdDataModule(d, hot_budget_bytes=1 << 20, batch_size=32)), 32),
        (lambda d: None, 1024),  # no DataModule: the cost model's default
    ],
)
def test_the_cost_model_reads_the_batch_size_through_the_wrappers(wrap: Any, rows: int) -> None:
    assert _rows(wrap(CriteoSyntheticDataModule(batch_size=64, num_train_batches=2))) == rows


def test_the_shipped_configs_batch_size_reaches_the_tagger() -> None:
    import yaml

    from ..conftest import REPO

    config = yaml.safe_load((REPO / "configs" / "dlrm_hierarchical.yaml").read_text())
    args = config["data"]["init_args"]["datamodule"]["init_args"]
    inner = CriteoSyntheticDataModule(**args)
    assert _rows(LookaheadDataModule(inner)) == args["batch_size"] == 512


def test_a_cost_model_may_be_a_dict_and_anything_else_is_refused_at_construction() -> None:
    """A dict (what a config file gives) or a word failed at set-up, after the process group, with an
    AttributeError ('dict' object has no attribute '__dict__')."""
    from torchrec_lookahead.errors import ConfigError
    from torchrec_lookahead.strategies._tagger import CostModel

    s = HierarchicalStrategy(group_size=2, cost_model={"batch_size": 8, "cross_bytes_per_s": 1e8})
    assert s.cost_model == CostModel(batch_size=8, cross_bytes_per_s=1e8)
    assert s._cost_model().batch_size == 8
    for bad, match in (
        ("fast", "cost_model must be CostModel"),
        ({"bandwidth": 1}, "unknown keys \\['bandwidth'\\]"),
    ):
        with pytest.raises(ConfigError, match=match):
            HierarchicalStrategy(group_size=2, cost_model=bad)
