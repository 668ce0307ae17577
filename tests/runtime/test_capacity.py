"""The capacity pre-scan's check of a stream: a table alone, the tables of a shared slot space, and the ids of
the resident tables it reads on the way."""

from __future__ import annotations

import pytest
import torch

from torchrec_lookahead.errors import CapacityError, InvalidIdError
from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig
from torchrec_lookahead.runtime.capacity import check_stream, scan_stream

# window of batches 0..1 (prefetch depth 1): "a" reads 4 distinct ids, "b" 2
STREAM = [
    {"fa": torch.tensor([0, 1, 2]), "fb": torch.tensor([0])},
    {"fa": torch.tensor([3, 1]), "fb": torch.tensor([1, 1])},
]
FEATURES = {"fa": "a", "fb": "b"}
ROWS = {"a": 10, "b": 10}


def test_a_space_needs_room_for_its_members_together_not_each_its_share() -> None:
    capacity = {"a": 3, "b": 3}  # "a" alone is short, the space of both holds the window
    with pytest.raises(CapacityError, match="capacity\\['a'\\] is 3"):
        check_stream(STREAM, capacity, FEATURES, ROWS, 1)
    need = check_stream(STREAM, capacity, FEATURES, ROWS, 1, slot_spaces={"s": ("a", "b")})
    assert need == {"a": 4, "b": 2}
    # the oracle plans that space: the pre-scan accepts what the loader can plan
    cfg = OracleConfig(
        capacity=capacity,
        num_embeddings=ROWS,
        feature_to_table=FEATURES,
        horizon=1,
        slot_spaces={"s": ("a", "b")},
    )
    assert len(list(LookaheadOracle(cfg).plan_stream(STREAM))) == 2


def test_a_space_too_small_is_refused_naming_its_tables() -> None:
    """The refusal named the space's first table as if it alone needed the space's rows ("table 'a': ... needs 6
    cache rows", a table of 3 rows in a report on real data): it names the space's tables and their need together."""
    with pytest.raises(CapacityError) as err:
        check_stream(STREAM, {"a": 3, "b": 2}, FEATURES, ROWS, 1, slot_spaces={"s": ("a", "b")})
    msg = str(err.value)
    assert msg.startswith(
        "the cache shared by tables ['a', 'b'] (the sum of their capacities, 5 rows): batches 0..1 (batch 1 and "
    ), msg
    want = (
        "need 6 cache rows but it holds 5; the scanned batches' largest windows need 6 rows for tables ['a', "
    )
    assert want + "'b'] together: raise" in msg, msg
    assert "table 'a'" not in msg
    assert err.value.needed == 6 and err.value.available == 5 and err.value.table == "s"


def test_a_space_reports_its_tables_need_together() -> None:
    """A member's own need may exceed its share of the space's rows while the space holds the window."""
    need, spaces = scan_stream(STREAM, {"a": 3, "b": 3}, FEATURES, ROWS, 1, slot_spaces={"s": ("a", "b")})
    assert need == {"a": 4, "b": 2} and spaces == {"s": 6}
    assert scan_stream(STREAM, {"a": 4, "b": 2}, FEATURES, ROWS, 1) == ({"a": 4, "b": 2}, {})


@pytest.mark.parametrize("bad", [-1, 7])
def test_a_resident_features_id_out_of_its_table_is_refused_naming_the_feature_and_batch(bad: int) -> None:
    """Only the cached tables' ids were checked: a resident table's bad id failed at the step that read it."""
    resident = {"fr": ("r", 7)}
    caps = {"a": 4, "b": 2}
    good = [dict(b, fr=torch.tensor([0, 6])) for b in STREAM]
    assert check_stream(good, caps, FEATURES, ROWS, 1, resident_features=resident) == caps
    stream = good + [{"fa": torch.tensor([0]), "fb": torch.tensor([0]), "fr": torch.tensor([3, bad])}]
    with pytest.raises(
        InvalidIdError, match=rf"feature 'fr' of resident table 'r': batch 2 holds id {bad} outside \[0, 7\)"
    ) as err:
        check_stream(stream, caps, FEATURES, ROWS, 1, resident_features=resident)
    assert (err.value.table, err.value.batch, err.value.id, err.value.num_rows) == ("r", 2, bad, 7)
    assert check_stream(stream, caps, FEATURES, ROWS, 1) == caps  # none given: not checked
