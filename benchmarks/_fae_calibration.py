"""FAE's calibration figures (``fae.py``): the hot rows' measured shares of the accesses, the Rand-Em Box's accuracy
against exact counts, on synthetic and real data, and recalibration between epochs."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import torch

from benchmarks._common import table
from torchrec_lookahead.data import (
    CriteoSyntheticDataset,
    CriteoTSVDataModule,
    SyntheticCriteoConfig,
    TaobaoDataModule,
)
from torchrec_lookahead.fae import (
    BatchKind,
    CalibrationConfig,
    HotColdDataModule,
    HotSet,
    SampledAccesses,
    Samples,
    calibrate,
    calibrate_counts,
    calibration_source,
    exact_hot_rows,
    sample_batches,
)
from torchrec_lookahead.fae.calibrator import rand_em_boxes

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
MIB = 1 << 20
# The Rand-Em Box's accuracy is measured on the counts of at least this many sampled batches (of 4,096): the full
# run's 5 % of 160. A smaller sample (--quick's 5 % of 40 is two batches) leaves a couple of hundred rows at the
# high cutoffs, where the exact count itself is mostly noise and one row more or less moves the error by 0.5 %.
ACCURACY_BATCHES = 8


def measured_shares(hot: HotSet, batches: List[Any]) -> Dict[str, float]:
    """Share of accesses and of samples that are hot in ``batches`` (data the calibrator did not read)."""
    masks = hot.masks()
    hot_acc = acc = hot_samples = samples = 0
    for b in batches:
        s = Samples.of(b)
        for i, k in enumerate(s.keys):
            hot_acc += int(masks[k][s.values[i]].sum())
            acc += int(s.values[i].numel())
        hot_samples += int(s.hot(masks).sum())
        samples += len(s)
    return {
        "measured_access_share": hot_acc / max(acc, 1),
        "measured_sample_share": hot_samples / max(samples, 1),
    }


def full_count(source: Any, sizes: Mapping[str, int], config: CalibrationConfig) -> float:
    """Seconds of the naive calibrator: every batch read and counted, the same threshold search on exact
    counts (chunks covering every table, so the box counts exactly)."""
    t0 = time.perf_counter()
    n = len(source)
    sampled = SampledAccesses.collect((source.batch(i) for i in range(n)), sizes, batches_total=n)
    exact = CalibrationConfig(**{**config.__dict__, "num_chunks": 1 << 40})
    calibrate_counts(sampled, exact, started=t0)
    return time.perf_counter() - t0


def box_accuracy(
    sampled: SampledAccesses, config: CalibrationConfig, cutoffs: List[int]
) -> List[Dict[str, Any]]:
    """Rand-Em Box against the exact count, over the large tables, at each cutoff."""
    large = [
        f for f, n in sampled.num_embeddings.items() if n * config.weight_bytes >= config.small_table_bytes
    ]
    boxes = rand_em_boxes(sampled, config, large)
    rows = []
    for c in cutoffs:
        exact = sum(exact_hot_rows(sampled.counts[f], c) for f in large)
        est = [boxes[f].estimate(c) for f in large]
        point, upper = sum(e.estimate for e in est), sum(e.upper for e in est)
        per_table = [
            abs(e.estimate - x) / x
            for e, x in ((boxes[f].estimate(c), exact_hot_rows(sampled.counts[f], c)) for f in large)
            if x >= 1000
        ]
        covered = sum(e.upper >= exact_hot_rows(sampled.counts[f], c) for e, f in zip(est, large))
        rows.append(
            {
                "cutoff": c,
                "exact_rows": exact,
                "estimate": round(point),
                "upper": upper,
                "rel_error": abs(point - exact) / max(exact, 1),
                "upper_rel_error": (upper - exact) / max(exact, 1),
                "max_table_rel_error": max(per_table) if per_table else 0.0,
                "upper_covers": f"{covered}/{len(large)}",
            }
        )
    return rows


def synthetic(scale: float, batches: int, batch_size: int, budgets_mib: List[float]) -> Dict[str, Any]:
    cfg = SyntheticCriteoConfig(batch_size=batch_size, num_batches=batches, scale=scale, min_rows=1000)
    ds = CriteoSyntheticDataset(cfg)
    sizes = ds.num_embeddings_per_feature()
    print(
        f"\n== synthetic Criteo-Kaggle-shaped: {sum(sizes.values()):,} rows, {batches} batches of {batch_size}"
    )
    config = CalibrationConfig(hot_budget_bytes=int(budgets_mib[0] * MIB))
    t0 = time.perf_counter()
    hs = calibrate(ds, sizes, config)
    sampled_s = time.perf_counter() - t0
    fixed = replace(config, box_tolerance=None)  # FAE's box: 35 chunks whatever the interval
    t0 = time.perf_counter()
    calibrate(ds, sizes, fixed)
    fixed_s = time.perf_counter() - t0
    full_s = full_count(ds, sizes, config)
    print(
        f"sampled calibration {sampled_s:.2f} s (with FAE's fixed 35 chunks {fixed_s:.2f} s), full count "
        f"{full_s:.2f} s: {full_s / sampled_s:.1f}x"
    )
    fraction = min(1.0, max(config.sample_fraction, ACCURACY_BATCHES / batches))
    drawn, _ = sample_batches(ds, fraction, config.seed)
    sampled = SampledAccesses.collect(drawn, sizes)
    print(f"Rand-Em Box against the exact count, on the counts of {sampled.num_samples:,} sampled samples")
    acc = box_accuracy(sampled, config, [1, 2, 3, 5, 8, 16])
    print(table(acc))
    fixed_acc = box_accuracy(sampled, fixed, [1, 2, 3, 5, 8, 16])
    print(f"FAE's fixed 35 chunks: largest relative error {max(r['rel_error'] for r in fixed_acc):.4g}")
    picked = {i for i in range(batches)} - set(_drawn_indices(batches, config))
    held_out = [ds.batch(i) for i in sorted(picked)[: max(4, batches // 10)]]
    shares = []
    for mib in budgets_mib:
        h = (
            hs
            if mib == budgets_mib[0]
            else calibrate(ds, sizes, CalibrationConfig(hot_budget_bytes=int(mib * MIB)))
        )
        shares.append(_share_row(f"{mib:g} MiB", h, held_out))
    print(table(shares))
    return {
        "rows": sum(sizes.values()),
        "sampled_seconds": sampled_s,
        "full_count_seconds": full_s,
        "calibration_speedup": full_s / sampled_s,
        "fixed_box_sampled_seconds": fixed_s,
        "fixed_box_estimate_max_rel_error": max(r["rel_error"] for r in fixed_acc),
        "estimate_max_rel_error": max(r["rel_error"] for r in acc),
        "accuracy_sampled_samples": sampled.num_samples,
        "upper_max_rel_error": max(r["upper_rel_error"] for r in acc),
        "box": acc,
        "budgets": shares,
    }


def _drawn_indices(total: int, config: CalibrationConfig) -> List[int]:
    from torchrec_lookahead.fae.sampling import _draw

    return _draw(total, config.sample_fraction, config.seed)


def _share_row(name: str, h: HotSet, held_out: List[Any]) -> Dict[str, Any]:
    return {
        "budget": name,
        "hot_rows": sum(h.hot_rows.values()),
        "hot_MiB": h.hot_bytes / MIB,
        "threshold": h.threshold,
        "expected_access_share": h.hot_access_share,
        "expected_sample_share": h.hot_sample_share,
        **measured_shares(h, held_out),
        "seconds": h.seconds,
    }


def real(quick: bool) -> List[Dict[str, Any]]:
    if not DATA.exists():
        print(f"skipping real data: {DATA} is absent")
        return []
    out = []
    jobs = []
    criteo = DATA / "criteo_kaggle_head" / "head8000_split_train.txt"
    if criteo.exists():
        jobs.append(
            ("criteo head (26 tables of 100k rows)", CriteoTSVDataModule(str(criteo), batch_size=128), 2.0)
        )
    taobao = DATA / "taobao_userbehavior_head" / "UserBehavior_head.csv"
    if taobao.exists():
        jobs.append(("taobao head (user,item,category)", TaobaoDataModule(str(taobao), batch_size=256), 4.0))
    for name, dm, mib in jobs:
        ds = calibration_source(dm)
        batches = list(ds)
        config = CalibrationConfig(
            hot_budget_bytes=int(mib * MIB), sample_fraction=0.5, small_table_bytes=64 * 1024
        )
        h = calibrate(batches, dm.num_embeddings_per_feature, config)
        drawn = set(_drawn_indices(len(batches), config))
        held_out = [b for i, b in enumerate(batches) if i not in drawn]
        out.append({"data": name, **_share_row(f"{mib:g} MiB", h, held_out)})
    print(table(out))
    return out


def recalibration(epochs: int, quick: bool) -> Optional[Dict[str, Any]]:
    """Hot shares per epoch on the Taobao head in time order, the hot set fixed or recalibrated every epoch."""
    taobao = DATA / "taobao_userbehavior_head" / "UserBehavior_head.csv"
    if not taobao.exists():
        print(f"skipping the recalibration figures: {taobao} is absent")
        return None
    rows: List[Dict[str, Any]] = []
    for mode in (None, "epoch"):
        inner = TaobaoDataModule(
            str(taobao), num_embeddings=[1048576, 5242880, 16384], batch_size=256 if quick else 1024
        )
        dm = HotColdDataModule(
            inner,
            hot_budget_bytes=(1 if quick else 4) * MIB,
            sample_fraction=0.05,
            window=16,
            embedding_dim=16,
            optimizer="rowwise_adagrad",
            recalibrate=mode,
        )
        dm.setup("fit")
        for epoch in range(1, epochs + 1):
            t0 = time.perf_counter()
            loader = dm.train_dataloader()
            hs = dm.hot_set
            assert hs is not None
            masks = hs.masks()
            hot_acc = acc = hot_samples = samples = 0
            for kind, batch in loader.kinds():
                n = int(batch.labels.numel())
                samples += n
                hot_samples += n if kind is BatchKind.HOT else 0
                for f, jt in batch.sparse_features.to_dict().items():
                    v = jt.values().to(torch.int64)
                    acc += v.numel()
                    hot_acc += int(masks[f][v].sum())
            moved = dm.recalibrations[epoch - 2] if mode and epoch > 1 else {}
            rows.append(
                {
                    "hot_set": "recalibrated" if mode else "fixed",
                    "epoch": epoch,
                    "hot_rows": sum(hs.hot_rows.values()),
                    "hot_MiB": hs.hot_bytes / MIB,
                    "promoted": moved.get("promoted", 0),
                    "demoted": moved.get("demoted", 0),
                    "hot_access_share": hot_acc / max(acc, 1),
                    "hot_sample_share": hot_samples / max(samples, 1),
                    "seconds": time.perf_counter() - t0,
                }
            )
    print(table(rows))
    later = [r for r in rows if r["epoch"] >= 2]

    def mean(kind: str, key: str) -> float:
        return statistics.fmean(r[key] for r in later if r["hot_set"] == kind)

    return {
        "rows": rows,
        "fixed_hot_access_share": mean("fixed", "hot_access_share"),
        "recalibrated_hot_access_share": mean("recalibrated", "hot_access_share"),
        "fixed_hot_sample_share": mean("fixed", "hot_sample_share"),
        "recalibrated_hot_sample_share": mean("recalibrated", "hot_sample_share"),
    }
