import pytest
import torch

from torchrec_lookahead import ConfigError
from torchrec_lookahead.data import CriteoSyntheticDataModule, CriteoSyntheticDataset, SyntheticCriteoConfig
from torchrec_lookahead.data.criteo_spec import CRITEO_KAGGLE_CARDINALITIES, scaled_cardinalities

from ..conftest import TINY_TABLES


def _cfg(**kw):
    base = dict(batch_size=32, num_batches=4, num_embeddings=list(TINY_TABLES), seed=3)
    base.update(kw)
    return SyntheticCriteoConfig(**base)


def _same(a, b):
    return (
        torch.equal(a.dense_features, b.dense_features)
        and torch.equal(a.labels, b.labels)
        and torch.equal(a.sparse_features.values(), b.sparse_features.values())
        and torch.equal(a.sparse_features.lengths(), b.sparse_features.lengths())
    )


def test_shapes_and_ranges():
    ds = CriteoSyntheticDataset(_cfg())
    batches = list(ds)
    assert len(batches) == len(ds) == 4
    b = batches[0]
    assert b.dense_features.shape == (32, 13) and b.labels.shape == (32,)
    kjt = b.sparse_features
    assert kjt.keys() == [f"cat_{i}" for i in range(26)]
    for t, (name, jt) in enumerate(kjt.to_dict().items()):
        v = jt.values()
        assert v.dtype == torch.int64 and v.numel() == 32
        assert int(v.min()) >= 0 and int(v.max()) < TINY_TABLES[t], name
    assert set(b.labels.unique().tolist()) <= {0.0, 1.0}
    assert torch.isfinite(b.dense_features).all() and (b.dense_features >= 0).all()


def test_deterministic_by_seed_and_resumable_by_index():
    a = list(CriteoSyntheticDataset(_cfg()))
    b = list(CriteoSyntheticDataset(_cfg()))
    assert all(_same(x, y) for x, y in zip(a, b))
    c = list(CriteoSyntheticDataset(_cfg(seed=4)))
    assert not _same(a[0], c[0])
    ds = CriteoSyntheticDataset(_cfg(), start_batch=2)
    assert all(_same(x, y) for x, y in zip(list(ds), a[2:]))
    val = CriteoSyntheticDataset(_cfg(), split="val")
    assert not _same(next(iter(val)), a[0])


def test_rank_slices_partition_the_global_batch():
    one = CriteoSyntheticDataset(_cfg(batch_size=64)).batch(1)
    parts = [CriteoSyntheticDataset(_cfg(batch_size=32, world_size=2, rank=r)).batch(1) for r in range(2)]
    assert torch.equal(torch.cat([p.labels for p in parts]), one.labels)
    assert torch.equal(torch.cat([p.dense_features for p in parts]), one.dense_features)
    for name in one.sparse_features.keys():
        joined = torch.cat([p.sparse_features[name].values() for p in parts])
        assert torch.equal(joined, one.sparse_features[name].values())


def test_multi_hot_pooling_factors():
    ds = CriteoSyntheticDataset(_cfg(multi_hot="mlperf"))
    kjt = next(iter(ds)).sparse_features
    assert int(kjt["cat_20"].lengths()[0]) == 100
    assert int(kjt["cat_0"].lengths()[0]) == 3
    ds = CriteoSyntheticDataset(_cfg(multi_hot=2))
    assert next(iter(ds)).sparse_features.values().numel() == 32 * 26 * 2


def test_ids_are_skewed_and_scattered():
    cfg = _cfg(batch_size=4096, num_embeddings=[10_000] * 26, zipf_exponent=1.05)
    ids = CriteoSyntheticDataset(cfg).batch(0).sparse_features["cat_2"].values()
    counts = torch.bincount(ids, minlength=10_000).sort(descending=True).values
    top1pct = counts[:100].sum().item() / ids.numel()
    assert top1pct > 0.3  # Zipf ~1.05: the hottest 1% of rows take a large share of lookups
    hottest = torch.bincount(ids).argmax().item()
    assert hottest != 0  # hot ids are scattered over the table, not just the small ones


def test_scaled_cardinalities_and_errors():
    sizes = scaled_cardinalities(0.01, min_rows=1000)
    assert len(sizes) == 26 and sizes[5] == 24 and sizes[2] == 101313
    assert sum(CRITEO_KAGGLE_CARDINALITIES) == 33_762_577
    with pytest.raises(ConfigError, match="scale"):
        scaled_cardinalities(0.0)
    # the DataModule refuses it when it is built, not when its tables are first sized
    with pytest.raises(ConfigError, match=r"Expected scale in \(0, 1\] but got 0"):
        CriteoSyntheticDataModule(scale=0)
    with pytest.raises(ConfigError, match="positive"):
        _cfg(num_embeddings=[0] + TINY_TABLES[1:])
    with pytest.raises(ConfigError, match="26"):
        _cfg(num_embeddings=[5, 5])
    with pytest.raises(ConfigError, match="multi_hot"):
        _cfg(multi_hot="many")
    with pytest.raises(ConfigError, match="batch_size"):
        _cfg(batch_size=0)


def test_datamodule_loaders_and_feature_sizes():
    dm = CriteoSyntheticDataModule(
        batch_size=16, num_train_batches=3, num_val_batches=2, num_embeddings=TINY_TABLES
    )
    dm.setup("fit")
    assert list(dm.num_embeddings_per_feature.values()) == TINY_TABLES
    assert len(dm.train_dataloader()) == 3 and len(list(dm.val_dataloader())) == 2


def _reference_batch(ds: CriteoSyntheticDataset, index: int):
    """Global batch ``index`` as the stream defines it, table by table (the generator's first form): the
    generator computes the ids of every table together, and must give these bits."""
    import math

    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_lookahead.data.synthetic import _SPLIT_SALT, INT_FEATURE_COUNT, hidden_row_weight

    cfg = ds.config
    g = torch.Generator().manual_seed(cfg.seed * 1_000_000_007 + _SPLIT_SALT[ds.split] + index * 7_368_787)
    rows = ds.global_batch_size()
    counts = torch.rand(rows, INT_FEATURE_COUNT, generator=g).mul_(-1).log1p_().mul_(-8.0)
    dense = torch.log1p(counts.floor_())
    logit = torch.full((rows,), -1.4)
    logit += (dense - 1.0) @ ds._dense_w
    per_table = []
    for t, pool in enumerate(ds._pool):
        n, s = ds._sizes[t], cfg.zipf_exponent
        u = torch.rand(rows * pool, generator=g, dtype=torch.float64)
        if abs(s - 1.0) < 1e-9:
            x = torch.exp(u * math.log(n + 1.0))
        else:
            x = (1.0 + u * ((n + 1.0) ** (1.0 - s) - 1.0)) ** (1.0 / (1.0 - s))
        rank = (x.floor().to(torch.int64) - 1).clamp_(0, n - 1)
        ids = (rank * ds._mult[t] + (cfg.seed * 104729 + t * 1299709) % n) % n
        per_table.append(ids.view(rows, pool))
        w = hidden_row_weight(ids, t, cfg.seed).view(rows, pool).mean(dim=1)
        logit += 2.2 * ds._table_w[t] * w / math.sqrt(len(ds._pool))
    labels = torch.bernoulli(torch.sigmoid(logit), generator=g)
    lo, hi = cfg.rank * cfg.batch_size, (cfg.rank + 1) * cfg.batch_size
    values = torch.cat([ids[lo:hi].reshape(-1) for ids in per_table])
    lengths = torch.cat([torch.full((cfg.batch_size,), pool, dtype=torch.int32) for pool in ds._pool])
    kjt = KeyedJaggedTensor(keys=list(cfg.feature_names), values=values, lengths=lengths)
    return Batch(dense_features=dense[lo:hi], sparse_features=kjt, labels=labels[lo:hi])


@pytest.mark.parametrize(
    "kw",
    [
        dict(batch_size=2048, num_batches=300, scale=0.01, min_rows=1000, seed=0),  # the default job's stream
        dict(batch_size=1024, num_batches=300, scale=0.01, min_rows=1000, world_size=2, rank=1),
        dict(batch_size=37, num_batches=9, scale=0.0001, min_rows=2, multi_hot="mlperf", zipf_exponent=1.0),
        dict(batch_size=13, num_batches=9, num_embeddings=[5] * 26, multi_hot=3, zipf_exponent=0.0, seed=4),
    ],
)
def test_every_table_at_once_gives_the_bits_of_the_table_by_table_stream(kw):
    for split in ("train", "val"):
        ds = CriteoSyntheticDataset(SyntheticCriteoConfig(**kw), split=split)
        for i in (0, 1, kw["num_batches"] - 1):
            assert _same(ds.batch(i), _reference_batch(ds, i)), (kw, split, i)
