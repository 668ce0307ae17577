"""The capacity pre-scan refuses with the largest need of the batches it read, not the first window's that does not
fit: a user who raises a capacity to the number it names is not refused again at a later, larger window."""

from typing import Any, List

import pytest
import torch

from torchrec_lookahead import CapacityError
from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig
from torchrec_lookahead.runtime import CacheTarget
from torchrec_lookahead.runtime.scan import prescan

from .test_scan import ROWS, _batch, _Counted

HORIZON = 3


def _growing() -> List[Any]:
    """Batch i reads ``w[i]`` new ids and again the new ids of batch i - 2: the ttl policy keeps those between
    their uses, so the rows it holds grow along the stream (10 at batch 5, 11 at batch 6, 12 at the end)."""
    widths = [2, 2, 2, 3, 3, 4, 4, 4, 4]
    fresh, start = [], 0
    for w in widths:
        fresh.append(list(range(start, start + w)))
        start += w
    return [_batch(fresh[i] + (fresh[i - 2] if i >= 2 else [])) for i in range(len(widths))]


def _ttl(cap: int, **kw: Any) -> Any:
    target = CacheTarget(
        capacity={"t": cap}, feature_to_table={"f": "t"}, num_embeddings={"t": ROWS}, stores={}
    )
    fields = dict(
        capacity={"t": cap}, policy="ttl", horizon=HORIZON, prefetch_depth=0, num_embeddings={"t": ROWS}
    )
    return prescan(_Counted(_growing()), target, prefetch_depth=0, oracle_fields=fields, **kw)


def test_a_ttl_refusal_names_the_largest_need_so_one_retry_suffices() -> None:
    # what the ttl policy holds at most over the stream (the capacity it needs)
    oracle = LookaheadOracle(OracleConfig(capacity={"t": ROWS}, horizon=HORIZON, policy="ttl"))
    list(oracle.plan_stream([{"t": b.sparse_features.values()} for b in _growing()]))
    assert oracle.stats()["t"]["peak_rows"] == 12
    for cap in (8, 10, 11):  # it named 10 at batch 5 for 8, then 11 at batch 6 for 10, then 12 for 11
        with pytest.raises(CapacityError) as err:
            _ttl(cap)
        msg = str(err.value)
        assert err.value.needed == 12 and err.value.available == cap, msg
        assert msg.startswith(
            f"table 't': policy 'ttl' needs {cap + 1 if cap > 8 else 10} cache rows at batch "
        ), msg
        assert "need at most {'t': 12} rows" in msg and "horizon" in msg, msg
    scan = _ttl(12)
    assert scan.ended and scan.need == {"t": 12}


def test_a_bounded_ttl_scan_names_the_largest_need_of_what_it_read() -> None:
    with pytest.raises(CapacityError) as err:
        _ttl(8, max_batches=9)  # the bound reached before the end: the last horizon batches are not planned
    assert err.value.needed == 10 and "need at most {'t': 10} rows" in str(err.value)


def test_window_refusals_name_the_largest_window_of_each_cache() -> None:
    """belady, a table alone and a shared cache: ``needed`` is what the capacity must hold (the largest window),
    not the first window's need."""
    batches = [_batch(list(range(k * 10, k * 10 + 2 + k))) for k in range(4)]  # windows of 5, 7, 9 ids
    target = CacheTarget(
        capacity={"t": 3}, feature_to_table={"f": "t"}, num_embeddings={"t": ROWS}, stores={}
    )
    with pytest.raises(CapacityError) as err:
        prescan(_Counted(batches), target, prefetch_depth=1)
    assert (err.value.needed, err.value.batch) == (9, 1) and "batches 0..1" in str(err.value)
    assert prescan(_Counted(batches), CacheTarget({"t": 9}, {"f": "t"}, {"t": ROWS}, {}), 1).need == {"t": 9}

    def pair(k: int) -> Any:
        from torchrec.datasets.utils import Batch
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        a, b = list(range(k + 1)), list(range(10, 11 + k))
        kjt = KeyedJaggedTensor(keys=["fa", "fb"], values=torch.tensor(a + b),
                                lengths=torch.ones(len(a) + len(b), dtype=torch.int32))  # fmt: skip
        return Batch(torch.zeros(len(a), 1), kjt, torch.zeros(len(a)))

    def shared(a: int, b: int) -> CacheTarget:
        return CacheTarget({"a": a, "b": b}, {"fa": "a", "fb": "b"}, {"a": ROWS, "b": ROWS}, {},
                           slot_spaces={"s": ("a", "b")})  # fmt: skip

    stream = [pair(k) for k in range(5)]  # the space's windows (depth 0): 2, 4, 6, 8, 10 rows
    with pytest.raises(CapacityError) as err:
        prescan(_Counted(stream), shared(2, 3), prefetch_depth=0)
    msg = str(err.value)
    assert (err.value.table, err.value.needed, err.value.available, err.value.batch) == ("s", 10, 5, 2), msg
    assert (
        "batch 2 needs 6 cache rows but it holds 5" in msg and "10 rows for tables ['a', 'b'] together" in msg
    )
    assert prescan(_Counted(stream), shared(7, 3), prefetch_depth=0).space_need == {"s": 10}
