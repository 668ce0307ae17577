"""Samples' vectorised classify/select/slice against a per-feature, per-sample reference."""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.errors import InvalidIdError
from torchrec_lookahead.fae import Samples

ROWS = {"a": 7, "b": 50, "c": 3}


def _batch(g: torch.Generator, n: int, max_len: int = 3) -> Batch:
    keys = list(ROWS)
    lengths = torch.randint(0, max_len + 1, (len(keys), n), generator=g, dtype=torch.int32)
    values = [torch.randint(0, ROWS[k], (int(lengths[i].sum()),), generator=g) for i, k in enumerate(keys)]
    kjt = KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=lengths.reshape(-1))
    return Batch(torch.randn(n, 2, generator=g), kjt, torch.randint(0, 2, (n,), generator=g).float())


def _rows(s: Samples) -> List[Dict[str, List[int]]]:
    """Per sample, its ids per feature (the reference layout)."""
    out: List[Dict[str, List[int]]] = [{} for _ in range(len(s))]
    for k, lengths, values in zip(s.keys, s.lengths, s.values):
        for i, part in enumerate(values.split(lengths.tolist())):
            out[i][k] = part.tolist()
    return out


@pytest.mark.parametrize("seed", range(5))
def test_classify_select_slice_and_cat_match_a_per_sample_reference(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    s = Samples.of(_batch(g, 40))
    masks = {k: torch.rand(r, generator=g) < 0.8 for k, r in ROWS.items()}
    rows = _rows(s)
    expected = [all(bool(masks[k][i]) for k, ids in r.items() for i in ids) for r in rows]
    hot = s.hot(masks)
    assert hot.tolist() == expected
    assert _rows(s.select(hot)) == [r for r, h in zip(rows, expected) if h]
    assert _rows(s.select(~hot)) == [r for r, h in zip(rows, expected) if not h]
    assert _rows(s.slice(5, 17)) == rows[5:17] and _rows(s.slice(0, 0)) == []
    assert _rows(Samples.cat([s.slice(0, 9), s.slice(9, 40)])) == rows
    assert torch.equal(s.select(hot).labels, s.labels[hot])
    back = Samples.of(s.batch())
    assert _rows(back) == rows and back.lengths.dtype == torch.int64


def test_an_id_outside_the_hot_masks_is_a_typed_error() -> None:
    kjt = KeyedJaggedTensor(
        keys=["a", "b"], values=torch.tensor([1, 2, 60]), lengths=torch.tensor([1, 1, 0, 1])
    )
    s = Samples.of(Batch(torch.zeros(2, 1), kjt, torch.zeros(2)))
    masks = {k: torch.ones(r, dtype=torch.bool) for k, r in ROWS.items()}
    with pytest.raises(InvalidIdError, match="id 60 of feature 'b'") as info:
        s.hot(masks)
    assert info.value.num_rows == 50
