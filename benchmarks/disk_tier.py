"""The disk tier against every table in RAM: the Kaggle-sized job (``configs/dlrm_synthetic.yaml`` at
``--scale``, 33.8 M rows at 1.0) trained side by side in one process with the cached tables

* ``ram``: in RAM (``TensorStore``), the reference;
* ``disk_25``, ``disk_10``: on disk (``store: disk``) under a host tier of 25 % and 10 % of their bytes, kept
  least recently used with reads one batch ahead (``host_policy: lru``);
* ``disk_25_lookahead``, ``disk_10_lookahead``: the same memory planned from the lookahead
  (``host_policy: lookahead``, rows read ``--disk-prefetch-depth`` steps ahead);

  each table's host tier is its share of the percentage, raised where below the rows of ``--disk-prefetch-depth``
  + 1 batches (the lookahead policy's host window; the capacity check refuses less), for both policies alike;
  a run reports the tables raised in ``host_budget_raised``;
* ``mmap``: in memory-mapped files (``store: mmap``), the page cache deciding what stays in memory.

The device cache is 1 % of each cached table (tables over ``--min-cached-rows`` rows), bumped to the oracle's
minimum. The page cache is cold at the start of every run: each run writes fresh files in a new directory under
``--store-dir`` (the disk tier reads and writes them with ``O_DIRECT``, so none of its I/O enters the page
cache; the memory-mapped run's pages are those it touches). Reported per run: samples/s after warm-up, rows
read from disk per step and units (4 KiB) read per step for the disk tier, peak RSS of the run (``VmHWM``,
reset before each run through ``/proc/self/clear_refs``) against the host budget, and the disk's random
4 KiB read rate measured in the same process (one and eight reads in flight).

JSON: ``disk_over_ram_samples_per_s`` (25 %), ``disk10_over_ram_samples_per_s``,
``mmap_over_ram_samples_per_s``, ``random_reads_per_s``, ``rows_read_per_step`` (per host policy and budget:
``{"lru": {"25": ..., "10": ...}, "lookahead": {...}}``), ``lookahead_over_lru_rows_read`` (per budget),
``runs``.

    python benchmarks/disk_tier.py [--quick] [--json PATH] [--scale 1.0] [--steps N] [--store-dir DIR]
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import (  # noqa: E402
    batch_size,
    build,
    capacities,
    machine,
    parser,
    proc_status,
    quiet,
    table,
    train,
    write_json,
)
from torchrec_lookahead.oracle import OracleConfig, min_capacity  # noqa: E402
from torchrec_lookahead.store import DiskStore  # noqa: E402

ROW_BYTES = (16 + 1) * 4  # a row of the job's tables: 16 floats and row-wise Adagrad's state


def random_read_rate(directory: str, threads: int, reads: int = 4000) -> float:
    """Random single-unit (4 KiB) reads per second from a fresh disk store file of 2 M rows (137 MB, every block
    written once, so that no read is of a hole)."""
    path = os.path.join(directory, f"probe_{threads}.rows")
    rows = 2_000_000
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the initial values' few operators: no thread pool to wake per block
    store = DiskStore(path, rows, 16, {"m": 1}, name="probe", host_budget_bytes=68, io_threads=threads,
                      preallocate=False)  # fmt: skip
    blocks = torch.arange(0, rows, 8192)
    store.gather(blocks)  # create every block (written once, sequentially)
    store.close()
    torch.set_num_threads(torch_threads)
    store = DiskStore.open(path, host_budget_bytes=68, io_threads=threads)
    ids = torch.randint(0, rows, (reads,), generator=torch.Generator().manual_seed(threads))
    t0 = time.perf_counter()
    store.gather(ids)
    rate = store.stats()["unit_reads"] / (time.perf_counter() - t0)
    store.close()
    os.unlink(path)
    return rate


def reset_peak_rss() -> None:
    """Start a new peak (``VmHWM``) from the current RSS (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def job(args: Any) -> Any:
    """The job's model and data (one epoch of exactly the batches the runs train)."""
    batches = args.steps + args.warmup + 2
    return build(
        overrides=[f"--data.init_args.scale={args.scale}", f"--data.init_args.num_train_batches={batches}"]
    )


def host_windows(cli: Any, capacity: Dict[str, int], depth: int) -> Dict[str, int]:
    """The rows of each cached table's largest host window (a batch and the next ``depth``) over the job's
    batches: the least its host tier may hold."""
    f2t = {f: f"t_{f}" for f in cli.datamodule.num_embeddings_per_feature}
    cli.datamodule.setup("fit")
    stream = (b.sparse_features for b in cli.datamodule.train_dataloader())
    return min_capacity(stream, depth, OracleConfig(capacity=capacity, feature_to_table=f2t))


def run(
    name: str, args: Any, capacity: Dict[str, int], rows: Dict[str, int], windows: Dict[str, int], base: str
) -> Dict[str, Any]:
    """One training run with the cached tables in ``name``'s store; its figures."""
    cli = job(args)
    directory = tempfile.mkdtemp(prefix=f"{name}_", dir=base)
    kwargs: Dict[str, Any] = {}
    budget: Optional[int] = None
    raised: List[str] = []
    if name.startswith("disk"):
        share = {t: rows[t] * ROW_BYTES * int(name.split("_")[1]) // 100 for t in capacity}
        budgets = {t: max(share[t], windows[t] * ROW_BYTES) for t in capacity}
        raised = sorted(t for t in capacity if budgets[t] > share[t])
        budget = sum(budgets.values())
        kwargs = {"store": "disk", "host_budget_bytes": budgets}
        if name.endswith("_lookahead"):
            kwargs["disk_options"] = {
                "host_policy": "lookahead",
                "disk_prefetch_depth": args.disk_prefetch_depth,
            }
    elif name == "mmap":
        kwargs = {"store": "mmap"}
    gc.collect()
    reset_peak_rss()
    rss0 = proc_status("VmRSS")
    out = train(cli, capacity, steps=args.steps, warmup=args.warmup,
                store_dir=directory if name != "ram" else None, sharder_kwargs=kwargs)  # fmt: skip
    peak = proc_status("VmHWM")
    steps = args.steps + args.warmup + 1
    read = units = prefetched = discarded = hits = 0
    for m in out["strategy"].cached_modules():
        for store in m.cache.stores.values():
            inner = getattr(store, "inner", store)
            if isinstance(inner, DiskStore):
                read += inner.stats()["rows_read"]
                units += inner.stats()["unit_reads"]
                prefetched += inner.stats()["rows_prefetched"]
                discarded += inner.stats()["prefetch_discarded"]
                hits += inner.stats()["host_hits"]
    figures = {
        "run": name,
        "samples_per_s": out["samples_per_s"],
        "step_ms": out["step_ms"],
        "rows_read_per_step": read / steps if name.startswith("disk") else None,
        "units_read_per_step": units / steps if name.startswith("disk") else None,
        "rows_prefetched_per_step": prefetched / steps if name.startswith("disk") else None,
        "prefetch_discarded_per_step": discarded / steps if name.startswith("disk") else None,
        "host_hits_per_step": hits / steps if name.startswith("disk") else None,
        "host_budget_mib": budget / 2**20 if budget else None,
        "host_budget_raised": raised,
        "peak_rss_gib": peak / 2**30,
        "rss_growth_gib": (peak - rss0) / 2**30,
    }
    del out, cli
    gc.collect()
    shutil.rmtree(directory, ignore_errors=True)
    return figures


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--scale", type=float, default=None, help="table sizes = Kaggle sizes x scale (default 1.0)"
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 60; --quick 10)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--min-cached-rows", type=int, default=100_000)
    p.add_argument(
        "--disk-prefetch-depth", type=int, default=8, help="steps ahead the lookahead policy reads"
    )
    p.add_argument("--store-dir", default=None, help="directory of the store files (default: the temp dir)")
    args = p.parse_args()
    quiet()
    args.scale = args.scale if args.scale is not None else (0.05 if args.quick else 1.0)
    args.steps = args.steps if args.steps is not None else (10 if args.quick else 60)
    min_cached = max(1000, int(args.min_cached_rows * args.scale))
    base = tempfile.mkdtemp(prefix="disk_tier_", dir=args.store_dir)
    try:
        rates = {f"{t}_in_flight": random_read_rate(base, t, 2000 if args.quick else 8000) for t in (1, 8)}
        cli = job(args)
        capacity, _ = capacities(cli.datamodule, 0.01, min_cached)
        rows = {f"t_{f}": int(n) for f, n in cli.datamodule.num_embeddings_per_feature.items()}
        store_bytes = sum(rows[t] for t in capacity) * ROW_BYTES
        bsz = batch_size(cli.datamodule)
        windows = host_windows(cli, capacity, args.disk_prefetch_depth)
        del cli
        runs: List[Dict[str, Any]] = [
            run(n, args, capacity, rows, windows, base)
            for n in ("ram", "disk_25", "disk_10", "disk_25_lookahead", "disk_10_lookahead", "mmap")
        ]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    by = {r["run"]: r for r in runs}
    ram = by["ram"]["samples_per_s"]
    print(f"disk tier vs RAM: scale {args.scale} ({sum(rows.values()):,} rows; cached tables {store_bytes / 2**20:.0f} "
          f"MiB with their state), batch {bsz}, {args.steps} timed steps; {machine()['cpu']}")  # fmt: skip
    print(table(runs))
    print("random 4 KiB reads/s:", {k: round(v) for k, v in rates.items()})
    rows_read = {
        pol: {
            b: by[f"disk_{b}" + ("" if pol == "lru" else "_lookahead")]["rows_read_per_step"]
            for b in ("25", "10")
        }
        for pol in ("lru", "lookahead")
    }
    ratio = {b: rows_read["lookahead"][b] / max(rows_read["lru"][b], 1e-9) for b in ("25", "10")}
    print("rows read from disk per step:", rows_read, "lookahead / lru:", ratio)
    write_json(
        args.json,
        {
            "machine": machine(),
            "scale": args.scale,
            "steps": args.steps,
            "cached_store_bytes": store_bytes,
            "disk_over_ram_samples_per_s": by["disk_25"]["samples_per_s"] / ram,
            "disk10_over_ram_samples_per_s": by["disk_10"]["samples_per_s"] / ram,
            "mmap_over_ram_samples_per_s": by["mmap"]["samples_per_s"] / ram,
            "random_reads_per_s": rates,
            "rows_read_per_step": rows_read,
            "lookahead_over_lru_rows_read": ratio,
            "runs": runs,
        },
    )


if __name__ == "__main__":
    main()
