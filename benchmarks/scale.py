"""Full-size tables through a small cache: Criteo-Kaggle-shaped DLRM (33.8 M rows, dim 16) on this machine.

The default job's model and data (``configs/dlrm_synthetic.yaml``) with ``scale=1.0``: the 26 Kaggle table
sizes (33,762,577 rows; 2.3 GB of rows and row-wise Adagrad state). Tables of more than ``--min-cached-rows``
rows live in host stores with a device cache of ``--fraction`` (1 %) of their rows (bumped to the oracle's
minimum where below it); the others are resident. A bounded number of steps is trained; reported: samples/s
after warm-up (JSON ``samples_per_s``), peak RSS (``peak_rss_gib``), store bytes (``store_gib``), the time
to build and shard the model (``setup_s``, resident tables are initialised there) and the first steps
(``first_steps_s``: the stores initialise their rows lazily, chunk by chunk, when a step first touches them).
The epoch has 100,000 batches, of which only the first few hundred are read: the capacities are sized on the
batches trained and 100 more, the capacity pre-scan (part of ``setup_s``) reads those same batches
(``capacity_check_batches``; its default time bound would stop it first on a slow machine) and the loader checks
the others as it plans them. A pre-scan of the whole epoch would keep the first step away for many minutes.

Manual modes (not run in CI), each in its own process so that peak RSS is its own:

* ``--terabyte --store-dir DIR``: Criteo-Terabyte-shaped tables (the TorchRec NVT / MLPerf DLRM-DCNv2
  sizes, 204,184,588 rows, single-hot) in memory-mapped stores under DIR (about 14 GB of files at dim 16);
  with ``--store disk --embedding-dim 64 --host-budget-gib 8``, the issue's tables larger than this machine's
  memory (about 53 GB of rows and row-wise Adagrad state; 64 GB of files, the disk stores' logs holding an
  eighth more, so DIR needs that much free) in disk stores under a host tier of 8 GiB, then the
  Kaggle-sized job with its tables in RAM, the anchor (JSON ``terabyte_over_kaggle_ram_samples_per_s``, rows
  read from and written to disk and rows computed (never written) per step, peak RSS of each, reset between them);
* ``--mmap-vs-ram --store-dir DIR``: the Kaggle-sized job with in-RAM stores and with memory-mapped stores,
  same capacities, alternated (``--rounds``): the relative throughput of the memory-mapped store on a size
  that fits RAM (JSON ``mmap_over_ram_samples_per_s``).

    python benchmarks/scale.py [--quick] [--json PATH] [--steps N] [--fraction 0.01] [--scale 1.0]
    python benchmarks/scale.py --terabyte --store-dir /big/disk/stores [--steps N]
    python benchmarks/scale.py --terabyte --store disk --embedding-dim 64 --host-budget-gib 8 --store-dir DIR
    python benchmarks/scale.py --mmap-vs-ram --store-dir /big/disk/stores [--steps N] [--rounds 2]
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import lightning.pytorch as pl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import (  # noqa: E402
    batch_size,
    build,
    capacities,
    machine,
    median,
    parser,
    proc_status,
    quiet,
    table,
    table_rows,
    train,
    write_json,
)

GIB = float(1 << 30)

#: TorchRec NVT / MLPerf DLRM-DCNv2 Criteo Terabyte sizes (../shared/data/criteo_stats.md; 204,184,588 rows).
TERABYTE_ROWS: List[int] = [
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
]  # fmt: skip


class _StepClock(pl.Callback):
    """Wall time from the start of fit to the first training batch, and of each of the first steps."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.t0 = time.perf_counter()
        self.setup_s = 0.0
        self.first_steps: List[float] = []
        self._last: Optional[float] = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        now = time.perf_counter()
        self.setup_s = now - self.t0
        self._last = now

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        if len(self.first_steps) < self.first and self._last is not None:
            self.first_steps.append(now - self._last)
        self._last = now


def run(
    overrides: List[str],
    fraction: float,
    min_cached_rows: int,
    steps: int,
    warmup: int,
    store_dir: Optional[str] = None,
    capacity: Optional[Dict[str, int]] = None,
    sharder_kwargs: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Train the default job with ``overrides`` through the cache; figures of the run."""
    t0 = time.perf_counter()
    cli = build(overrides=overrides)
    dm = cli.datamodule
    bumped: Dict[str, int] = {}
    probed = steps + warmup + 100  # the batches the capacities are sized on, and the pre-scan reads
    if capacity is None:
        capacity, bumped = capacities(dm, fraction, min_cached_rows, batches=probed)
    t_cap = time.perf_counter() - t0
    rows = table_rows(dm)
    clock = _StepClock(first=warmup)
    clock.t0 = time.perf_counter()
    # the pre-scan stops where the capacities stopped being measured: a later window may need a few rows more,
    # and is checked if the loader ever plans it
    _reset_peak_rss()
    res = train(cli, capacity, steps, warmup=warmup, store_dir=store_dir, callbacks=[clock],
                lookahead_kwargs={"capacity_check_batches": probed}, sharder_kwargs=sharder_kwargs)  # fmt: skip
    mods = res["strategy"].cached_modules()
    stores = {n: s for m in mods for n, s in m.cache.stores.items()}
    out = {
        "rows": sum(rows.values()),
        "cached_tables": len(capacity),
        "cached_rows": sum(rows[t] for t in capacity),
        "cache_rows": sum(capacity.values()),
        "bumped": bumped,
        "capacity": capacity,
        "store_gib": sum(int(s.nbytes) for s in stores.values()) / GIB,
        "store_type": type(_inner(next(iter(stores.values())))).__name__ if stores else None,
        "rows_read_from_disk_per_step": _disk_count(stores.values(), "rows_read") / (steps + warmup + 1),
        "rows_computed_per_step": _disk_count(stores.values(), "rows_initialised") / (steps + warmup + 1),
        "rows_written_to_disk_per_step": _disk_count(stores.values(), "rows_written") / (steps + warmup + 1),
        "samples_per_s": res["samples_per_s"],
        "step_ms": res["step_ms"],
        "capacity_probe_s": t_cap,
        "setup_s": clock.setup_s,
        "first_steps_s": clock.first_steps,
        "fit_s": res["fit_s"],
        "peak_rss_gib": proc_status("VmHWM") / GIB,
        "rss_gib": proc_status("VmRSS") / GIB,
        "batch_size": batch_size(dm),
        "steps": steps,
        "warmup": warmup,
    }
    del res, mods, stores, cli
    gc.collect()
    return out


def _inner(store: Any) -> Any:
    return getattr(store, "inner", store)  # a store wrapped for the run (e.g. writes filtered per rank)


def _disk_count(stores: Any, key: str) -> int:
    """A counter of the run's disk stores summed (``rows_read``: rows read from their files;
    ``rows_initialised``: rows never written, computed instead; ``rows_written``: rows written to their files;
    0 without disk stores)."""
    from torchrec_lookahead.store import DiskStore

    return sum(int(_inner(s).stats()[key]) for s in stores if isinstance(_inner(s), DiskStore))


def _reset_peak_rss() -> None:
    """Let ``VmHWM`` start again from the current RSS (Linux ``clear_refs``), so each run's peak is its own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _report(r: Dict[str, Any]) -> None:
    """Print one run's figures as soon as it has finished."""
    firsts = ", ".join(f"{x:.2f}" for x in r["first_steps_s"])
    print(
        f"{r['job']}: {r['rows']:,} rows, {r['cached_tables']} cached tables, {r['cache_rows']:,} cache rows, "
        f"stores {r['store_gib']:.2f} GiB ({r['store_type']}); capacity probe {r['capacity_probe_s']:.1f} s, "
        f"setup {r['setup_s']:.1f} s, first steps {firsts} s, fit {r['fit_s']:.1f} s; {r['samples_per_s']:,.0f} "
        f"samples/s ({r['step_ms']:.1f} ms/step); peak RSS {r['peak_rss_gib']:.2f} GiB; bumped to the oracle's "
        f"minimum: {r['bumped'] or 'none'}",
        flush=True,
    )


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 200, --quick 30)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--fraction", type=float, default=0.01, help="cache rows / rows of each cached table")
    p.add_argument("--min-cached-rows", type=int, default=50_000, help="cache the tables with more rows")
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="table sizes x this (Kaggle's, and --terabyte's: smoke tests)",
    )
    p.add_argument(
        "--terabyte", action="store_true", help="Criteo-Terabyte-shaped tables in memory-mapped stores"
    )
    p.add_argument(
        "--store-dir", default=None, help="directory of the store files (default: a temporary one)"
    )
    p.add_argument("--mmap-vs-ram", action="store_true", help="Kaggle sizes: in-RAM vs memory-mapped stores")
    p.add_argument("--rounds", type=int, default=2, help="(in-RAM, mmap) rounds of --mmap-vs-ram")
    p.add_argument("--keep-stores", action="store_true", help="do not delete the store files afterwards")
    p.add_argument("--store", choices=["mmap", "disk"], default="mmap", help="the stores of --terabyte")
    p.add_argument(
        "--embedding-dim", type=int, default=None, help="embedding dim (default: the config's, 16)"
    )
    p.add_argument("--host-budget-gib", type=float, default=8.0, help="host tier of --store disk, GiB")
    args = p.parse_args()
    quiet()
    steps = args.steps or (30 if args.quick else 200)
    base = ["--data.init_args.num_train_batches=100000", f"--data.init_args.batch_size={args.batch_size}"]
    figures: Dict[str, Any] = {}
    results: List[Dict[str, Any]] = []
    made_dir: Optional[str] = None

    if args.terabyte or args.mmap_vs_ram:
        if not args.store_dir:  # a temporary directory, deleted at the end (unless --keep-stores)
            args.store_dir = made_dir = tempfile.mkdtemp(prefix="scale_stores_")
            print(f"store files under {args.store_dir}", flush=True)
    if args.embedding_dim is not None:  # DLRM's bottom MLP ends at the embedding dim
        d = args.embedding_dim
        base += [
            f"--model.init_args.embedding_dim={d}",
            f"--model.init_args.dense_arch_layer_sizes=[{4 * d},{d}]",
        ]
    if args.terabyte:
        tb_dir = os.path.join(args.store_dir, "terabyte")
        sizes = "[" + ",".join(str(max(1, int(n * args.scale))) for n in TERABYTE_ROWS) + "]"
        disk = args.store == "disk"
        tb = run(
            [*base, f"--data.init_args.num_embeddings={sizes}"],
            args.fraction,
            args.min_cached_rows,
            steps,
            args.warmup,
            store_dir=tb_dir,
            sharder_kwargs={"store": "disk", "host_budget_bytes": int(args.host_budget_gib * GIB)}
            if disk
            else None,
        )
        results.append({"job": f"terabyte, {args.store}", **tb})
        _report(results[-1])
        if not args.keep_stores:
            shutil.rmtree(tb_dir, ignore_errors=True)
        figures = {
            "samples_per_s": tb["samples_per_s"],
            "peak_rss_gib": tb["peak_rss_gib"],
            "store_gib": tb["store_gib"],
            "terabyte": tb,
        }
        if disk:  # the anchor: the Kaggle-sized job, its tables in RAM, same model
            kaggle = [*base, f"--data.init_args.scale={args.scale}"]
            kg = run(kaggle, args.fraction, args.min_cached_rows, steps, args.warmup)
            results.append({"job": "kaggle, ram", **kg})
            _report(results[-1])
            figures.update(
                kaggle_ram=kg,
                host_budget_gib=args.host_budget_gib,
                terabyte_over_kaggle_ram_samples_per_s=tb["samples_per_s"] / kg["samples_per_s"],
            )
    elif args.mmap_vs_ram:
        # in-RAM vs memory-mapped stores on the Kaggle sizes (fit in RAM), same capacities, alternated
        kaggle = [*base, f"--data.init_args.scale={args.scale}"]
        kg_dir = os.path.join(args.store_dir, "kaggle")
        cap: Optional[Dict[str, int]] = None
        by_kind: Dict[str, List[float]] = {"in-RAM": [], "mmap": []}
        for r in range(args.rounds):
            for kind in ("in-RAM", "mmap"):
                shutil.rmtree(kg_dir, ignore_errors=True)
                res = run(
                    kaggle,
                    args.fraction,
                    args.min_cached_rows,
                    steps,
                    args.warmup,
                    store_dir=kg_dir if kind == "mmap" else None,
                    capacity=cap,
                )
                cap = res["capacity"]
                by_kind[kind].append(res["samples_per_s"])
                results.append({"job": f"kaggle, {kind} (round {r})", **res})
                _report(results[-1])
        if not args.keep_stores:
            shutil.rmtree(kg_dir, ignore_errors=True)
        ram, mm = median(by_kind["in-RAM"]), median(by_kind["mmap"])
        figures = {
            "ram_samples_per_s": ram,
            "mmap_samples_per_s": mm,
            "mmap_over_ram_samples_per_s": mm / ram,
            "runs": results,
        }
    else:
        r = run(
            [*base, f"--data.init_args.scale={args.scale}"],
            args.fraction,
            args.min_cached_rows,
            steps,
            args.warmup,
        )
        results.append({"job": "kaggle, in-RAM", **r})
        _report(results[-1])
        figures = {
            "samples_per_s": r["samples_per_s"],
            "peak_rss_gib": r["peak_rss_gib"],
            "store_gib": r["store_gib"],
            **{k: v for k, v in r.items() if k not in ("samples_per_s", "peak_rss_gib", "store_gib")},
        }
    cols = ["job", "rows", "cached_tables", "cache_rows", "store_gib", "setup_s", "samples_per_s", "step_ms"]
    cols += ["peak_rss_gib"]
    print()
    print(table(results, cols))
    if made_dir is not None and not args.keep_stores:
        shutil.rmtree(made_dir, ignore_errors=True)
    if "terabyte_over_kaggle_ram_samples_per_s" in figures:
        print(
            "Terabyte-sized on disk / Kaggle-sized in RAM samples/s: "
            f"{figures['terabyte_over_kaggle_ram_samples_per_s']:.3f}"
        )
    if "mmap_over_ram_samples_per_s" in figures:
        print(
            f"memory-mapped / in-RAM samples/s (Kaggle sizes): {figures['mmap_over_ram_samples_per_s']:.3f}"
        )
    print(f"on {machine()['cpu']}, {machine()['threads']} threads")
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
