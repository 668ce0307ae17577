"""Hot and cold mini-batches: every sample once per epoch, all-hot batches only hot, deterministic, bounded,
resumable mid-epoch, and the same global regrouping on every rank."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
import torch
from torchrec.datasets.utils import Batch

from torchrec_lookahead.data import CriteoSyntheticDataset, SyntheticCriteoConfig
from torchrec_lookahead.errors import CheckpointError, ConfigError
from torchrec_lookahead.fae import BatchKind, HotColdStream, Samples, count_hot_samples

SIZES = [300, 20, 500, 7, 2, 9, 40, 11, 5, 3] + [2] * 16


def _config(multi_hot: Any = None, world: int = 1, rank: int = 0, batch: int = 32) -> SyntheticCriteoConfig:
    return SyntheticCriteoConfig(
        batch_size=batch,
        num_batches=12,
        num_embeddings=SIZES,
        multi_hot=multi_hot,
        world_size=world,
        rank=rank,
        zipf_exponent=1.3,
    )


def _masks(ds: CriteoSyntheticDataset) -> Dict[str, torch.Tensor]:
    """Hot rows: tables of up to 12 rows wholly, of the others the most frequent half."""
    counts: Dict[str, torch.Tensor] = {
        f: torch.zeros(n, dtype=torch.int64) for f, n in ds.num_embeddings_per_feature().items()
    }
    for b in ds:
        for f, jt in b.sparse_features.to_dict().items():
            counts[f] += torch.bincount(jt.values(), minlength=counts[f].numel())
    out = {}
    for f, c in counts.items():
        keep = c.numel() if c.numel() <= 12 else int(0.5 * c.numel())
        m = torch.zeros(c.numel(), dtype=torch.bool)
        m[torch.argsort(c, descending=True, stable=True)[:keep]] = True
        out[f] = m
    return out


def _rows(batch: Batch) -> List[Tuple[Any, ...]]:
    s = Samples.of(batch)
    bags = [
        [tuple(x.tolist()) for x in torch.split(v, s.lengths[i].tolist())] for i, v in enumerate(s.values)
    ]
    dense = s.dense.tolist()
    labels = s.labels.tolist()
    return [(labels[j], tuple(dense[j]), tuple(b[j] for b in bags)) for j in range(len(s))]


def _stream(
    ds: CriteoSyntheticDataset, masks: Dict[str, torch.Tensor], batch: int = 32, window: int = 4, **kw: Any
) -> HotColdStream:
    return HotColdStream(
        lambda: iter(ds), masks, batch, window=window, num_samples=count_hot_samples(iter(ds), masks), **kw
    )


def _run(
    stream: HotColdStream, requests: Optional[List[Optional[BatchKind]]] = None, stop: Optional[int] = None
) -> List[Tuple[BatchKind, Batch]]:
    out = []
    for kind, b in _requested(stream, requests):
        out.append((kind, b))
        if stop is not None and len(out) == stop:
            break
    return out


def _requested(
    stream: HotColdStream, requests: Optional[List[Optional[BatchKind]]]
) -> Iterator[Tuple[BatchKind, Batch]]:
    it = iter(stream)
    i = sum(stream.served.values()) if stream._resume is None else sum(stream._resume.values())
    while True:
        stream.request(requests[i % len(requests)] if requests else None)
        try:
            yield next(it)
        except StopIteration:
            return
        i += 1


@pytest.mark.parametrize("multi_hot", [None, [3, 1, 2] + [1] * 23])
def test_every_sample_once_and_hot_batches_hot(multi_hot: Any) -> None:
    ds = CriteoSyntheticDataset(_config(multi_hot))
    masks = _masks(ds)
    stream = _stream(ds, masks)
    requests = [BatchKind.COLD, BatchKind.COLD, BatchKind.HOT, None, BatchKind.HOT]
    out = _run(stream, requests)
    source = Counter(r for b in ds for r in _rows(b))
    regrouped = Counter(r for _, b in out for r in _rows(b))
    assert regrouped == source
    kinds = Counter(k for k, _ in out)
    per_epoch = stream.batches_per_epoch()
    assert (
        kinds[BatchKind.HOT] == per_epoch[BatchKind.HOT] > 0
        and kinds[BatchKind.COLD] == per_epoch[BatchKind.COLD] > 0
    )
    assert len(out) == len(stream)
    for i, (kind, b) in enumerate(out):
        hot = Samples.of(b).hot(masks)
        if kind is BatchKind.HOT:
            assert bool(hot.all()) and b.labels.numel() == 32
        elif i < len(out) - 1:
            assert not bool(hot.any()) and b.labels.numel() == 32
    assert out[-1][0] is BatchKind.COLD or all(b.labels.numel() == 32 for _, b in out)


def test_contents_fixed_by_data_order_alone() -> None:
    ds = CriteoSyntheticDataset(_config())
    masks = _masks(ds)
    rng = random.Random(0)
    runs = []
    for requests in (
        [None],
        [BatchKind.HOT],
        [BatchKind.COLD],
        [rng.choice(list(BatchKind)) for _ in range(40)],
    ):
        out = _run(_stream(ds, masks), requests)
        runs.append({k: [_rows(b) for kk, b in out if kk is k] for k in BatchKind})
    assert all(r == runs[0] for r in runs[1:])
    again = _run(_stream(ds, masks), [BatchKind.HOT])
    assert [_rows(b) for _, b in again] == [_rows(b) for _, b in _run(_stream(ds, masks), [BatchKind.HOT])]


def test_window_bounds_reading_ahead() -> None:
    ds = CriteoSyntheticDataset(_config())
    masks = {f: torch.zeros(n, dtype=torch.bool) for f, n in ds.num_embeddings_per_feature().items()}
    masks = {f: m | (torch.arange(m.numel()) < 1) for f, m in masks.items()}  # nearly nothing hot
    reads = []

    def source() -> Iterator[Batch]:
        for i, b in enumerate(ds):
            reads.append(i)
            yield b

    stream = HotColdStream(source, masks, 32, window=3)
    stream.request(BatchKind.HOT)
    kind, _ = next(iter(stream))
    assert kind is BatchKind.COLD and len(reads) <= 3  # hot cannot complete within the window: cold is served


@pytest.mark.parametrize("stop", [1, 5, 9])
def test_resume_mid_epoch_equals_uninterrupted(stop: int) -> None:
    ds = CriteoSyntheticDataset(_config([2] + [1] * 25))
    masks = _masks(ds)
    requests = [BatchKind.COLD, BatchKind.HOT, BatchKind.HOT, BatchKind.COLD, None]
    full = _run(_stream(ds, masks), requests)
    first = _stream(ds, masks)
    head = _run(first, requests, stop=stop)
    state = first.state_dict()
    resumed = _stream(ds, masks)
    resumed.load_state_dict(state)
    tail = _run(resumed, requests)
    got = head + tail
    assert [k for k, _ in got] == [k for k, _ in full]
    assert [_rows(b) for _, b in got] == [_rows(b) for _, b in full]


def test_resume_errors() -> None:
    ds = CriteoSyntheticDataset(_config())
    masks = _masks(ds)
    s = _stream(ds, masks)
    with pytest.raises(
        CheckpointError, match="is not a hot/cold loader's .* written by a run without HotColdDataModule"
    ):
        s.load_state_dict({"batches_yielded": 3})
    s.load_state_dict({"hot_served": 10_000, "cold_served": 0})
    with pytest.raises(CheckpointError, match="fewer than"):
        next(iter(s))
    with pytest.raises(ConfigError, match="window"):
        HotColdStream(lambda: iter(ds), masks, 32, window=1)


def test_two_ranks_regroup_globally() -> None:
    """Each rank reads its slice; gathering the slices makes every rank regroup the global stream."""
    world = 2
    local = [CriteoSyntheticDataset(_config(world=world, rank=r, batch=16)) for r in range(world)]
    global_ds = CriteoSyntheticDataset(_config(batch=32))
    masks = _masks(global_ds)
    iters: List[Optional[Iterator[Batch]]] = [None] * world

    def gather_for(rank: int) -> Any:
        def gather(s: Samples) -> Samples:
            parts = []
            for r in range(world):
                parts.append(s if r == rank else Samples.of(next(iters[r])))  # type: ignore[arg-type]
            return Samples.cat(parts)

        return gather

    n = count_hot_samples(iter(global_ds), masks)
    requests = [BatchKind.HOT, BatchKind.COLD, BatchKind.COLD]
    expected = _run(HotColdStream(lambda: iter(global_ds), masks, 32, window=4, num_samples=n), requests)
    per_rank = []
    for rank in range(world):
        for r in range(world):
            iters[r] = iter(local[r])
        own = iters[rank]
        stream = HotColdStream(
            lambda own=own: own,  # type: ignore[misc]
            masks,
            16,
            window=4,
            num_samples=n,
            rank=rank,
            world_size=world,
            gather=gather_for(rank),
        )  # type: ignore[arg-type, return-value]
        per_rank.append(_run(stream, requests))
    assert [k for k, _ in per_rank[0]] == [k for k, _ in per_rank[1]] == [k for k, _ in expected]
    for j, (_, b) in enumerate(expected):
        assert _rows(per_rank[0][j][1]) + _rows(per_rank[1][j][1]) == _rows(b)


def test_last_cold_batch_is_served_once_the_source_is_read() -> None:
    """Asking for cold only: every cold batch, the leftover one included, comes before the hot batches left."""
    ds = CriteoSyntheticDataset(_config())
    masks = _masks(ds)
    stream = _stream(ds, masks, window=64)
    out = _run(stream, [BatchKind.COLD])
    per = stream.batches_per_epoch()
    assert [k for k, _ in out] == [BatchKind.COLD] * per[BatchKind.COLD] + [BatchKind.HOT] * per[
        BatchKind.HOT
    ]
    hot, total = stream.num_samples  # type: ignore[misc]
    assert out[per[BatchKind.COLD] - 1][1].labels.numel() == (total - hot) % 32 + hot % 32
