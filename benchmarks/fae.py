"""FAE hot embeddings: calibrator accuracy and speed, hot shares at a budget, accuracy of FAE's schedule.

1. Calibrator on Criteo-Kaggle-shaped synthetic tables (the 26 Kaggle table sizes times ``--scale``; 1.0 is
   the full 33.8 M rows): the Rand-Em Box's estimate of hot rows against the exact count of the sampled
   counts at several cutoffs (``estimate_max_rel_error``: largest relative error of the large tables' total;
   FAE reports within 10 %; measured on the counts of at least 8 sampled batches, also in ``--quick``; the same
   for FAE's fixed 35 chunks, ``fixed_box_estimate_max_rel_error``), and the time of the sampled calibration (5 %
   of the batches, Rand-Em Box; ``fixed_box_sampled_seconds`` with the fixed chunks) against a full count (every
   batch read, the same threshold search on exact counts): ``calibration_speedup`` (FAE: 19-55x from sampling
   inputs, 14.5-61x from the box).
2. Hot rows and the expected hot share of accesses and samples at a few budgets, and the shares measured on
   batches the calibrator never read (the held-out check of the leave-one-out estimates); the same on the real
   samples in ``../shared/data`` (Criteo Kaggle head, Taobao head) when present.
3. Accuracy (FAE's Table III) on the default job (``--train-batches``, default 300 batches of 2,048): final
   validation AUC of FAE's schedule (HotColdScheduler; configs/dlrm_fae.yaml's hot budget and calibration sample)
   against the original data order (``abs_auc_gap``), and "all cold, then all hot" (a fixed rate of 100) as the
   control. Every table resident.
4. Pinned hot rows in the lookahead cache (``--cache-batches``, default 300 batches of 2,048, ``--cache-epochs``
   1, ``--repeats`` 3 rounds in rotated order): resident, resident on FAE's batches, lookahead-only, lookahead-only
   with FAE's device rows, and FAE. Median step time and process CPU time per step
   (``fae_over_resident_step_time``, ``fae_over_resident_cpu_time``: medians of the rounds' ratios), rows fetched
   per sample per epoch (``fae_over_lookahead_rows_fetched``; ``..._last_epoch``; ``..._same_memory``) and the
   compulsory floor, the distinct rows an epoch reads (``compulsory_rows_per_sample``).
5. ``--recalibrate`` (a mode of its own): the Taobao head in time order (``configs/taobao_fae.yaml``'s data,
   tables and 4 MiB hot budget), regrouped for ``--epochs`` epochs with the calibrated hot set fixed and with
   ``recalibrate="epoch"``: per epoch the share of accesses and of samples that are hot under the hot set in
   force, the rows promoted and demoted. JSON ``fixed_hot_access_share``, ``recalibrated_hot_access_share``
   (epoch 2 on) and their sample shares.

    python benchmarks/fae.py [--quick] [--json PATH] [--scale 1.0] [--batches 160] [--train-batches 300]
    python benchmarks/fae.py --skip-calibration --train-batches 0 [--cache-batches 300] [--repeats 3]
    python benchmarks/fae.py --recalibrate [--quick] [--json PATH] [--epochs 3]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Collection, Dict, List, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._common import fae_settings, machine, parser, table, write_json  # noqa: E402
from benchmarks._fae_calibration import MIB, real, recalibration, synthetic  # noqa: E402
from torchrec_lookahead.data import CriteoSyntheticDataModule  # noqa: E402
from torchrec_lookahead.fae import HotColdDataModule  # noqa: E402


def default_model(inner: Any) -> Any:
    """The default job's DLRM (configs/dlrm_synthetic.yaml) for ``inner``'s tables."""
    from torchrec_lookahead.models import DLRMModule
    from torchrec_lookahead.optim import DenseOptimizerSpec, EmbeddingOptimizerSpec

    return DLRMModule(
        inner.num_embeddings_per_feature,
        inner.num_dense_features,
        embedding_dim=16,
        dense_arch_layer_sizes=[64, 16],
        over_arch_layer_sizes=[64, 32, 1],
        embedding_optimizer=EmbeddingOptimizerSpec("rowwise_adagrad", lr=0.05),
        dense_optimizer=DenseOptimizerSpec("adagrad", lr=0.05),
    )


def train(
    batches: int, batch_size: int, orders: tuple = ("original", "fae", "cold_then_hot")
) -> Dict[str, Any]:
    import lightning.pytorch as pl

    import torchrec_lookahead.strategies  # noqa: F401
    from torchrec_lookahead.callbacks import HotColdScheduler
    from torchrec_lookahead.fae import HotColdDataModule

    def run(kind: str) -> Dict[str, float]:
        pl.seed_everything(0, verbose=False)
        inner = CriteoSyntheticDataModule(
            batch_size=batch_size, num_train_batches=batches, num_val_batches=20
        )
        dm: pl.LightningDataModule = inner
        callbacks: List[pl.Callback] = []
        if kind != "original":
            dm = HotColdDataModule(inner, **fae_settings())
            callbacks.append(
                HotColdScheduler()
                if kind == "fae"
                else HotColdScheduler(initial_rate=100.0, monitor="fixed-rate")
            )
        model = default_model(inner)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            strategy="torchrec",
            max_epochs=1,
            val_check_interval=max(1, batches // 6),
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
        )
        t0 = time.perf_counter()
        trainer.fit(model, datamodule=dm)
        result = trainer.validate(model, dataloaders=inner.val_dataloader(), verbose=False)[0]
        return {"val_auc": float(result["val/auc"]), "val_logloss": float(result["val/logloss"]),
                "seconds": time.perf_counter() - t0}  # fmt: skip

    rows = {k: run(k) for k in orders}
    print(table([{"order": k, **v} for k, v in rows.items()]))
    if set(orders) != {"original", "fae", "cold_then_hot"}:
        return {"runs": rows}
    return {
        "runs": rows,
        "abs_auc_gap": abs(rows["fae"]["val_auc"] - rows["original"]["val_auc"]),
        "cold_then_hot_abs_auc_gap": abs(rows["cold_then_hot"]["val_auc"] - rows["original"]["val_auc"]),
    }


class _StepTimer:
    """Wall-clock and process CPU time at each training batch start (plan application and the step included),
    and the stores' rows fetched at each epoch end."""

    def __init__(self, fetched: Any) -> None:
        import lightning.pytorch as pl

        outer = self

        class _Callback(pl.Callback):
            def on_train_batch_start(self, *args: Any) -> None:
                outer.starts.append((time.perf_counter(), time.process_time()))

            def on_train_epoch_end(self, *args: Any) -> None:
                outer.fetched_at_epoch_end.append(fetched())

        self.starts: List[tuple] = []
        self.fetched_at_epoch_end: List[float] = []
        self.callback = _Callback()

    def median_ms(self, skip: int = 5) -> float:
        gaps = [b[0] - a[0] for a, b in zip(self.starts, self.starts[1:])][skip:]
        return 1e3 * float(statistics.median(gaps)) if gaps else float("nan")

    def cpu_ms(self, skip: int = 5) -> float:
        """Process CPU time per step (every thread: the training step, the planner and the stager)."""
        kept = self.starts[skip:]
        return 1e3 * (kept[-1][1] - kept[0][1]) / (len(kept) - 1) if len(kept) > 1 else float("nan")


def compulsory_rows_per_sample(inner: Any, tables: Collection[str]) -> float:
    """Distinct rows of ``tables`` an epoch reads, per sample: what any cache of those tables that starts empty
    fetches at least (the bundled models name feature ``f``'s table ``t_f``)."""
    inner.setup("fit")
    seen: Dict[str, List[torch.Tensor]] = {}
    samples = 0
    for batch in inner.train_dataloader():
        for key, jt in batch.sparse_features.to_dict().items():
            if f"t_{key}" in tables:
                seen.setdefault(key, []).append(jt.values())
        samples += batch.dense_features.shape[0]
    return sum(int(torch.unique(torch.cat(v)).numel()) for v in seen.values()) / max(samples, 1)


CACHE_RUNS = ("resident", "resident_hotcold", "lookahead", "lookahead_same_memory", "fae")


def cache_training(
    batches: int,
    batch_size: int,
    epochs: int = 1,
    repeats: int = 1,
    hot_budget_mib: Optional[float] = None,
    sample_fraction: Optional[float] = None,
) -> Dict[str, Any]:
    """The default job five ways in one process: resident, resident on FAE's hot/cold batches, lookahead-only
    cached (configs/dlrm_lookahead.yaml's slots), lookahead-only with as many slots per table as FAE holds, and
    FAE (pinned hot rows, hot/cold batches with the scheduler, lookahead for the cold rows: the same dynamic
    slots plus the pinned rows). ``repeats`` rounds, each running the five in a rotated order, so a change of
    load on the machine falls on every run alike; step-time ratios are the median of the rounds' ratios. Rows
    fetched from the stores per trained sample per epoch (the pin plan's rows in the first), against the
    compulsory floor (the distinct rows of the cached tables an epoch reads)."""
    import lightning.pytorch as pl
    import yaml

    import torchrec_lookahead.strategies  # noqa: F401
    from torchrec_lookahead.callbacks import HotColdScheduler
    from torchrec_lookahead.data import LookaheadDataModule
    from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
    from torchrec_lookahead.strategies import TorchRecStrategy

    cfg = yaml.safe_load((REPO / "configs" / "dlrm_lookahead.yaml").read_text())
    lookahead_capacity: Dict[str, int] = cfg["trainer"]["strategy"]["init_args"]["sharders"][0]["init_args"][
        "capacity"
    ]
    settings = fae_settings()  # configs/dlrm_fae.yaml's, unless given
    if hot_budget_mib is not None:
        settings["hot_budget_bytes"] = int(hot_budget_mib * MIB)
    if sample_fraction is not None:
        settings["sample_fraction"] = sample_fraction

    def source() -> CriteoSyntheticDataModule:
        return CriteoSyntheticDataModule(batch_size=batch_size, num_train_batches=batches, num_val_batches=2)

    calibrated = HotColdDataModule(source(), **settings, embedding_dim=16)
    calibrated.setup("fit")
    assert calibrated.hot_set is not None
    fae_capacity = {t: c + calibrated.hot_set.hot_rows[t] for t, c in lookahead_capacity.items()}

    def run(kind: str) -> Dict[str, Any]:
        pl.seed_everything(0, verbose=False)
        inner = source()
        dm: pl.LightningDataModule = inner
        callbacks: List[pl.Callback] = []
        capacity = dict(lookahead_capacity)
        if kind in ("resident_hotcold", "fae"):  # FAE's batches and scheduler
            dm = HotColdDataModule(inner, **settings, embedding_dim=16)
            callbacks.append(HotColdScheduler())
        if kind in ("fae", "lookahead_same_memory"):
            capacity = dict(fae_capacity)
        if kind in ("lookahead", "lookahead_same_memory", "fae"):
            dm = LookaheadDataModule(dm, horizon=64)
        cached = kind in ("lookahead", "lookahead_same_memory", "fae")
        sharders = [LookaheadEmbeddingBagCollectionSharder(capacity=capacity)] if cached else None
        model = default_model(inner)
        strategy = TorchRecStrategy(sharders=sharders)

        def fetched() -> float:
            return float(
                sum(s["rows_fetched"] for m in strategy.cached_modules() for s in m.cache.stats().values())
            )

        timer = _StepTimer(fetched)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            strategy=strategy,
            max_epochs=epochs,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[*callbacks, timer.callback],
        )
        trainer.fit(model, datamodule=dm)
        samples = trainer.global_step * batch_size
        ends = [0.0, *timer.fetched_at_epoch_end]
        per_epoch = [(b - a) / max(samples / epochs, 1) for a, b in zip(ends, ends[1:])]
        return {
            "median_step_ms": timer.median_ms(),
            "cpu_ms_per_step": timer.cpu_ms(),
            "rows_fetched_per_sample": ends[-1] / max(samples, 1),
            "rows_fetched_per_sample_by_epoch": per_epoch,
            "device_cache_rows": float(sum(capacity.values())) if sharders else float("nan"),
            "steps": float(trainer.global_step),
        }

    rounds: List[Dict[str, Dict[str, Any]]] = []
    for r in range(repeats):
        order = CACHE_RUNS[r % len(CACHE_RUNS) :] + CACHE_RUNS[: r % len(CACHE_RUNS)]
        rounds.append({k: run(k) for k in order})
    first = rounds[0]
    floor = compulsory_rows_per_sample(source(), lookahead_capacity)

    def ratio(num: str, den: str, key: str = "median_step_ms") -> float:
        return float(statistics.median(r[num][key] / r[den][key] for r in rounds))

    def fetched(kind: str, epoch: int) -> float:
        return first[kind]["rows_fetched_per_sample_by_epoch"][epoch]

    rows = [
        {
            "run": k,
            "median_step_ms": statistics.median(r[k]["median_step_ms"] for r in rounds),
            "cpu_ms_per_step": statistics.median(r[k]["cpu_ms_per_step"] for r in rounds),
            "rows_fetched_per_sample": first[k]["rows_fetched_per_sample"],
            **{f"fetched_epoch_{e + 1}": fetched(k, e) for e in range(epochs)},
            "device_cache_rows": first[k]["device_cache_rows"],
        }
        for k in CACHE_RUNS
    ]
    print(table(rows))
    print(f"compulsory floor (distinct rows of an epoch per sample): {floor:.3f}")
    last = epochs - 1
    return {
        "runs": {row["run"]: row for row in rows},
        "rounds": rounds,
        "compulsory_rows_per_sample": floor,
        "fae_over_resident_step_time": ratio("fae", "resident"),
        "lookahead_over_resident_step_time": ratio("lookahead", "resident"),
        # the cache's share alone: FAE against resident training of the same hot/cold batches
        "fae_over_resident_hotcold_step_time": ratio("fae", "resident_hotcold"),
        "fae_over_resident_cpu_time": ratio("fae", "resident", "cpu_ms_per_step"),
        "fae_over_lookahead_rows_fetched": first["fae"]["rows_fetched_per_sample"]
        / first["lookahead"]["rows_fetched_per_sample"],
        "floor_over_lookahead_rows_fetched": floor / fetched("lookahead", 0),
        "fae_over_lookahead_same_memory_rows_fetched": first["fae"]["rows_fetched_per_sample"]
        / first["lookahead_same_memory"]["rows_fetched_per_sample"],
        "fae_over_lookahead_rows_fetched_last_epoch": fetched("fae", last)
        / max(fetched("lookahead", last), 1e-12),
    }


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--scale", type=float, default=None, help="factor on the Kaggle table sizes (default 1.0)")
    p.add_argument("--batches", type=int, default=None, help="synthetic batches of 4,096 (default 160)")
    p.add_argument("--train-batches", type=int, default=None, help="training batches (default 300, 0 skips)")
    p.add_argument(
        "--cache-batches",
        type=int,
        default=None,
        help="batches of the pinned-rows comparison (default 300, 0 skips)",
    )
    p.add_argument("--cache-epochs", type=int, default=None, help="epochs of each cache run (default 1)")
    p.add_argument("--repeats", type=int, default=None, help="rounds of the cache runs (default 3, quick 1)")
    p.add_argument(
        "--hot-budget-mib",
        type=float,
        default=None,
        help="FAE's hot budget in the cache runs (default: dlrm_fae.yaml's)",
    )
    p.add_argument(
        "--sample-fraction",
        type=float,
        default=None,
        help="FAE's calibration sample in the cache runs (default: dlrm_fae.yaml's)",
    )
    p.add_argument("--skip-calibration", action="store_true", help="only the training comparisons")
    p.add_argument(
        "--recalibrate",
        action="store_true",
        help="only the hot shares per epoch on Taobao, fixed against recalibrate='epoch'",
    )
    p.add_argument("--epochs", type=int, default=None, help="epochs of --recalibrate (default 3, quick 2)")
    args = p.parse_args(argv)
    if args.recalibrate:
        print(machine())
        figures = recalibration(args.epochs or (2 if args.quick else 3), args.quick)
        headline = {k: v for k, v in (figures or {}).items() if k != "rows"}
        print(headline)
        write_json(args.json, {**headline, "details": figures, "quick": args.quick})
        return figures or {}
    scale = args.scale if args.scale is not None else (0.05 if args.quick else 1.0)
    batches = args.batches if args.batches is not None else (40 if args.quick else 160)
    train_batches = args.train_batches if args.train_batches is not None else (30 if args.quick else 300)
    if args.cache_batches is None:
        args.cache_batches = 30 if args.quick else 300
    print(machine())
    figures: Dict[str, Any] = {}
    if not args.skip_calibration:
        figures["synthetic"] = synthetic(
            scale, batches, 4096, [4.0, 16.0, 64.0] if not args.quick else [4.0, 8.0]
        )
        figures["real"] = real(args.quick)
    if train_batches:
        figures["training"] = train(train_batches, 2048 if not args.quick else 512)
    if args.cache_batches:
        figures["cache"] = cache_training(
            args.cache_batches,
            2048 if not args.quick else 512,
            epochs=args.cache_epochs or 1,
            repeats=args.repeats or (1 if args.quick else 3),
            hot_budget_mib=args.hot_budget_mib,
            sample_fraction=args.sample_fraction,
        )
    headline: Dict[str, Any] = {}
    if "synthetic" in figures:
        head = figures["synthetic"]
        headline["estimate_max_rel_error"] = head["estimate_max_rel_error"]
        headline["upper_max_rel_error"] = head["upper_max_rel_error"]
        headline["calibration_speedup"] = head["calibration_speedup"]
        headline["fixed_box_estimate_max_rel_error"] = head["fixed_box_estimate_max_rel_error"]
    if "cache" in figures:
        for key in (
            "fae_over_resident_step_time",
            "lookahead_over_resident_step_time",
            "fae_over_resident_hotcold_step_time",
            "fae_over_lookahead_rows_fetched",
            "fae_over_resident_cpu_time",
            "floor_over_lookahead_rows_fetched",
            "fae_over_lookahead_same_memory_rows_fetched",
            "fae_over_lookahead_rows_fetched_last_epoch",
            "compulsory_rows_per_sample",
        ):
            headline[key] = figures["cache"][key]
    if "training" in figures:
        headline["abs_auc_gap"] = figures["training"]["abs_auc_gap"]
        headline["cold_then_hot_abs_auc_gap"] = figures["training"]["cold_then_hot_abs_auc_gap"]
    print(headline)
    write_json(args.json, {**headline, "details": figures, "quick": args.quick})
    return figures


if __name__ == "__main__":
    main()
