"""Errors carry their facts as attributes, raised by the code that knows them, with the message unchanged."""

import pickle

import pytest
import torch

from torchrec_lookahead.errors import CapacityError, ConfigError, InvalidIdError
from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig
from torchrec_lookahead.runtime.capacity import check_stream
from torchrec_lookahead.store import TensorStore


def test_the_oracle_capacity_error_names_table_batch_needed_and_available():
    oracle = LookaheadOracle(OracleConfig(capacity={"a": 5}, horizon=10, prefetch_depth=1))
    oracle.feed({"a": torch.tensor([0, 1, 2])})
    with pytest.raises(CapacityError, match=r"need 6 cache rows but capacity\['a'\] is 5") as info:
        oracle.feed({"a": torch.tensor([3, 4, 5])})
    assert info.value.facts == {"table": "a", "batch": 1, "needed": 6, "available": 5, "tier": "device"}


def test_ttl_and_epoch_scan_capacity_errors_carry_the_same_facts():
    cfg = OracleConfig(capacity={"a": 3}, horizon=3, policy="ttl")
    stream = [{"a": torch.tensor([0, 1])}, {"a": torch.tensor([2, 3])}, {"a": torch.tensor([0, 1, 2, 3])}]
    with pytest.raises(CapacityError, match="needs 4 cache rows at batch 1") as info:
        list(LookaheadOracle(cfg).plan_stream(stream))
    assert (info.value.table, info.value.batch, info.value.needed, info.value.available) == ("a", 1, 4, 3)
    with pytest.raises(CapacityError) as info:
        check_stream(stream, {"a": 3}, {"a": "a"}, {"a": 10}, 0)
    assert info.value.facts == {"table": "a", "batch": 2, "needed": 4, "available": 3, "tier": "device"}


def test_invalid_id_errors_name_table_batch_id_and_rows():
    cfg = OracleConfig(capacity={"a": 4}, num_embeddings={"a": 100})
    with pytest.raises(InvalidIdError, match=r"id 100 in batch 1") as info:
        list(LookaheadOracle(cfg).plan_stream([{"a": torch.tensor([1])}, {"a": torch.tensor([100])}]))
    assert info.value.facts == {"table": "a", "batch": 1, "id": 100, "num_rows": 100}
    store = TensorStore(10, 2, {}, name="t", seed=0)
    with pytest.raises(InvalidIdError, match=r"id -3 of table 't'") as info:
        store.gather(torch.tensor([1, -3]))
    assert info.value.facts == {"table": "t", "batch": None, "id": -3, "num_rows": 10}


def test_facts_survive_pickling_and_unknown_facts_are_refused():
    e = CapacityError("too small", table="t", batch=2, needed=9, available=8, tier="host")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is CapacityError and str(back) == "too small" and back.facts == e.facts
    assert ConfigError("plain").facts == {}
    with pytest.raises(TypeError, match="not \\['rows'\\]"):
        CapacityError("x", rows=3)


def test_pinned_rows_errors_name_the_table_and_its_rows():
    from torchrec_lookahead.fae.pinned import PinnedRows

    with pytest.raises(CapacityError, match="pins 2 hot rows in a cache of 2 rows") as info:
        PinnedRows({"t": torch.tensor([3, 7])}, {"f": "t"}, {"t": 2}, {"t": 100})
    assert info.value.facts == {"table": "t", "batch": None, "needed": 3, "available": 2, "tier": "device"}
    with pytest.raises(InvalidIdError, match="hot id 300") as info:
        PinnedRows({"t": torch.tensor([300])}, {"f": "t"}, {"t": 5}, {"t": 100})
    assert info.value.facts == {"table": "t", "batch": None, "id": 300, "num_rows": 100}
