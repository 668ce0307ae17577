"""``remap_kjt``: a batch's cached ids replaced by the plan's slots, every other value, length and key kept."""

from __future__ import annotations

import pytest
import torch
from torchrec import KeyedJaggedTensor

from torchrec_lookahead.modules import remap_kjt
from torchrec_lookahead.oracle.types import BatchPlan, TablePlan

E = torch.empty(0, dtype=torch.int64)


def _plan(**slots: list) -> BatchPlan:
    return BatchPlan(
        3, {t: TablePlan(E, E, E, E, torch.tensor(s, dtype=torch.int64)) for t, s in slots.items()}
    )


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_cached_features_take_their_slots_in_key_order_and_the_others_keep_their_ids(
    dtype: torch.dtype,
) -> None:
    # f_a and f_c share t0 (its slots follow key order), f_b reads uncached t9, f_d is empty
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["f_a", "f_b", "f_c", "f_d"],
        torch.tensor([3, 9, 40, 41, 9, 5, 1], dtype=dtype),
        torch.tensor([1, 1, 2, 0, 1, 2, 0, 0], dtype=torch.int32),
    )
    plan = _plan(t0=[0, 2, 2, 1, 3])
    slots_before = plan.tables["t0"].slots.clone()
    values_before = kjt.values().clone()
    out = remap_kjt(kjt, plan, {"f_a": "t0", "f_b": "t9", "f_c": "t0", "f_d": "t1"}, ["t0", "t1"])
    assert out.values().tolist() == [0, 2, 40, 41, 2, 1, 3]
    assert out.values().dtype == dtype
    assert out.keys() == kjt.keys() and torch.equal(out.lengths(), kjt.lengths())
    assert out.length_per_key() == [2, 2, 3, 0] and out.offset_per_key() == [0, 2, 4, 7, 7]
    # a new tensor: neither the batch's values nor the plan's slots change when the result does
    out.values().fill_(-1)
    assert torch.equal(kjt.values(), values_before) and torch.equal(plan.tables["t0"].slots, slots_before)


def test_a_batch_of_one_cached_feature_or_none_gets_a_copy() -> None:
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([7, 8]), torch.tensor([2]))
    plan = _plan(t=[1, 0])
    out = remap_kjt(kjt, plan, {"f": "t"}, ["t"])
    assert out.values().tolist() == [1, 0]
    out.values().fill_(5)
    assert plan.tables["t"].slots.tolist() == [1, 0]
    kept = remap_kjt(kjt, BatchPlan(3, {}), {"f": "u"}, ["t"])  # nothing cached: the ids, copied
    assert kept.values().tolist() == [7, 8] and kept.values().data_ptr() != kjt.values().data_ptr()
