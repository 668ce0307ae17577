"""table_ids: one batch -> per-table ids for every consumer, with each option for unknown features."""

from __future__ import annotations

from typing import Any, Dict

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.distributed.planner import batch_table_ids, min_capacities
from torchrec_lookahead.errors import ConfigError, DataError
from torchrec_lookahead.oracle import (
    LookaheadOracle,
    OracleConfig,
    UnknownFeatures,
    min_capacity,
    table_ids,
    window_working_sets,
)
from torchrec_lookahead.runtime.capacity import check_stream

F2T = {"f_a": "t0", "f_b": "t1", "f_c": "t0"}


def kjt() -> KeyedJaggedTensor:
    # f_a: [3, 9] | [] ; f_b: [4] | [] ; f_c: [9] | [5, 1] ; extra (no table): [7] | [8]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["f_a", "f_b", "f_c", "extra"],
        values=torch.tensor([3, 9, 4, 9, 5, 1, 7, 8], dtype=torch.int32),
        lengths=torch.tensor([2, 0, 1, 0, 1, 2, 1, 1]),
    )


def as_lists(out: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    assert all(v.dtype == torch.int64 for v in out.values())
    return {t: v.tolist() for t, v in out.items()}


@pytest.mark.parametrize("as_mapping", [False, True])
def test_ignore_skips_unknown_features_and_concatenates_in_key_order(as_mapping: bool) -> None:
    batch: Any = kjt()
    if as_mapping:
        batch = {k: v.values() for k, v in batch.to_dict().items()}
    out = table_ids(batch, F2T, unknown="ignore")
    assert as_lists(out) == {"t0": [3, 9, 9, 5, 1], "t1": [4]}
    assert list(out) == ["t0", "t1"]  # first-feature order without ``tables``


def test_error_names_the_unknown_feature_and_where() -> None:
    with pytest.raises(ConfigError, match=r"feature 'extra' in sample batch 4 is not in feature_to_table"):
        table_ids(kjt(), F2T, where=" in sample batch 4")
    with pytest.raises(ConfigError, match="'extra'"):
        table_ids(kjt(), F2T, unknown=UnknownFeatures.ERROR)
    with pytest.raises(ConfigError, match="unknown must be one of 'error', 'ignore' but got 'warn'"):
        table_ids(kjt(), F2T, unknown="warn")


def test_tables_restricts_and_lists_absent_tables_empty() -> None:
    out = table_ids(kjt(), {**F2T, "extra": "t9"}, ["t1", "t5", "t1"])
    assert as_lists(out) == {"t1": [4], "t5": []}
    # the identity when feature_to_table is None: every feature is a table of its own name
    assert as_lists(table_ids(kjt(), None, ["extra"])) == {"extra": [7, 8]}


def test_refuses_non_integer_ids_naming_the_feature() -> None:
    with pytest.raises(DataError, match=r"ids of feature 'f' in batch 2 must be an integer tensor"):
        table_ids({"f": torch.tensor([1.0])}, None, where=" in batch 2")
    assert as_lists(table_ids({"f": [4, 5, 6]}, None)) == {"f": [4, 5, 6]}  # a list of ints is ids


def test_every_consumer_agrees() -> None:
    """The planner's samples, the oracle and the capacity check see the same ids."""
    batch = kjt()
    expect = {"t0": [3, 9, 9, 5, 1], "t1": [4]}
    assert as_lists(batch_table_ids(batch, {**F2T, "extra": "t2"})) == {**expect, "t2": [7, 8]}
    with pytest.raises(ConfigError, match="'extra' in sample batch 3"):
        batch_table_ids(batch, F2T, 3)
    for unknown in ("error", "ignore"):
        cfg = OracleConfig(
            capacity={"t0": 4, "t1": 1}, feature_to_table=F2T, horizon=1, unknown_features=unknown
        )
        if unknown == "error":
            with pytest.raises(ConfigError, match="'extra'"):
                list(LookaheadOracle(cfg).plan_stream([batch]))
            continue
        plan = list(LookaheadOracle(cfg).plan_stream([batch]))[0]
        assert sorted(plan.tables["t0"].fetch_ids.tolist()) == [1, 3, 5, 9]
        assert min_capacity([batch], 0, cfg) == {"t0": 4, "t1": 1}
    with pytest.raises(ConfigError, match="unknown_features must be one of"):
        OracleConfig(capacity={"t0": 4}, unknown_features="skip")
    # the epoch check ignores other modules' features
    assert check_stream([batch], {"t0": 4}, F2T, {"t0": 10}, prefetch_depth=0) == {"t0": 4}


def test_one_window_working_set() -> None:
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 30, size=int(rng.integers(0, 12))) for _ in range(25)]
    for depth in (0, 1, 3, 30):
        ref = max(
            len(set(np.concatenate(batches[max(t - depth, 0) : t + 1]).tolist())) for t in range(len(batches))
        )
        steps = [s for s, _ in window_working_sets(({"t": b} for b in batches), depth)]
        assert steps == list(range(len(batches)))
        assert min_capacities({"t": batches, "u": [np.zeros(0, np.int64)]}, depth) == {"t": ref, "u": 0}
