"""The capacity pre-scan bounded in batches or seconds: what it reads, what it finds, what it leaves as it was."""

import itertools
from types import SimpleNamespace
from typing import Any, List

import pytest
import torch
from torch.utils.data import DataLoader

from torchrec_lookahead import CapacityError, InvalidIdError
from torchrec_lookahead.runtime import CacheTarget
from torchrec_lookahead.runtime.scan import prescan

ROWS = 50


def _batch(ids: List[int]) -> Any:
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor(ids, dtype=torch.int64),
                            lengths=torch.ones(len(ids), dtype=torch.int32))  # fmt: skip
    return Batch(torch.zeros(len(ids), 1), kjt, torch.zeros(len(ids)))


class _Counted:
    """Batches, counting those read."""

    def __init__(self, batches: List[Any]) -> None:
        self.batches = batches
        self.read = 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        for b in self.batches:
            self.read += 1
            yield b


def _target(capacity: int = 8) -> CacheTarget:
    return CacheTarget(
        capacity={"t": capacity}, feature_to_table={"f": "t"}, num_embeddings={"t": ROWS}, stores={}
    )


def _batches(n: int) -> List[Any]:
    return [_batch([2 * i % ROWS, (2 * i + 1) % ROWS]) for i in range(n)]


def test_a_batch_bound_reads_that_many_batches_and_no_more():
    loader = _Counted(_batches(20))
    scan = prescan(loader, _target(), prefetch_depth=1, max_batches=5)
    assert (scan.batches, scan.ended, loader.read) == (5, False, 5)
    assert scan.need == {"t": 4}  # two batches of two new ids each
    whole = prescan(_Counted(_batches(20)), _target(), prefetch_depth=1, max_batches=50)
    assert (whole.batches, whole.ended) == (20, True)
    assert prescan(_Counted(_batches(20)), _target(), prefetch_depth=1).need == whole.need  # no bound


def test_a_time_bound_stops_before_the_first_batch_read_after_it(monkeypatch):
    clock = itertools.count()  # one second per reading of the clock
    monkeypatch.setattr(
        "torchrec_lookahead.runtime.scan.time", SimpleNamespace(perf_counter=lambda: next(clock))
    )
    loader = _Counted(_batches(20))
    scan = prescan(loader, _target(), prefetch_depth=1, max_seconds=3.5)
    # the clock is read at the start (0) and before each batch (1, 2, 3 read; 4 >= 3.5 stops)
    assert (scan.batches, scan.ended, loader.read) == (3, False, 3)
    # with both bounds, the first one reached stops the scan
    clock = itertools.count()
    assert prescan(_Counted(_batches(20)), _target(), 1, max_batches=2, max_seconds=3.5).batches == 2


def test_a_bounded_scan_finds_what_lies_within_its_bound_only():
    batches = _batches(10) + [_batch([1, 3, 5, 7, 9, 11, 13, 15, 17])]  # batch 10: more rows than the cache
    with pytest.raises(CapacityError, match="batch 10"):
        prescan(_Counted(batches), _target(), prefetch_depth=0)
    assert prescan(_Counted(batches), _target(), prefetch_depth=0, max_batches=10).batches == 10
    bad = _batches(4) + [_batch([ROWS])]
    with pytest.raises(InvalidIdError, match="batch 4"):
        prescan(_Counted(bad), _target(), prefetch_depth=1, max_batches=5)
    assert prescan(_Counted(bad), _target(), prefetch_depth=1, max_batches=4).need == {"t": 4}


def test_a_bounded_scan_leaves_a_shuffling_loaders_order_and_the_random_streams_as_they_were():
    loader = DataLoader(_batches(12), batch_size=None, shuffle=True, collate_fn=lambda b: b)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    scan = prescan(loader, _target(), prefetch_depth=1, max_batches=3)
    assert scan.batches == 3 and torch.equal(torch.get_rng_state(), before)
    after = [b.sparse_features.values().tolist() for b in loader]
    torch.manual_seed(0)
    assert after == [b.sparse_features.values().tolist() for b in loader]


def test_a_shared_space_reports_its_tables_need_together() -> None:
    """A pooled cache's need is its tables' windows together, against the sum of their capacities: a member's
    own need above its share is no overflow."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    def batch(a: List[int], b: List[int]) -> Any:
        kjt = KeyedJaggedTensor(keys=["fa", "fb"], values=torch.tensor(a + b), lengths=torch.ones(len(a) + len(b),
                                dtype=torch.int32))  # fmt: skip
        return Batch(torch.zeros(len(a), 1), kjt, torch.zeros(len(a)))

    target = CacheTarget(
        capacity={"a": 2, "b": 4},
        feature_to_table={"fa": "a", "fb": "b"},
        num_embeddings={"a": ROWS, "b": ROWS},
        stores={},
        slot_spaces={"a+1": ("a", "b")},
    )
    scan = prescan(_Counted([batch([1, 2], [5, 6]), batch([3, 4], [5, 6])]), target, prefetch_depth=1)
    assert scan.need == {"a": 4, "b": 2} and scan.space_need == {"a+1": 6}
