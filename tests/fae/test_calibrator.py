"""The calibrator against naive references: exact counts, the Rand-Em Box on tables with known answers, the
statistical optimizer's choice, save/load, and every bad input."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Dict, List

import pytest
import torch
from torchrec import KeyedJaggedTensor
from torchrec.datasets.utils import Batch

from torchrec_lookahead.data import CriteoSyntheticDataset, SyntheticCriteoConfig
from torchrec_lookahead.errors import CheckpointError, ConfigError, DataError, InvalidIdError
from torchrec_lookahead.fae import (
    CalibrationConfig,
    HotSet,
    RandEmBox,
    SampledAccesses,
    calibrate,
    calibrate_counts,
    exact_hot_rows,
    sample_batches,
)
from torchrec_lookahead.fae._stats import student_t_quantile

SIZES = [3000, 20, 500, 7, 2, 9, 40, 11, 5, 3, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2]


def _dataset(multi_hot: Any = None, num_batches: int = 40) -> CriteoSyntheticDataset:
    return CriteoSyntheticDataset(
        SyntheticCriteoConfig(
            batch_size=64, num_batches=num_batches, num_embeddings=SIZES, multi_hot=multi_hot
        )
    )


def _cfg(**kw: Any) -> CalibrationConfig:
    base: Dict[str, Any] = dict(
        hot_budget_bytes=40_000,
        sample_fraction=0.5,
        num_chunks=4,
        chunk_rows=64,
        small_table_bytes=1024,
        embedding_dim=8,
    )
    base.update(kw)
    return CalibrationConfig(**base)


class _CountingDataset:
    """Random access only: iteration fails, so calibration must not read unsampled batches."""

    def __init__(self, ds: CriteoSyntheticDataset) -> None:
        self.ds, self.read = ds, []  # type: ignore[var-annotated]

    def __len__(self) -> int:
        return len(self.ds)

    def batch(self, i: int) -> Batch:
        self.read.append(i)
        return self.ds.batch(i)

    def __iter__(self) -> Any:
        raise AssertionError("the calibrator iterated a random-access dataset")


def test_t_quantiles_match_tables() -> None:
    assert student_t_quantile(0.999, 35) == pytest.approx(3.340, abs=5e-4)  # FAE's constant
    assert student_t_quantile(0.975, 5) == pytest.approx(2.5706, abs=1e-4)
    assert student_t_quantile(0.9995, 34) == pytest.approx(3.6007, abs=1e-4)


def test_sample_reads_only_drawn_batches() -> None:
    ds = _CountingDataset(_dataset())
    batches, total = sample_batches(ds, 0.1, seed=3)
    assert total == 40 and len(batches) == 4 and len(ds.read) == 4 and ds.read == sorted(set(ds.read))
    again = _CountingDataset(_dataset())
    sample_batches(again, 0.1, seed=3)
    assert again.read == ds.read
    other = _CountingDataset(_dataset())
    sample_batches(other, 0.1, seed=4)
    assert other.read != ds.read


@pytest.mark.parametrize("multi_hot", [None, 3])
def test_counts_equal_naive_count(multi_hot: Any) -> None:
    ds = _dataset(multi_hot)
    batches, _ = sample_batches(ds, 0.25, seed=0)
    sampled = SampledAccesses.collect(batches, ds.num_embeddings_per_feature())
    for f, n in ds.num_embeddings_per_feature().items():
        naive: Counter = Counter()
        for b in batches:
            naive.update(b.sparse_features[f].values().tolist())
        assert sampled.counts[f].tolist() == [naive.get(i, 0) for i in range(n)]
        assert sampled.accesses(f) == sum(naive.values())
    assert sampled.num_samples == sum(b.labels.numel() for b in batches)


def _naive_interval(counts: torch.Tensor, picks: List[int], m: int, cutoff: float, conf: float) -> tuple:
    y = [sum(1 for k in counts[p * m : (p + 1) * m].tolist() if k >= cutoff) for p in picks]
    n, blocks = len(y), counts.numel() // m
    mean = sum(y) / n
    s2 = sum((v - mean) ** 2 for v in y) / (n - 1)
    half = student_t_quantile(1 - (1 - conf) / 2, n - 1) * math.sqrt((blocks - n) / blocks * s2 / n)
    scale = counts.numel() / m
    return mean * scale, (mean - half) * scale, (mean + half) * scale


def test_rand_em_box_known_answer() -> None:
    n_rows, m = 1_048_576, 1024
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(n_rows, dtype=torch.int64)
    hot = torch.rand(n_rows, generator=g) < 0.07  # ~73,400 rows with 9 accesses, the rest with 1
    counts[hot] = 9
    counts[~hot] = 1
    truth = int(hot.sum())
    box = RandEmBox(counts, 35, m, 0.999, torch.Generator().manual_seed(5))
    est = box.estimate(5)
    assert est.lower <= truth <= est.upper and not est.exact
    assert abs(est.estimate - truth) / truth < 0.1  # FAE: within 10 %
    picks = torch.randperm(n_rows // m, generator=torch.Generator().manual_seed(5))[:35].tolist()
    point, lower, upper = _naive_interval(counts, picks, m, 5, 0.999)
    assert est.estimate == pytest.approx(point) and est.upper == math.ceil(upper - 1e-9)
    assert est.lower == max(0, math.floor(lower + 1e-9))
    assert box.estimate(1).upper == n_rows and box.estimate(10).upper == 0


def test_rand_em_box_small_table_is_exact() -> None:
    counts = torch.arange(5000) % 7
    box = RandEmBox(counts, 35, 1024, 0.999, torch.Generator().manual_seed(0))
    for c in (0, 1, 3, 6, 7):
        e = box.estimate(c)
        assert e.exact and e.upper == e.lower == exact_hot_rows(counts, c)


def _rare_hot_rows(n_rows: int = 2_000_000, hot: int = 1000) -> torch.Tensor:
    """Counts of a large table where few rows are hot: 30,000 rows seen once, ``hot`` rows seen 20 times, at
    random places."""
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(n_rows, dtype=torch.int64)
    counts[torch.randperm(n_rows, generator=g)[:30_000]] = 1
    counts[torch.randperm(n_rows, generator=g)[:hot]] = 20
    return counts


def test_rand_em_box_grows_where_hot_rows_are_rare() -> None:
    """1,000 hot rows in 1,953 chunks: FAE's 35 chunks see about 18 of them and miss the count by a third; the box
    grown along the same block order (the calibrator's defaults) is within 10 %, and its first 35 chunks are
    FAE's."""
    counts = _rare_hot_rows()
    truth = exact_hot_rows(counts, 20)
    cfg = CalibrationConfig(hot_budget_bytes=1)
    fixed = RandEmBox(counts, 35, 1024, 0.999, torch.Generator().manual_seed(1))
    grown = RandEmBox(
        counts, 35, 1024, 0.999, torch.Generator().manual_seed(1), cfg.box_tolerance, cfg.box_max_share
    )
    f, e = fixed.estimate(20), grown.estimate(20)
    assert abs(f.estimate - truth) / truth > 0.3 and f.chunks == 35  # the control: FAE's box is far off
    assert abs(e.estimate - truth) / truth < 0.1 and e.lower <= truth <= e.upper
    assert e.chunks == math.ceil(0.25 * (counts.numel() // 1024))  # grew to the cap: 25 % of the chunks
    assert torch.equal(grown.chunk_hits(20, 35), fixed.chunk_hits(20))
    # where the hot rows are many, the first chunks are enough: no growth
    assert grown.estimate(1).chunks < e.chunks
    # an estimate depends on its cutoff only, not on which estimates came first
    again = RandEmBox(counts, 35, 1024, 0.999, torch.Generator().manual_seed(1), 0.1, 0.25)
    assert again.estimate(20) == e and again.estimate(1) == grown.estimate(1)


def test_rand_em_box_grown_over_every_chunk_counts_exactly() -> None:
    counts = _rare_hot_rows(100_000, 50)  # 97 whole chunks and 672 rows past them
    box = RandEmBox(counts, 35, 1024, 0.999, torch.Generator().manual_seed(3), 1e-9, 1.0)
    assert box.estimate(0).upper == counts.numel()  # every chunk alike: no growth needed
    for c in (1, 20, 21):
        e = box.estimate(c)
        assert e.exact and e.chunks == 97 and e.lower == e.upper == exact_hot_rows(counts, c)


def test_bad_box_growth_settings() -> None:
    assert _cfg(box_tolerance=None).box_tolerance is None
    for bad in (0, -0.1, True, "0.1"):
        with pytest.raises(ConfigError, match="box_tolerance"):
            _cfg(box_tolerance=bad)
    for bad in (0, 1.5, -1, True, None):
        with pytest.raises(ConfigError, match="box_max_share"):
            _cfg(box_max_share=bad)


def test_calibrate_fits_budget_and_marks_exactly() -> None:
    ds = _dataset()
    cfg = _cfg(
        hot_budget_bytes=25_000, num_chunks=64
    )  # chunks cover every table: the box counts exactly, so minimality is exact
    hs = calibrate(ds, ds.num_embeddings_per_feature(), cfg)
    assert all(t.estimated_hot_rows == t.hot_rows for t in hs.tables.values())
    batches, _ = sample_batches(ds, cfg.sample_fraction, cfg.seed)
    sampled = SampledAccesses.collect(batches, ds.num_embeddings_per_feature())
    assert hs.hot_bytes <= cfg.hot_budget_bytes
    for t in hs.tables.values():
        counts = sampled.counts[t.feature]
        if t.small:
            assert t.hot_ids.tolist() == list(range(t.num_embeddings))
            assert t.num_embeddings * cfg.weight_bytes < cfg.small_table_bytes
        else:
            assert t.cutoff == math.ceil(hs.threshold * sampled.accesses(t.feature))
            assert t.hot_ids.tolist() == [i for i, k in enumerate(counts.tolist()) if k >= t.cutoff]
    # The threshold is the smallest that fits: a slightly smaller one does not.
    rows_below = sum(
        exact_hot_rows(
            sampled.counts[t.feature], math.ceil(0.97 * hs.threshold * sampled.accesses(t.feature))
        )
        for t in hs.tables.values()
        if not t.small
    )
    small_bytes = sum(t.hot_bytes for t in hs.tables.values() if t.small)
    assert small_bytes + rows_below * cfg.row_bytes > cfg.hot_budget_bytes
    assert 0.0 < hs.hot_sample_share < 1.0 and 0.5 < hs.hot_access_share < 1.0
    # A larger budget holds at least as many rows.
    assert any(not t.small and t.cutoff > 1 for t in hs.tables.values())
    bigger = calibrate(ds, ds.num_embeddings_per_feature(), _cfg(hot_budget_bytes=80_000, num_chunks=64))
    assert bigger.threshold <= hs.threshold and sum(bigger.hot_rows.values()) >= sum(hs.hot_rows.values())


def test_shares_are_leave_one_out() -> None:
    ds = _dataset(num_batches=8)
    batches, _ = sample_batches(ds, 1.0, 0)
    sampled = SampledAccesses.collect(batches, ds.num_embeddings_per_feature())
    hs = calibrate_counts(sampled, _cfg(hot_budget_bytes=10**9))
    hot_acc = 0
    for t in hs.tables.values():
        c = sampled.counts[t.feature]
        hot_acc += int(c.sum()) if t.small else int(c[c - 1 >= t.cutoff].sum())
    assert hs.hot_access_share == pytest.approx(hot_acc / sum(sampled.accesses(f) for f in sampled.counts))


def test_save_load_round_trip(tmp_path: Any) -> None:
    ds = _dataset()
    hs = calibrate(ds, ds.num_embeddings_per_feature(), _cfg())
    path = str(tmp_path / "hot.pt")
    hs.save(path)
    raw = torch.load(path, weights_only=True)
    assert set(raw["hot_ids"]) == set(hs.tables)
    for name, ids in raw["hot_ids"].items():
        assert ids.dtype == torch.int64 and torch.equal(ids, hs.tables[name].hot_ids)
        assert bool((ids[1:] > ids[:-1]).all())
    back = HotSet.load(path)
    assert back.summary() == hs.summary()
    back.check_model(ds.num_embeddings_per_feature())
    assert "--- FAE hot set ---" in back.report() and "t_cat_0" in back.report()


def test_bad_budgets_and_fractions() -> None:
    for bad in (0, -5):
        with pytest.raises(ConfigError, match="hot_budget_bytes"):
            _cfg(hot_budget_bytes=bad)
    for frac in (0.0, -0.1, 1.5):
        with pytest.raises(ConfigError, match="sample_fraction"):
            _cfg(sample_fraction=frac)
    ds = _dataset()
    with pytest.raises(ConfigError, match="small tables"):
        calibrate(ds, ds.num_embeddings_per_feature(), _cfg(hot_budget_bytes=100))
    with pytest.raises(ConfigError, match="optimizer"):
        _cfg(optimizer="lamb")
    for key, bad in (("num_chunks", 2.5), ("num_chunks", 1), ("chunk_rows", 1.5), ("chunk_rows", 0)):
        with pytest.raises(ConfigError, match=key):
            _cfg(**{key: bad})


def test_empty_dataset_and_bad_ids() -> None:
    with pytest.raises(DataError, match="empty"):
        calibrate(_dataset(num_batches=0), dict(zip(_dataset().num_embeddings_per_feature(), SIZES)), _cfg())
    with pytest.raises(DataError, match="empty"):
        calibrate([], {"a": 4}, _cfg())
    kjt = KeyedJaggedTensor(keys=["a"], values=torch.tensor([1, 9]), lengths=torch.tensor([1, 1]))
    b = Batch(dense_features=torch.zeros(2, 1), sparse_features=kjt, labels=torch.zeros(2))
    with pytest.raises(InvalidIdError, match="id 9") as info:
        calibrate([b], {"a": 4}, _cfg(sample_fraction=1.0))
    assert info.value.facts == {"table": None, "batch": None, "id": 9, "num_rows": 4}
    with pytest.raises(ConfigError, match="features"):
        calibrate([b], {"b": 4}, _cfg(sample_fraction=1.0))


def test_bad_hot_set_files(tmp_path: Any) -> None:
    ds = _dataset()
    hs = calibrate(ds, ds.num_embeddings_per_feature(), _cfg())
    with pytest.raises(ConfigError, match="rows"):
        hs.check_model({**ds.num_embeddings_per_feature(), "cat_0": 3001})
    with pytest.raises(ConfigError, match="features"):
        hs.check_model({"x": 3})
    with pytest.raises(CheckpointError, match="not found"):
        HotSet.load(str(tmp_path / "missing.pt"))
    torch.save({"a": 1}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a hot set"):
        HotSet.load(str(tmp_path / "other.pt"))
    path = str(tmp_path / "hot.pt")
    hs.save(path)
    raw = torch.load(path, weights_only=True)
    raw["hot_ids"]["t_cat_0"] = torch.tensor([5, 3000], dtype=torch.int64)
    torch.save(raw, path)
    with pytest.raises(InvalidIdError, match="3000") as info:
        HotSet.load(path)
    assert info.value.facts == {"table": "t_cat_0", "batch": None, "id": 3000, "num_rows": 3000}


def test_exact_pass_raises_a_threshold_the_box_underestimated() -> None:
    """Rare heavy rows all in one chunk the box did not draw: the bound says 0 rows, the exact pass sees 100."""
    n, m = 70_000, 1024
    cfg = CalibrationConfig(hot_budget_bytes=50 * 36, embedding_dim=8, small_table_bytes=1024)
    picks = set(torch.randperm(n // m, generator=torch.Generator().manual_seed(cfg.seed + 1))[:35].tolist())
    block = next(b for b in range(n // m) if b not in picks)
    counts = torch.ones(n, dtype=torch.int64)
    counts[block * m : block * m + 100] = 50
    values = torch.repeat_interleave(torch.arange(n), counts)
    sampled = SampledAccesses(
        num_embeddings={"a": n},
        counts={"a": counts},
        values={"a": [values]},
        lengths={"a": [torch.ones(values.numel(), dtype=torch.int64)]},
        num_samples=values.numel(),
        batches_read=1,
    )
    assert RandEmBox(counts, 35, m, 0.999, torch.Generator().manual_seed(cfg.seed + 1)).estimate(2).upper == 0
    hs = calibrate_counts(sampled, cfg)
    assert hs.hot_bytes <= cfg.hot_budget_bytes
    assert hs.tables["t_a"].hot_rows == 0 and hs.tables["t_a"].cutoff == 51
