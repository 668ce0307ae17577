"""Loss/AUC gap of the cDLRM mode to exact (LRPP) training on 2 gloo ranks, on the default cached job.

The default cached job (``configs/dlrm_lookahead.yaml``: DLRM, 26 Criteo-shaped synthetic tables, the five
large ones cached, row-wise Adagrad embeddings, Adagrad dense, 300 training batches, validation every 100
steps on 20 batches) is launched with torchrun on 2 gloo ranks (``python -m torch.distributed.run
--nproc_per_node=2 -m torchrec_lookahead fit``), adapted as follows and identically in every run:

* ``--trainer.devices=2``, and ``batch_size`` halved per rank, so that the global batch (2,048) and the
  sample stream are those of the one-rank job (the synthetic data gives every rank a slice of one global
  batch);
* the ``window`` policy (cDLRM's set-associative window cache) with window length ``L = lambda`` (what the
  sharder's documentation asks for the cDLRM mode: averages land at window boundaries, before evictions);
* the cache capacities of the config times ``--capacity-scale`` (default 5), the smallest multiple of them
  whose set-associative cache holds a window of 16 batches (at 1x the window policy fits windows of 1 and 2
  batches only).

For each lambda two runs with the same seed and data differ only in the synchronisation of the cached rows:
**exact** (the default sharder: LRPP, equal to TorchRec's resident DMP training) and **cdlrm**
(``cdlrm_average_every=lambda``: each rank applies its own gradients, caches and optimizer state averaged every
lambda steps; the 21 resident tables and the dense part stay exact, TorchRec's and DDP's). Read back from the
CSV logs: the final validation log-loss and AUC (``val/logloss``, ``val/auc``, over both ranks' slices), the
training loss per step (``train/loss``, rank 0's slice, the same samples in every run), the wall time per
step (``time/step_ms`` from ``benchmarks._common.StepTimeLog``, median after 3 warm-up steps, validation
steps included in the neighbouring step's time) and the rows synchronised per step (LRPP: critical plus
delayed rows; cDLRM: rows averaged, amortised over the lambda steps).

Exact runs of different window lengths must train the same model (LRPP is exact whatever the cache does);
their largest training-loss difference is reported as ``exact_runs_max_loss_diff`` (float32 noise).

JSON: ``val_auc_gap``, ``val_logloss_gap`` (lambda -> cdlrm - exact), ``train_loss_gap_max``,
``train_loss_gap_mean`` (lambda -> max / mean over steps of |loss_cdlrm - loss_exact|), and the raw values
per run under ``runs``.

    python benchmarks/cdlrm_gap.py [--quick] [--json PATH] [--lambdas 1 4 16] [--max-steps N] [--dry-run]

``--quick``: lambda = 4 only, 60 steps, validation every 30 steps on 10 batches (about a minute).
"""

from __future__ import annotations

import csv
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import clean_env, free_port, median, parser, table, write_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "dlrm_lookahead.yaml"
SHARDER = "torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder"
RANKS = 2


def job_defaults(config: Path) -> Dict[str, Any]:
    """Capacities and per-process batch size of the cached job's config."""
    with open(config) as f:
        cfg = yaml.safe_load(f)
    sharders = cfg["trainer"]["strategy"]["init_args"]["sharders"]
    capacity = next(s["init_args"]["capacity"] for s in sharders if s["class_path"] == SHARDER)
    inner = cfg["data"]["init_args"]["datamodule"]["init_args"]
    return {"capacity": {t: int(n) for t, n in capacity.items()}, "batch_size": int(inner["batch_size"])}


def flow(mapping: Dict[str, int]) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in mapping.items()) + "}"


def command(
    mode: str,
    lam: int,
    root: Path,
    capacity: Dict[str, int],
    batch_per_rank: int,
    max_steps: int,
    val_every: Optional[int],
    val_batches: Optional[int],
    config: Path = CONFIG,
) -> List[str]:
    """torchrun command line of one run (``mode`` ``exact`` or ``cdlrm``)."""
    init = f"capacity: {flow(capacity)}" + (f", cdlrm_average_every: {lam}" if mode == "cdlrm" else "")
    args = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={RANKS}",
        f"--master_port={free_port()}", "-m", "torchrec_lookahead", "fit", "--config", str(config),
        f"--trainer.devices={RANKS}",
        f"--trainer.strategy.init_args.sharders=[{{class_path: {SHARDER}, init_args: {{{init}}}}}]",
        "--data.init_args.policy=window",
        f"--data.init_args.window={lam}",
        f"--data.init_args.datamodule.init_args.batch_size={batch_per_rank}",
        f"--trainer.max_steps={max_steps}",
        f"--trainer.default_root_dir={root}",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.save_dir={root}",
        "--trainer.logger.name=csv",
        "--trainer.log_every_n_steps=1",
        "--trainer.callbacks=[{class_path: torchrec_lookahead.callbacks.CacheMonitor}, "
        "{class_path: benchmarks._common.StepTimeLog}]",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_model_summary=false",
    ]  # fmt: skip
    if val_every is not None:
        args.append(f"--trainer.val_check_interval={val_every}")
    if val_batches is not None:
        args.append(f"--data.init_args.datamodule.init_args.num_val_batches={val_batches}")
    return args


def read_metrics(root: Path) -> Dict[str, Any]:
    """Per-step training loss, validation history, step times and sync counters from the CSV log."""
    files = sorted(root.glob("csv/version_*/metrics.csv"))
    if not files:
        raise RuntimeError(f"no metrics.csv under {root}")
    loss: Dict[int, float] = {}
    val: List[Dict[str, float]] = []
    step_ms: List[float] = []
    sync: Dict[str, List[float]] = {}
    with open(files[-1], newline="") as f:
        for row in csv.DictReader(f):
            step = int(float(row["step"]))
            if row.get("train/loss"):
                loss[step] = float(row["train/loss"])
            if row.get("val/auc"):
                val.append({"step": step, "auc": float(row["val/auc"]), "logloss": float(row["val/logloss"])})
            if row.get("time/step_ms"):
                step_ms.append(float(row["time/step_ms"]))
            for k, v in row.items():
                if k.startswith("cache/sync/") and v:
                    sync.setdefault(k[len("cache/sync/") :], []).append(float(v))
    if not val:
        raise RuntimeError(f"{files[-1]} has no validation metrics")
    return {"loss": loss, "val": val, "step_ms": step_ms, "sync": sync}


def run(cmd: List[str], root: Path, timeout: int) -> Dict[str, Any]:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"run failed (rc {out.returncode}): {' '.join(cmd)}\n{out.stderr[-4000:]}")
    m = read_metrics(root)
    m["wall_s"] = wall
    return m


def sync_rows(mode: str, sync: Dict[str, List[float]], steps: int) -> float:
    """Rows synchronised per step (CacheMonitor logs per-step counts): LRPP's critical + delayed rows;
    cDLRM's averaged rows (every lambda steps, so amortised over them)."""
    keys = ("rows_synced_critical", "rows_synced_delayed") if mode == "exact" else ("rows_averaged",)
    return float(sum(sum(sync.get(k, [])) for k in keys)) / max(steps, 1)


def loss_gap(a: Dict[int, float], b: Dict[int, float]) -> Dict[str, float]:
    steps = sorted(set(a) & set(b))
    if not steps:
        raise RuntimeError("the two runs logged no common training step")
    d = [b[s] - a[s] for s in steps]
    tail = d[len(d) * 3 // 4 :]
    return {
        "max": max(abs(x) for x in d),
        "mean": sum(abs(x) for x in d) / len(d),
        "last_quarter_mean_signed": sum(tail) / len(tail),
        "steps": len(steps),
    }


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    p = parser(__doc__)
    p.add_argument("--lambdas", type=int, nargs="+", default=None, help="averaging periods (default 1 4 16)")
    p.add_argument("--max-steps", type=int, default=None, help="training steps (default: the epoch, 300)")
    p.add_argument("--capacity-scale", type=float, default=5.0, help="cache capacities x this")
    p.add_argument("--config", type=Path, default=CONFIG, help="the cached job")
    p.add_argument("--logs", type=Path, default=None, help="keep the runs' logs here (default: a temp dir)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    lambdas = sorted(set(args.lambdas or ([4] if args.quick else [1, 4, 16])))
    if any(lam < 1 for lam in lambdas):
        p.error("--lambdas must be >= 1")
    max_steps = args.max_steps if args.max_steps is not None else (60 if args.quick else -1)
    val_every, val_batches = (30, 10) if args.quick else (None, None)
    defaults = job_defaults(args.config)
    if defaults["batch_size"] % RANKS:
        p.error(f"the config's batch_size {defaults['batch_size']} does not split over {RANKS} ranks")
    capacity = {t: math.ceil(n * args.capacity_scale) for t, n in defaults["capacity"].items()}
    batch_per_rank = defaults["batch_size"] // RANKS

    plan = [(lam, mode) for lam in lambdas for mode in ("exact", "cdlrm")]
    if args.dry_run:
        cmds = [command(mode, lam, Path("logs") / f"{mode}_l{lam}", capacity, batch_per_rank, max_steps,
                        val_every, val_batches, args.config) for lam, mode in plan]  # fmt: skip
        for cmd in cmds:
            print(" ".join(cmd))
        return {"commands": cmds}
    if args.logs is not None:
        return measure(
            args, plan, args.logs, capacity, defaults["batch_size"], max_steps, val_every, val_batches
        )
    with tempfile.TemporaryDirectory(prefix="cdlrm_gap_") as tmp:
        return measure(
            args, plan, Path(tmp), capacity, defaults["batch_size"], max_steps, val_every, val_batches
        )


def measure(
    args: Any,
    plan: List[Tuple[int, str]],
    base: Path,
    capacity: Dict[str, int],
    global_batch: int,
    max_steps: int,
    val_every: Optional[int],
    val_batches: Optional[int],
) -> Dict[str, Any]:
    """Run every (lambda, mode) of ``plan`` with logs under ``base``; print and return the figures."""
    lambdas = sorted({lam for lam, _ in plan})
    cmds = {
        (lam, mode): command(mode, lam, base / f"{mode}_l{lam}", capacity, global_batch // RANKS, max_steps,
                             val_every, val_batches, args.config)
        for lam, mode in plan
    }  # fmt: skip
    print(f"cache capacity {capacity}, global batch {global_batch} on {RANKS} gloo ranks")
    results: Dict[Any, Dict[str, Any]] = {}
    for lam, mode in plan:
        root = base / f"{mode}_l{lam}"
        results[(lam, mode)] = r = run(cmds[(lam, mode)], root, args.timeout)
        print(f"  lambda {lam:>2} {mode:<5}: val auc {r['val'][-1]['auc']:.5f}, logloss "
              f"{r['val'][-1]['logloss']:.5f}, {len(r['loss'])} steps, {r['wall_s']:.0f} s", flush=True)  # fmt: skip

    rows, runs = [], []
    figures: Dict[str, Any] = {k: {} for k in (
        "val_auc_gap", "val_logloss_gap", "train_loss_gap_max", "train_loss_gap_mean",
        "train_loss_gap_last_quarter", "val_auc_exact", "val_auc_cdlrm", "val_logloss_exact",
        "val_logloss_cdlrm", "step_ms_exact", "step_ms_cdlrm", "sync_rows_per_step_exact",
        "sync_rows_per_step_cdlrm")}  # fmt: skip
    for lam in lambdas:
        ex, cd = results[(lam, "exact")], results[(lam, "cdlrm")]
        gap = loss_gap(ex["loss"], cd["loss"])
        fig = {
            "val_auc_gap": cd["val"][-1]["auc"] - ex["val"][-1]["auc"],
            "val_logloss_gap": cd["val"][-1]["logloss"] - ex["val"][-1]["logloss"],
            "train_loss_gap_max": gap["max"],
            "train_loss_gap_mean": gap["mean"],
            "train_loss_gap_last_quarter": gap["last_quarter_mean_signed"],
            "val_auc_exact": ex["val"][-1]["auc"],
            "val_auc_cdlrm": cd["val"][-1]["auc"],
            "val_logloss_exact": ex["val"][-1]["logloss"],
            "val_logloss_cdlrm": cd["val"][-1]["logloss"],
            "step_ms_exact": median(ex["step_ms"]),
            "step_ms_cdlrm": median(cd["step_ms"]),
            "sync_rows_per_step_exact": sync_rows("exact", ex["sync"], len(ex["loss"])),
            "sync_rows_per_step_cdlrm": sync_rows("cdlrm", cd["sync"], len(cd["loss"])),
        }
        for k, v in fig.items():
            figures[k][lam] = v
        rows.append({"lambda": lam, **{k: fig[k] for k in (
            "val_auc_exact", "val_auc_cdlrm", "val_auc_gap", "val_logloss_exact", "val_logloss_cdlrm",
            "val_logloss_gap", "train_loss_gap_max", "train_loss_gap_mean", "train_loss_gap_last_quarter",
            "step_ms_exact", "step_ms_cdlrm", "sync_rows_per_step_exact", "sync_rows_per_step_cdlrm")}})  # fmt: skip
        for mode, r in (("exact", ex), ("cdlrm", cd)):
            runs.append({
                "mode": mode, "lambda": lam, "window": lam, "val": r["val"], "steps": len(r["loss"]),
                "train_loss": [r["loss"][s] for s in sorted(r["loss"])], "step_ms_median": median(r["step_ms"]),
                "wall_s": r["wall_s"]})  # fmt: skip
    exact = [results[(lam, "exact")]["loss"] for lam in lambdas]
    spread = max((loss_gap(exact[0], e)["max"] for e in exact[1:]), default=0.0)
    figures.update(
        runs=runs,
        exact_runs_max_loss_diff=spread,
        capacity=capacity,
        global_batch=global_batch,
        ranks=RANKS,
        max_steps=max_steps,
        quick=args.quick,
    )
    # transposed for reading: one column per lambda
    cols = ["figure", *(f"lambda={lam}" for lam in lambdas)]
    print()
    print(
        table(
            [
                {"figure": k, **{f"lambda={r['lambda']}": r[k] for r in rows}}
                for k in rows[0]
                if k != "lambda"
            ],
            cols,
        )
    )
    print(f"\nexact runs of different windows: max |train loss difference| {spread:.3g}")
    write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
