"""torchrec_lookahead._arrays: the sort-based unique every per-batch path uses."""

from __future__ import annotations

import numpy as np
import pytest

from torchrec_lookahead._arrays import sorted_unique


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8, np.uint64])
@pytest.mark.parametrize("size", [0, 1, 2, 7, 1000, 20_000])
def test_sorted_unique_equals_numpy_unique(dtype: type, size: int) -> None:
    rng = np.random.default_rng(size)
    for high in (2, size + 1, 1 << 40):
        values = rng.integers(0, min(high, np.iinfo(dtype).max), size=size).astype(dtype)
        got, want = sorted_unique(values), np.unique(values)
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_sorted_unique_flattens_and_leaves_its_input_alone() -> None:
    values = np.array([[5, -1, 5], [3, 3, -1]], dtype=np.int64)
    before = values.copy()
    assert sorted_unique(values).tolist() == [-1, 3, 5]
    assert np.array_equal(values, before)
