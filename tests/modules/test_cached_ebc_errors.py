"""Contract 6 (bad input is refused clearly): typed errors, and the cache and stores stay unchanged."""

from __future__ import annotations

from typing import Dict, Tuple

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from torchrec_lookahead.errors import CapacityError, ConfigError, DataError, InvalidIdError, SetupError
from torchrec_lookahead.modules import (
    AppliedPlan,
    CachedEmbeddingBagCollection,
    CacheOptimizerConfig,
    StagedRows,
)
from torchrec_lookahead.oracle.types import BatchPlan, TablePlan
from torchrec_lookahead.store import TensorStore

from .cache_helpers import make_tables

E = torch.empty(0, dtype=torch.int64)


def _t(*x: int) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64)


def _loaded() -> CachedEmbeddingBagCollection:
    """t0 cached with 4 slots holding ids 10, 11 in slots 0, 1; t1 cached with 2 slots holding id 5 in slot 0."""
    ebc = CachedEmbeddingBagCollection(
        make_tables(), {"t0": 4, "t1": 2}, CacheOptimizerConfig("exact_sgd", learning_rate=0.1)
    )
    ebc.apply_plan(
        BatchPlan(
            0,
            {
                "t0": TablePlan(E, E, _t(10, 11), _t(0, 1), _t(0, 1)),
                "t1": TablePlan(E, E, _t(5), _t(0), _t(0)),
            },
        )
    )
    # make the cached rows differ from the store so that a write-back would show
    for name in ("t0", "t1"):
        ebc.cache_weights(name).add_(1.0)
    return ebc


def _snapshot(ebc: CachedEmbeddingBagCollection) -> Dict[str, Tuple[torch.Tensor, ...]]:
    return {
        n: (ebc.slot_ids(n), ebc.cache_weights(n).clone(), s._rows().clone())  # type: ignore[attr-defined]
        for n, s in ebc.stores.items()
    }


def _unchanged(ebc: CachedEmbeddingBagCollection, snap: Dict[str, Tuple[torch.Tensor, ...]]) -> bool:
    now = _snapshot(ebc)
    return all(all(torch.equal(a, b) for a, b in zip(now[n], snap[n])) for n in snap)


BAD_PLANS = {
    "slot_at_capacity": (CapacityError, {"t0": TablePlan(E, E, _t(12), _t(4), _t(4))}),
    "negative_slot": (CapacityError, {"t0": TablePlan(E, E, E, E, _t(-1))}),
    "id_out_of_range": (InvalidIdError, {"t0": TablePlan(E, E, _t(200), _t(2), _t(2))}),
    "negative_id": (InvalidIdError, {"t0": TablePlan(E, E, _t(-3), _t(2), _t(2))}),
    "unknown_table": (ConfigError, {"nope": TablePlan(E, E, E, E, E)}),
    "resident_table": (ConfigError, {"t2": TablePlan(E, E, E, E, E)}),
    "evict_wrong_id": (SetupError, {"t0": TablePlan(_t(11), _t(0), E, E, _t(1))}),
    "fetch_into_occupied": (SetupError, {"t0": TablePlan(E, E, _t(12), _t(1), _t(1))}),
    "fetch_already_cached": (SetupError, {"t0": TablePlan(E, E, _t(10), _t(2), _t(2))}),
    "read_empty_slot": (SetupError, {"t0": TablePlan(E, E, E, E, _t(3))}),
    "length_mismatch": (DataError, {"t0": TablePlan(E, E, _t(12, 13), _t(2), _t(2))}),
    "float_ids": (DataError, {"t0": TablePlan(E, E, torch.tensor([12.0]), _t(2), _t(2))}),
    # the first table's plan is fine: nothing may move before the whole plan is validated
    "second_table_bad": (
        CapacityError,
        {"t0": TablePlan(_t(10), _t(0), _t(12), _t(0), _t(0)), "t1": TablePlan(E, E, _t(6), _t(2), _t(2))},
    ),
}


#: the facts a range error carries (errors of other kinds carry none)
RANGE_FACTS = {
    "slot_at_capacity": {"table": "t0", "batch": 1, "needed": 5, "available": 4, "tier": "device"},
    "negative_slot": {"table": "t0", "batch": 1, "needed": None, "available": 4, "tier": "device"},
    "id_out_of_range": {"table": "t0", "batch": 1, "id": 200, "num_rows": 200},
    "negative_id": {"table": "t0", "batch": 1, "id": -3, "num_rows": 200},
    "second_table_bad": {"table": "t1", "batch": 1, "needed": 3, "available": 2, "tier": "device"},
}


@pytest.mark.parametrize("case", sorted(BAD_PLANS))
def test_bad_plan_is_refused_and_nothing_moves(case: str) -> None:
    error, tables = BAD_PLANS[case]
    ebc = _loaded()
    snap = _snapshot(ebc)
    with pytest.raises(error) as info:
        ebc.apply_plan(BatchPlan(1, tables))
    assert _unchanged(ebc, snap)
    assert info.value.facts == RANGE_FACTS.get(case, {})


def test_bad_staged_rows_are_refused() -> None:
    ebc = _loaded()
    snap = _snapshot(ebc)
    plan = BatchPlan(1, {"t0": TablePlan(E, E, _t(12), _t(2), _t(2))})
    other = BatchPlan(1, {"t0": TablePlan(E, E, _t(13), _t(2), _t(2))})
    with pytest.raises(SetupError, match="staged"):
        ebc.apply_plan(plan, ebc.stage(other))
    with pytest.raises(SetupError, match="step"):
        ebc.apply_plan(plan, StagedRows(step=7, tables=ebc.stage(plan).tables))
    assert _unchanged(ebc, snap)
    ebc.apply_plan(plan, ebc.stage(plan))
    assert ebc.slot_ids("t0")[2] == 12


def test_forward_refuses_bad_values() -> None:
    ebc = _loaded()

    def kjt(f0: int, f2: int, f3: int) -> KeyedJaggedTensor:
        return KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2", "f3"], _t(f0, f2, f3), _t(1, 0, 1, 1))

    ebc(kjt(0, 0, 29))  # fine
    with pytest.raises(InvalidIdError, match="t2") as bad_id:
        ebc(kjt(0, 0, 30))  # resident table: id out of range
    assert bad_id.value.facts == {"table": "t2", "batch": None, "id": 30, "num_rows": 30}
    with pytest.raises(CapacityError, match="t0") as bad_slot:
        ebc(kjt(4, 0, 0))  # slot >= capacity
    assert bad_slot.value.facts == {
        "table": "t0",
        "batch": None,
        "needed": 5,
        "available": 4,
        "tier": "device",
    }
    with pytest.raises(SetupError, match="empty slot"):
        ebc(kjt(3, 0, 0))
    with pytest.raises(DataError, match="missing"):
        ebc(KeyedJaggedTensor.from_lengths_sync(["f0"], _t(0), _t(1)))


def test_remap_refuses_a_plan_of_another_batch() -> None:
    ebc = _loaded()
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2", "f3"], _t(10, 11, 5, 1), _t(1, 1, 1, 1))
    good = BatchPlan(1, {"t0": TablePlan(E, E, E, E, _t(0, 1)), "t1": TablePlan(E, E, E, E, _t(0))})
    assert ebc.remap(kjt, good).values().tolist() == [0, 1, 0, 1]
    with pytest.raises(DataError, match="slots"):
        ebc.remap(kjt, BatchPlan(1, {"t0": TablePlan(E, E, E, E, _t(0)), "t1": TablePlan(E, E, E, E, _t(0))}))
    with pytest.raises(DataError, match="no entry"):
        ebc.remap(kjt, BatchPlan(1, {"t0": TablePlan(E, E, E, E, _t(0, 1))}))
    with pytest.raises(ConfigError, match="not cached"):
        ebc.remap(kjt, BatchPlan(1, {"t2": TablePlan(E, E, E, E, _t(0))}))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"capacity": {"nope": 3}}, "unknown table"),
        ({"capacity": {"t0": 0}}, "positive"),
        ({"capacity": {"t0": 2.5}}, "positive"),
        ({"capacity": {}, "stores": {"t0": TensorStore(200, 8, {"momentum1": 1}, name="t0")}}, "resident"),
        ({"capacity": {"t0": 4}, "stores": {"t0": TensorStore(200, 8, {}, name="t0")}}, "store of table"),
    ],
)
def test_bad_construction_is_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CachedEmbeddingBagCollection(make_tables(), **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"optimizer": "lamb"},
        {"optimizer": "adamw?"},
        {"learning_rate": 0.0},
        {"beta1": 1.0},
        {"kernel": "cuda"},
        {"weight_decay_mode": "COUNTER"},
    ],
)
def test_bad_optimizer_config_is_refused(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        CacheOptimizerConfig(**kwargs)


def test_fbgemm_dimension_rule_is_checked() -> None:
    tables = [EmbeddingBagConfig(name="t", embedding_dim=6, num_embeddings=10, feature_names=["f"])]
    with pytest.raises(ConfigError, match="embedding_dim 6; FBGEMM's kernel needs a multiple of 4: use 8"):
        CachedEmbeddingBagCollection(tables, {"t": 4})
    CachedEmbeddingBagCollection(
        tables, {"t": 4}, CacheOptimizerConfig("adam")
    )  # the PyTorch kernel has no such rule


def test_a_table_of_another_data_type_is_refused_saying_what_to_do() -> None:
    from torchrec.modules.embedding_configs import DataType

    tables = [
        EmbeddingBagConfig(
            name="t", embedding_dim=8, num_embeddings=10, feature_names=["f"], data_type=DataType.FP16
        )
    ]
    with pytest.raises(
        ConfigError, match="'t' has data_type FP16; .* build it with data_type FP32, or leave it out"
    ):
        CachedEmbeddingBagCollection(tables, {"t": 4})


def test_counters() -> None:
    ebc = _loaded()
    s = ebc.stats()["t0"]
    assert (s["lookups"], s["hits"], s["rows_fetched"], s["rows_written_back"]) == (2, 0, 2, 0)
    ebc.apply_plan(BatchPlan(1, {"t0": TablePlan(_t(10), _t(0), _t(12), _t(0), _t(1, 0, 1))}))
    s = ebc.stats()["t0"]
    assert (s["lookups"], s["hits"], s["rows_fetched"], s["rows_written_back"]) == (5, 2, 3, 1)
    assert s["bytes_moved"] == 4 * 8 * 4  # 4 rows of 8 floats (SGD has no state)
    ebc.reset_stats()
    assert ebc.stats()["t0"]["lookups"] == 0


def test_forward_after_a_trusted_plan_still_refuses_resident_ids_out_of_range() -> None:
    """A trusted plan skips the slot checks of cached features, never the id checks of resident tables."""
    ebc = _loaded()
    plan = BatchPlan(1, {"t0": TablePlan(E, E, E, E, _t(0)), "t1": TablePlan(E, E, E, E, _t(0))})

    def kjt(f3: int) -> KeyedJaggedTensor:
        return KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2", "f3"], _t(0, 0, f3), _t(1, 0, 1, 1))

    for bad in (30, -1):
        ebc.apply_plan(plan, trusted=True)
        with pytest.raises(InvalidIdError, match=f"t2.*{bad}"):
            ebc(kjt(bad))
    ebc.apply_plan(plan, trusted=True)
    ebc(kjt(29))


def test_a_trusted_plan_skips_the_slot_checks_of_exactly_one_forward() -> None:
    """The applied plan is remembered until the next forward consumes it; the forward after runs every check."""
    ebc = _loaded()
    assert ebc.applied_plan == AppliedPlan(0, trusted=False)
    batch = KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2", "f3"], _t(3, 0, 0), _t(1, 0, 1, 0))
    ebc.apply_plan(BatchPlan(1, {"t0": TablePlan(E, E, E, E, _t(3))}), trusted=True)
    assert ebc.applied_plan == AppliedPlan(1, trusted=True)
    ebc(batch)  # slot 3 of t0 is empty, but a trusted plan's forward does not check the cached slots
    assert ebc.applied_plan is None
    with pytest.raises(SetupError, match="empty slot"):
        ebc(batch)  # the next forward checks them again
    ebc.apply_plan(BatchPlan(2, {"t0": TablePlan(E, E, E, E, E)}))  # untrusted: the forward checks every slot
    assert ebc.applied_plan == AppliedPlan(2, trusted=False)
    with pytest.raises(SetupError, match="empty slot"):
        ebc(batch)
    ebc.apply_plan(BatchPlan(3, {"t0": TablePlan(E, E, E, E, E)}), trusted=True)
    ebc.invalidate()  # the rows the trusted plan vouched for are gone: so is the plan
    assert ebc.applied_plan is None
    with pytest.raises(SetupError, match="empty slot"):
        ebc(batch)
