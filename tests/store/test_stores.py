"""Host stores: deterministic initial values, gather/scatter, validation, memory-mapped round trips, threads."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pytest
import torch

from torchrec_lookahead.errors import ConfigError, DataError, InvalidIdError
from torchrec_lookahead.store import (
    EmbeddingStore,
    MmapStore,
    TensorStore,
    init_embedding_weights,
    init_rows,
    init_rows_at,
)
from torchrec_lookahead.store.init import INIT_BLOCK_ROWS

N, D = 20000, 4  # three chunks of 8192 rows
WIDTHS = {"momentum1": D, "momentum2": 1}

StoreFactory = Callable[[Path], EmbeddingStore]
FACTORIES = {
    "tensor": lambda p: TensorStore(N, D, WIDTHS, name="t", seed=5, chunk_rows=8192),
    "mmap": lambda p: MmapStore(p / "t.bin", N, D, WIDTHS, name="t", seed=5, chunk_rows=8192),
}


def test_initial_values_are_fixed_per_row() -> None:
    """The initial values are a fixed function of (seed, table, rows, dim, row, column): changing the initialiser
    changes every trajectory, so it fails here first. Any rows, in any order, are computed on their own."""
    golden = [
        ["-0x1.4bfb4p-4", "-0x1.8581fap-5", "-0x1.77401p-4"],
        ["-0x1.5c153p-4", "-0x1.6ebf0ep-5", "0x1.23b08cp-5"],
    ]
    want = torch.tensor([[float.fromhex(v) for v in row] for row in golden])
    assert torch.equal(init_rows(0, "t0", 0, 2, 3, 100), want)
    rows = np.random.default_rng(0).permutation(N)[:500]
    rows[:3] = [7, 7, N - 1]  # repeats and the last row
    assert np.array_equal(init_rows_at(1, "t", rows, D, N), init_rows(1, "t", 0, N, D, N).numpy()[rows])
    assert init_rows_at(1, "t", np.empty(0, np.int64), D, N).shape == (0, D)
    with pytest.raises(ConfigError, match="0 <= rows < num_embeddings"):
        init_rows_at(1, "t", np.array([N]), D, N)
    with pytest.raises(ConfigError, match="0 <= start <= stop <= num_embeddings"):
        init_rows(1, "t", 5, 4, D, N)


@pytest.fixture(params=sorted(FACTORIES))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> EmbeddingStore:
    return FACTORIES[request.param](tmp_path)


def test_initial_values_do_not_depend_on_chunking() -> None:
    whole = init_rows(1, "t", 0, N, D, N)
    pieces = torch.cat([init_rows(1, "t", a, min(a + 777, N), D, N) for a in range(0, N, 777)])
    assert torch.equal(whole, pieces)
    bound = (1.0 / N) ** 0.5
    assert whole.abs().max() <= bound and whole.std() > bound / 3
    assert not torch.equal(whole, init_rows(2, "t", 0, N, D, N))
    assert not torch.equal(whole, init_rows(1, "u", 0, N, D, N))
    assert torch.equal(init_embedding_weights(torch.empty(N, D), "t", seed=1, chunk_rows=1000), whole)
    shard = init_embedding_weights(
        torch.empty(100, D), "t", seed=1, num_embeddings=N, row_offset=INIT_BLOCK_ROWS - 50
    )
    assert torch.equal(shard, whole[INIT_BLOCK_ROWS - 50 : INIT_BLOCK_ROWS + 50])


@pytest.mark.parametrize("chunk_rows", [None, 2 * INIT_BLOCK_ROWS, 65536])
@pytest.mark.parametrize("row_offset", [0, 5000])
def test_rows_do_not_depend_on_the_block_size_or_the_order_of_first_touch(
    chunk_rows: Optional[int], row_offset: int
) -> None:
    """A store initialised block by block in a random order, gathers and writes interleaved, holds the rows of one
    initialised whole in 65,536-row chunks (the former default) and of the whole table's init_rows, bit for bit;
    a gather initialises only the blocks its ids fall in (the whole table's blocks, for a shard)."""
    n, table_rows = 3 * 65536 + 123, 3 * 65536 + 123 + row_offset + 777
    kwargs = dict(name="t", seed=5, row_offset=row_offset, table_rows=table_rows)
    before = TensorStore(n, D, WIDTHS, chunk_rows=65536, **kwargs)  # type: ignore[arg-type]
    expected = before.full_weights().clone()
    assert torch.equal(expected, init_rows(5, "t", row_offset, row_offset + n, D, table_rows))
    sized = {} if chunk_rows is None else {"chunk_rows": chunk_rows}
    store = TensorStore(n, D, WIDTHS, **sized, **kwargs)  # type: ignore[arg-type]
    block = chunk_rows or INIT_BLOCK_ROWS
    gen = torch.Generator().manual_seed(row_offset + block)
    order = torch.randperm(n, generator=gen)
    first = order[:5]  # a gather initialises the whole table's blocks its ids fall in, and no other
    store.gather(first)
    assert int(store._flags.sum()) == torch.unique((first + row_offset) // block).numel()
    for k, ids in enumerate(order[:6000].split(600)):
        w, s = store.gather(ids)
        assert torch.equal(w, expected[ids]) and all(float(v.abs().sum()) == 0.0 for v in s.values())
        written = ids[:10]
        zeros = {key: torch.zeros(10, width) for key, width in WIDTHS.items()}
        store.scatter(written, torch.full((10, D), float(k)), zeros)
        expected[written] = float(k)
    assert torch.equal(store.full_weights(), expected)
    loaded = TensorStore(n, D, WIDTHS, **sized, **kwargs)  # type: ignore[arg-type]
    loaded.load(expected)
    assert torch.equal(loaded.full_weights(), expected) and bool(loaded._flags.all())


def test_a_tensor_store_initialises_one_generator_block_at_a_time_by_default() -> None:
    store = TensorStore(100_000, D, WIDTHS, name="t", seed=5)
    store.gather(torch.tensor([70_000]))
    assert store._chunk_rows == INIT_BLOCK_ROWS and int(store._flags.sum()) == 1
    assert torch.equal(store.full_weights(), init_rows(5, "t", 0, 100_000, D, 100_000))


def test_gather_initial_rows_and_zero_state(store: EmbeddingStore) -> None:
    ids = torch.tensor([0, 19999, 8192, 8191, 0])
    w, s = store.gather(ids)
    assert torch.equal(w, init_rows(5, "t", 0, N, D, N)[ids])
    assert set(s) == set(WIDTHS) and s["momentum1"].shape == (5, D) and s["momentum2"].shape == (5, 1)
    assert all(float(v.abs().sum()) == 0.0 for v in s.values())
    assert store.nbytes == N * (D + D + 1) * 4


def test_scatter_then_gather_and_full_views(store: EmbeddingStore) -> None:
    ids = torch.tensor([3, 10000, 19999])
    w = torch.randn(3, D)
    s = {"momentum1": torch.rand(3, D), "momentum2": torch.rand(3)}  # (n,) accepted for width 1
    store.scatter(ids, w, s)
    w2, s2 = store.gather(ids)
    assert torch.equal(w2, w) and torch.equal(s2["momentum1"], s["momentum1"])
    assert torch.equal(s2["momentum2"].flatten(), s["momentum2"])
    full = store.full_weights()
    assert full.shape == (N, D) and torch.equal(full[ids], w)
    assert torch.equal(full[5], init_rows(5, "t", 5, 6, D, N)[0])
    assert torch.equal(store.full_states()["momentum1"][ids], s["momentum1"])


def test_write_back_equals_scatter(store: EmbeddingStore, tmp_path: Path) -> None:
    """The unchecked write-back path leaves the same rows as scatter, also into chunks not yet initialised."""
    other = TensorStore(N, D, WIDTHS, name="t", seed=5, chunk_rows=8192)
    ids = torch.tensor([19999, 3, 8192, 12000])  # the last chunk first: lazily initialised on the way
    w = torch.randn(4, D)
    st = {"momentum1": torch.rand(4, D), "momentum2": torch.rand(4)}  # (n,) accepted for width 1
    store.write_back(ids, w, st)
    other.scatter(ids, w, st)
    assert torch.equal(store.full_weights(), other.full_weights())
    for key in WIDTHS:
        assert torch.equal(store.full_states()[key], other.full_states()[key])
    store.write_back(ids[:0], w[:0], {k: v[:0] for k, v in st.items()})  # nothing to write


def test_write_back_of_a_store_overriding_scatter_goes_through_its_scatter() -> None:
    """A store subclass with its own scatter (checks, logging, dirty rows) still sees every write-back."""
    calls = []

    class Logged(TensorStore):
        def scatter(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(args[0].tolist())
            super().scatter(*args, **kwargs)

    s = Logged(10, D, name="t")
    s.write_back(torch.tensor([1, 2]), torch.ones(2, D))
    assert calls == [[1, 2]] and torch.equal(s.gather(torch.tensor([2]))[0], torch.ones(1, D))
    with pytest.raises(InvalidIdError):
        s.write_back(torch.tensor([3, 3]), torch.ones(2, D))


def test_load_replaces_everything(store: EmbeddingStore) -> None:
    w = torch.randn(N, D)
    store.load(w, {"momentum1": torch.ones(N, D)})
    assert torch.equal(store.full_weights(), w)
    assert float(store.full_states()["momentum1"].sum()) == N * D
    assert float(store.full_states()["momentum2"].abs().sum()) == 0.0  # omitted states are reset
    with pytest.raises(DataError):
        store.load(torch.zeros(N - 1, D))
    with pytest.raises(DataError):
        store.load(w, {"exp_avg": torch.zeros(N, D)})


@pytest.mark.parametrize(
    "ids, error",
    [
        (torch.tensor([1, N]), InvalidIdError),
        (torch.tensor([-1, 2]), InvalidIdError),
        (torch.tensor([[1, 2]]), InvalidIdError),
        (torch.tensor([1.0, 2.0]), InvalidIdError),
        (torch.tensor([4, 4]), InvalidIdError),  # scatter only: repeated id
    ],
)
def test_bad_ids_are_refused_and_store_unchanged(
    store: EmbeddingStore, ids: torch.Tensor, error: type
) -> None:
    before = store.gather(torch.arange(N))
    n = ids.numel()
    with pytest.raises(error, match="'t'"):
        store.scatter(
            ids, torch.zeros(n, D), {"momentum1": torch.zeros(n, D), "momentum2": torch.zeros(n, 1)}
        )
    if not torch.equal(ids, torch.tensor([4, 4])):
        with pytest.raises(error):
            store.gather(ids)
    after = store.gather(torch.arange(N))
    assert torch.equal(before[0], after[0]) and all(torch.equal(before[1][k], after[1][k]) for k in WIDTHS)


def test_bad_shapes_and_state_names_are_refused(store: EmbeddingStore) -> None:
    ids = torch.tensor([1, 2])
    good = {"momentum1": torch.zeros(2, D), "momentum2": torch.zeros(2, 1)}
    with pytest.raises(DataError, match="weights"):
        store.scatter(ids, torch.zeros(2, D + 1), good)
    with pytest.raises(DataError, match="keys"):
        store.scatter(ids, torch.zeros(2, D), {"momentum1": torch.zeros(2, D)})
    with pytest.raises(DataError, match="momentum2"):
        store.scatter(ids, torch.zeros(2, D), {**good, "momentum2": torch.zeros(2, 2)})
    assert torch.equal(store.gather(ids)[0], init_rows(5, "t", 1, 3, D, N))


def test_bad_sizes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        TensorStore(0, 4)
    with pytest.raises(ConfigError):
        TensorStore(10, 4, {"m": 0})
    with pytest.raises(ConfigError):
        TensorStore(10, 4, chunk_rows=1000)
    with pytest.raises(ConfigError):
        MmapStore(tmp_path / "x.bin", 10, -1)


def test_concurrent_gather_and_scatter_on_disjoint_ids(store: EmbeddingStore) -> None:
    """A stager thread gathers while the training thread writes back other ids (chunks initialise lazily)."""
    errors = []
    written = torch.arange(0, N, 2)
    expected = torch.arange(float(N * D)).view(N, D)

    def writer() -> None:
        try:
            for part in written.split(500):
                store.scatter(
                    part, expected[part], {"momentum1": expected[part], "momentum2": part.float()[:, None]}
                )
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    def reader() -> None:
        try:
            for part in torch.arange(1, N, 2).split(500):
                w, _ = store.gather(part)
                if not torch.equal(w, init_rows(5, "t", 0, N, D, N)[part]):
                    errors.append(AssertionError("a read saw a value it should not"))
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert torch.equal(store.gather(written)[0], expected[written])


def test_mmap_initialises_lazily_and_reopens(tmp_path: Path) -> None:
    path = tmp_path / "big.bin"
    store = MmapStore(path, N, D, WIDTHS, name="t", seed=5, chunk_rows=8192)
    store.gather(torch.tensor([8200]))
    assert store._flags.tolist() == [0, 1, 0]  # only the touched chunk was written
    store.scatter(
        torch.tensor([9000]),
        torch.full((1, D), 3.0),
        {"momentum1": torch.ones(1, D), "momentum2": torch.ones(1, 1)},
    )
    store.close()
    assert json.loads((tmp_path / "big.bin.meta.json").read_text())["num_embeddings"] == N
    again = MmapStore(path, N, D, WIDTHS, name="t", seed=5, chunk_rows=8192)  # same arguments: reopens
    assert again._flags.tolist() == [0, 1, 0]
    w, s = again.gather(torch.tensor([9000, 0]))
    assert w[0].tolist() == [3.0] * D and float(s["momentum2"][0]) == 1.0
    assert torch.equal(w[1], init_rows(5, "t", 0, 1, D, N)[0])
    again.close()
    with pytest.raises(ConfigError, match="created with"):
        MmapStore(path, N, D, {}, name="t", seed=5, chunk_rows=8192)
    with pytest.raises(ConfigError, match="created with"):
        MmapStore(path, N, D, WIDTHS, name="t", seed=6, chunk_rows=8192)
    with pytest.raises(ConfigError, match="no memory-mapped store"):
        MmapStore.open(tmp_path / "missing.bin")
    with pytest.raises(ConfigError, match="closed"):
        again.gather(torch.tensor([0]))


def test_mmap_equals_tensor_store_contents(tmp_path: Path) -> None:
    a = TensorStore(N, D, WIDTHS, name="t", seed=5)
    b = MmapStore(tmp_path / "t.bin", N, D, WIDTHS, name="t", seed=5)
    assert torch.equal(a.full_weights(), b.full_weights())
    b.close()


def test_collective_is_a_property_of_every_store():
    from torchrec_lookahead.store import RowShardedStore

    local = TensorStore(4, 2, name="t")
    assert local.collective is False
    assert local.host_window is None  # no host tier
    assert RowShardedStore.collective.fget(None) is True  # type: ignore[attr-defined]
