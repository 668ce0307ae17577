"""The disk tier against every table in RAM: the Kaggle-sized job (``configs/dlrm_synthetic.yaml`` at
``--scale``, 33.8 M rows at 1.0) trained side by side in one process with the cached tables

* ``ram``: in RAM (``TensorStore``), the reference;
* ``disk_25``, ``disk_10``: on disk (``store: disk``) under a host tier of 25 % and 10 % of their bytes, kept
  least recently used with reads one batch ahead (``host_policy: lru``);

  these three alternate in ``--rounds`` rounds, the order rotated per round (later rounds' runs are named
  ``<run>_r<round>``); the speed figures are the median of the per-round ratios to the same round's ``ram`` run,
  with their spread (one run of the anchor moves by up to 30 % on a shared 2-core VM);
* ``disk_25_lookahead``, ``disk_10_lookahead``: the same memory planned from the lookahead
  (``host_policy: lookahead``, rows read ``--disk-prefetch-depth`` steps ahead);

  each table's host tier is its share of the percentage, raised where below the rows of ``--disk-prefetch-depth``
  + 1 batches (the lookahead policy's host window; the capacity check refuses less), for both policies alike;
  a run reports the tables raised in ``host_budget_raised``;
* ``mmap``: in memory-mapped files (``store: mmap``), the page cache deciding what stays in memory (it and the
  lookahead runs run once, after the rounds).

The device cache is 1 % of each cached table (tables over ``--min-cached-rows`` rows), bumped to the oracle's
minimum. The page cache is cold at the start of every run: each run writes fresh files in a new directory under
``--store-dir`` (the disk tier reads and writes them with ``O_DIRECT``, so none of its I/O enters the page
cache; the memory-mapped run's pages are those it touches). Reported per run: samples/s after warm-up, rows
read from disk per step and units (4 KiB) read per step for the disk tier, peak RSS of the run (``VmHWM``,
reset before each run through ``/proc/self/clear_refs``) against the host budget, and the disk's random
4 KiB read rate measured in the same process (one and eight reads in flight).

``--replay``: the rows-read figures only, for runs long enough that re-reads dominate. The oracle's plans of the
job (same capacities, horizon and prefetch depth) are replayed through the disk stores of the four disk runs
without the model, in the lookahead loader's order: the planner's read hints ``queue_depth`` steps ahead and its
use hints (the batches it has read) the oracle's horizon further, the stager's gather of step ``t + 2`` after
the write-back of step ``t`` (``prefetch_depth`` 1), the background reads let finish before each gather. The
rows read do not depend on the values; no timing is reported. The replay also gives the fewest rows any host
policy reads at each budget over the same plans (``offline_optimum``: Belady with bypass over the fetch stream,
the host tier exclusive of the device cache, with the whole future known), so that the policies' figures can be
read against what is possible.

A row never written is not read but computed (its initial value): in the device cache's miss stream every first
fetch of a row is one (``initialised_per_step``). Rows read from disk are split into first reads (of rows the
host tier never held: written through, then fetched) and re-reads, over the whole run and over its second half
(``late``: after the first fetches of the hot rows).

JSON: ``disk_over_ram_samples_per_s`` (25 %) and ``disk10_over_ram_samples_per_s`` (medians over the rounds;
``disk_over_ram_rounds``, ``disk10_over_ram_rounds``: the per-round ratios), ``ram_samples_per_s`` (median of the
``ram`` runs; ``ram_runs_samples_per_s``: each), ``mmap_over_ram_samples_per_s``,
``random_reads_per_s`` (none with ``--replay``), ``rows_read_per_step``, ``initialised_per_step``,
``first_reads_per_step``, ``rereads_per_step`` and ``late_rows_read_per_step``, ``late_rereads_per_step`` (per host
policy and budget: ``{"lru": {"25": ..., "10": ...}, "lookahead": {...}}``), ``lookahead_over_lru_rows_read``,
``lookahead_over_lru_rereads``, ``late_lookahead_over_lru_rows_read``, ``late_lookahead_over_lru_rereads`` (per
budget), ``runs``; with ``--replay``, ``offline_optimum`` (per budget, the same figures),
``optimum_over_lru_rows_read`` and ``late_optimum_over_lru_rows_read``.

    python benchmarks/disk_tier.py [--quick] [--json PATH] [--scale 1.0] [--steps N] [--rounds 3] [--store-dir DIR]
    python benchmarks/disk_tier.py --replay --scale 0.05 --steps 3000 [--disk-prefetch-depth 8]
"""

from __future__ import annotations

import gc
import heapq
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import (  # noqa: E402
    batch_size,
    capacities,
    machine,
    median,
    parser,
    proc_status,
    quiet,
    table,
    train,
    write_json,
)
from benchmarks._disk_common import (  # noqa: E402
    HORIZON,
    NO_DISK,
    PREFETCH_DEPTH,
    QUEUE_DEPTH,
    ROW_BYTES,
    Midpoint,
    counters,
    disk_figures,
    disk_kwargs,
    disk_stores,
    host_budgets,
    host_windows,
    job,
)
from torchrec_lookahead._arrays import sorted_unique  # noqa: E402
from torchrec_lookahead.oracle import (  # noqa: E402
    LookaheadOracle,
    OracleConfig,
    UnknownFeatures,
    table_ids,
)
from torchrec_lookahead.store import DiskStore  # noqa: E402


def random_read_rate(directory: str, threads: int, reads: int = 4000) -> float:
    """Random single-unit (4 KiB) reads per second from a fresh disk store file of 2 M rows (137 MB, every row
    written once, sequentially, so that every read is of a row on disk)."""
    path = os.path.join(directory, f"probe_{threads}.rows")
    rows = 2_000_000
    store = DiskStore(path, rows, 16, {"m": 1}, name="probe", host_budget_bytes=68, io_threads=threads,
                      preallocate=False)  # fmt: skip
    store.load(torch.zeros(rows, 16), {"m": torch.zeros(rows, 1)})
    store.close()
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
        budget, kwargs, raised = disk_kwargs(name, args, {t: rows[t] for t in capacity}, windows)
    elif name == "mmap":
        kwargs = {"store": "mmap"}
    steps = args.steps + args.warmup + 1
    mid = Midpoint(steps // 2)
    gc.collect()
    reset_peak_rss()
    rss0 = proc_status("VmRSS")
    out = train(cli, capacity, steps=args.steps, warmup=args.warmup, callbacks=[mid],
                store_dir=directory if name != "ram" else None, sharder_kwargs=kwargs)  # fmt: skip
    peak = proc_status("VmHWM")
    disk = NO_DISK
    if name.startswith("disk"):
        stores = disk_stores(s for m in out["strategy"].cached_modules() for s in m.cache.stores.values())
        end = counters(stores)
        disk = disk_figures(end, mid.snapshot or end, steps, steps - steps // 2)
    figures = {
        "run": name,
        "samples_per_s": out["samples_per_s"],
        "step_ms": out["step_ms"],
        **disk,
        "host_budget_mib": budget / 2**20 if budget else None,
        "host_budget_raised": raised,
        "peak_rss_gib": peak / 2**30,
        "rss_growth_gib": (peak - rss0) / 2**30,
    }
    del out, cli
    gc.collect()
    shutil.rmtree(directory, ignore_errors=True)
    return figures


def job_plans(
    args: Any, capacity: Dict[str, int]
) -> Tuple[Dict[str, int], List[Dict[str, Tuple[np.ndarray, np.ndarray, np.ndarray]]]]:
    """The job's table rows and, per step, each cached table's (fetched ids, evicted ids) as the lookahead loader's
    oracle plans them, and the ids the step's batch looks up (``steps + warmup + 1`` steps, as a training run)."""
    cli = job(args)
    dm = cli.datamodule
    rows = {f"t_{f}": int(n) for f, n in dm.num_embeddings_per_feature.items()}
    f2t = {f: f"t_{f}" for f in dm.num_embeddings_per_feature if f"t_{f}" in capacity}
    # the caches' slot spaces, as the job's sharder builds them (the default pooled layout)
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_lookahead.modules import CachedEmbeddingBagCollection

    configs = [
        c
        for m in cli.model.build_model(torch.device("meta")).modules()
        if isinstance(m, EmbeddingBagCollection)
        for c in m.embedding_bag_configs()
    ]
    oracle = LookaheadOracle(
        OracleConfig(capacity=dict(capacity), feature_to_table=f2t, horizon=HORIZON, prefetch_depth=PREFETCH_DEPTH,
                     policy="belady", unknown_features=UnknownFeatures.IGNORE,
                     num_embeddings={t: rows[t] for t in capacity},
                     slot_spaces=CachedEmbeddingBagCollection.layout_slot_spaces(configs, capacity))
    )  # fmt: skip
    steps = args.steps + args.warmup + 1
    plans: List[Dict[str, Tuple[np.ndarray, np.ndarray, np.ndarray]]] = []
    uses: List[Dict[str, np.ndarray]] = []

    def take(batch_plans: Any) -> None:
        for p in batch_plans:
            used = uses[len(plans)]
            plans.append(
                {
                    t: (tp.fetch_ids.numpy().copy(), tp.evict_ids.numpy().copy(), used[t])
                    for t, tp in p.tables.items()
                }
            )

    dm.setup("fit")
    for i, b in enumerate(dm.train_dataloader()):
        if i >= steps:
            break
        ids = table_ids(b.sparse_features, f2t, sorted(capacity), unknown=UnknownFeatures.IGNORE)
        uses.append({t: sorted_unique(v.numpy()) for t, v in ids.items()})
        take(oracle.feed(b.sparse_features))
    take(oracle.finish())
    return {t: rows[t] for t in capacity}, plans[:steps]


def replay(
    name: str, args: Any, rows: Dict[str, int], windows: Dict[str, int], plans: List[Any], base: str
) -> Dict[str, Any]:
    """Run ``name``'s disk stores through ``plans`` in the lookahead loader's order, without the model; its
    rows-read figures."""
    directory = tempfile.mkdtemp(prefix=f"{name}_", dir=base)
    budget, kwargs, raised = disk_kwargs(name, args, rows, windows)
    options = kwargs.get("disk_options", {})
    stores = {
        t: DiskStore(os.path.join(directory, f"{t}.rows"), n, 16, {"momentum1": 1}, name=t, seed=0,
                     host_budget_bytes=kwargs["host_budget_bytes"][t], **options)
        for t, n in rows.items()
    }  # fmt: skip
    depth = options.get("disk_prefetch_depth", 0)
    queue_depth = max(QUEUE_DEPTH, PREFETCH_DEPTH + 2, depth + 2)
    steps = len(plans)
    lead = PREFETCH_DEPTH + 1  # the stager gathers step t + lead after the write-back of step t

    def hint(step: int) -> None:
        if step < steps:
            for t, (fetch, _, _) in plans[step].items():
                if fetch.size:
                    stores[t].plan_reads(step, torch.from_numpy(fetch))

    def hint_uses(step: int) -> None:  # the planner reads a batch the oracle's horizon before its plan
        if step < steps:
            for t, (_, _, used) in plans[step].items():
                if used.size:
                    stores[t].plan_uses(step, torch.from_numpy(used))

    mid: Dict[str, int] = {}

    def gather(step: int) -> None:
        if step >= steps:
            return
        if step == steps // 2:  # the second half: the gathers from here on
            mid.update(counters(list(stores.values())))
        for t, (fetch, _, _) in plans[step].items():
            store = stores[t]
            store.at_step(step)
            if depth:
                wait_idle(store)
            if fetch.size:
                store.gather(torch.from_numpy(fetch))

    t0 = time.perf_counter()
    for step in range(min(queue_depth + 1, steps)):
        hint(step)
    for step in range(min(queue_depth + HORIZON + 1, steps)):
        hint_uses(step)
    for step in range(min(lead, steps)):
        gather(step)
    for step in range(steps):
        for t, (_, evict, _) in plans[step].items():
            if evict.size:
                n = evict.size
                stores[t].write_back(
                    torch.from_numpy(evict), torch.zeros(n, 16), {"momentum1": torch.zeros(n, 1)}
                )
        hint(step + queue_depth + 1)
        hint_uses(step + queue_depth + HORIZON + 1)
        gather(step + lead)
    end = counters(list(stores.values()))
    for store in stores.values():
        store.close()
    shutil.rmtree(directory, ignore_errors=True)
    return {
        "run": name,
        "replay_s": time.perf_counter() - t0,
        **disk_figures(end, mid or end, steps, steps - steps // 2),
        "host_budget_mib": budget / 2**20,
        "host_budget_raised": raised,
    }


def offline_optimum(
    rows: Dict[str, int],
    plans: List[Dict[str, Tuple[np.ndarray, np.ndarray, np.ndarray]]],
    capacity: Dict[str, int],
) -> Dict[str, float]:
    """The fewest rows any host policy of ``capacity`` rows per table reads over ``plans`` (the replay's order: the
    write-backs of step ``t``, then the gather of step ``t + 2``): the re-reads of the offline optimum (a first
    fetch is of a row never written: computed, no read), Belady with bypass over the fetch stream with the host tier
    exclusive of the device cache. A row written back is worth keeping until its next fetch and only then (the
    device cache's write-back replaces any copy it gathered); keeping the most such rows within the capacity at
    every instant is interval selection, which taking the write-backs in order and dropping the row fetched furthest
    ahead whenever the rows kept overflow solves exactly. Reads happen at the gather (a prefetch would hold its rows
    longer). Per step, over the run and its second half, as :func:`disk_figures`."""
    steps = len(plans)
    mid = steps // 2
    first = reread = late_first = late_reread = 0
    for t, n in rows.items():
        cap = capacity[t]
        fetch = [p[t][0].astype(np.int64) if t in p else np.empty(0, np.int64) for p in plans]
        evict = [p[t][1].astype(np.int64) if t in p else np.empty(0, np.int64) for p in plans]
        keys = np.sort(np.concatenate([f * steps + i for i, f in enumerate(fetch)]))  # id * steps + step
        seen = np.zeros(n, dtype=bool)
        ending = np.zeros(steps + 1, dtype=np.int64)  # rows kept until their next fetch, by that step
        heap: List[int] = []  # -(next fetch * n + id) of the rows kept (and, lazily, of rows fetched since)
        kept = 0
        for s in range(-PREFETCH_DEPTH - 1, steps):
            if s >= 0 and evict[s].size:
                ids = evict[s]
                pos = np.searchsorted(keys, ids * steps + s + 1)
                k = keys[np.minimum(pos, keys.size - 1)]
                again = (pos < keys.size) & (
                    k // steps == ids
                )  # a row fetched never again is not worth a slot
                ends = k[again] % steps
                for e, i in zip(ends.tolist(), ids[again].tolist()):
                    heapq.heappush(heap, -(e * n + i))
                np.add.at(ending, ends, 1)
                kept += int(again.sum())
                while kept > cap:  # drop the row fetched furthest ahead: it is read again then
                    e = -heapq.heappop(heap) // n
                    if e <= s + PREFETCH_DEPTH:
                        continue  # fetched already
                    ending[e] -= 1
                    kept -= 1
                    reread += 1
                    late_reread += e >= mid
                if len(heap) > 4 * max(kept, 1024):
                    heap = [x for x in heap if -x // n > s + PREFETCH_DEPTH]
                    heapq.heapify(heap)
            g = s + PREFETCH_DEPTH + 1  # the gather after this write-back
            if 0 <= g < steps:
                new = int((~seen[fetch[g]]).sum())
                seen[fetch[g]] = True
                first += new
                late_first += new if g >= mid else 0
                kept -= int(ending[g])
                ending[g] = 0
    late = steps - mid
    return {
        "rows_read_per_step": reread / steps,
        "initialised_per_step": first / steps,
        "first_reads_per_step": 0.0,
        "rereads_per_step": reread / steps,
        "late_rows_read_per_step": late_reread / late,
        "late_rereads_per_step": late_reread / late,
        "late_initialised_per_step": late_first / late,
    }


def wait_idle(store: DiskStore) -> None:
    """Until the store's background thread has read every step it may read now (deterministic counts)."""
    with store._wake:
        while not (store._next_prefetch() is None and store._written is None):
            store._wake.wait(timeout=0.01)


TIMED = ("ram", "disk_25", "disk_10")  # the runs alternated in rounds


def interleaved(
    args: Any, capacity: Dict[str, int], rows: Dict[str, int], windows: Dict[str, int], base: str
) -> List[Dict[str, Any]]:
    """The ``ram``, ``disk_25`` and ``disk_10`` runs alternated in ``args.rounds`` rounds, the order rotated per
    round, then the lookahead-policy runs and ``mmap`` once; each run's figures with its ``kind`` and ``round``."""
    runs: List[Dict[str, Any]] = []
    for r in range(args.rounds):
        for kind in TIMED[r % len(TIMED) :] + TIMED[: r % len(TIMED)]:
            figures = run(kind, args, capacity, rows, windows, base)
            runs.append({**figures, "run": kind if r == 0 else f"{kind}_r{r}", "kind": kind, "round": r})
    for kind in ("disk_25_lookahead", "disk_10_lookahead", "mmap"):
        runs.append({**run(kind, args, capacity, rows, windows, base), "kind": kind, "round": 0})
    return runs


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--scale", type=float, default=None, help="table sizes = Kaggle sizes x scale (default 1.0)"
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 60; --quick 10)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--rounds", type=int, default=None, help="rounds of the ram and LRU disk runs (default 3; --quick 1)"
    )
    p.add_argument("--min-cached-rows", type=int, default=100_000)
    p.add_argument(
        "--disk-prefetch-depth", type=int, default=8, help="steps ahead the lookahead policy reads"
    )
    p.add_argument("--store-dir", default=None, help="directory of the store files (default: the temp dir)")
    p.add_argument(
        "--replay",
        action="store_true",
        help="rows-read figures only: the plans replayed through the disk stores without the model (no timing)",
    )
    args = p.parse_args()
    quiet()
    args.scale = args.scale if args.scale is not None else (0.05 if args.quick else 1.0)
    args.steps = args.steps if args.steps is not None else (10 if args.quick else 60)
    args.rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    min_cached = max(1000, int(args.min_cached_rows * args.scale))
    base = tempfile.mkdtemp(prefix="disk_tier_", dir=args.store_dir)
    disk_runs = ("disk_25", "disk_10", "disk_25_lookahead", "disk_10_lookahead")
    rates: Dict[str, float] = {}
    optimum: Dict[str, Dict[str, float]] = {}
    try:
        cli = job(args)
        capacity, _ = capacities(cli.datamodule, 0.01, min_cached)
        rows = {f"t_{f}": int(n) for f, n in cli.datamodule.num_embeddings_per_feature.items()}
        store_bytes = sum(rows[t] for t in capacity) * ROW_BYTES
        bsz = batch_size(cli.datamodule)
        windows = host_windows(cli, capacity, args.disk_prefetch_depth)
        del cli
        if args.replay:
            table_rows, plans = job_plans(args, capacity)
            runs: List[Dict[str, Any]] = [
                replay(n, args, table_rows, windows, plans, base) for n in disk_runs
            ]
            for pct in ("25", "10"):
                budgets, _ = host_budgets(f"disk_{pct}", table_rows, windows)
                cap = {t: min(budgets[t] // ROW_BYTES, n) for t, n in table_rows.items()}
                optimum[pct] = offline_optimum(table_rows, plans, cap)
        else:
            rates = {
                f"{t}_in_flight": random_read_rate(base, t, 2000 if args.quick else 8000) for t in (1, 8)
            }
            runs = interleaved(args, capacity, rows, windows, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    by = {r["run"]: r for r in runs}
    print(f"disk tier{' (replay)' if args.replay else ' vs RAM'}: scale {args.scale} ({sum(rows.values()):,} rows; "
          f"cached tables {store_bytes / 2**20:.0f} MiB with their state), batch {bsz}, {args.steps} timed steps; "
          f"{machine()['cpu']}")  # fmt: skip
    print(table(runs))
    if rates:
        print("random 4 KiB reads/s:", {k: round(v) for k, v in rates.items()})

    def per_policy(key: str) -> Dict[str, Dict[str, float]]:
        return {
            pol: {b: by[f"disk_{b}" + ("" if pol == "lru" else "_lookahead")][key] for b in ("25", "10")}
            for pol in ("lru", "lookahead")
        }

    def ratio(fig: Dict[str, Dict[str, float]], key: str = "lookahead") -> Dict[str, float]:
        return {b: fig[key][b] / max(fig["lru"][b], 1e-9) for b in ("25", "10")}  # LRU may read no row

    figs = {k: per_policy(k) for k in
            ("rows_read_per_step", "initialised_per_step", "first_reads_per_step", "rereads_per_step",
             "late_rows_read_per_step", "late_rereads_per_step")}  # fmt: skip
    ratios = {
        "lookahead_over_lru_rows_read": ratio(figs["rows_read_per_step"]),
        "lookahead_over_lru_rereads": ratio(figs["rereads_per_step"]),
        "late_lookahead_over_lru_rows_read": ratio(figs["late_rows_read_per_step"]),
        "late_lookahead_over_lru_rereads": ratio(figs["late_rereads_per_step"]),
    }
    if optimum:
        for key in ("rows_read_per_step", "late_rows_read_per_step"):
            best = {b: optimum[b][key] for b in ("25", "10")}
            ratios[f"{'late_' if key.startswith('late') else ''}optimum_over_lru_rows_read"] = ratio(
                {**figs[key], "optimum": best}, "optimum"
            )
    for k, v in {**figs, "offline_optimum": optimum, **ratios}.items():
        print(f"{k}: {v}")
    out: Dict[str, Any] = {
        "machine": machine(),
        "scale": args.scale,
        "steps": args.steps,
        "replay": args.replay,
        "disk_prefetch_depth": args.disk_prefetch_depth,
        "cached_store_bytes": store_bytes,
    }
    if not args.replay:
        ram_runs = [r["samples_per_s"] for r in runs if r.get("kind") == "ram"]
        ram = median(ram_runs)
        per_run = {(r["kind"], r["round"]): r["samples_per_s"] for r in runs}  # per round: over its ram run
        speed = {
            k: [per_run[k, n] / per_run["ram", n] for n in range(args.rounds)] for k in ("disk_25", "disk_10")
        }
        out.update(
            rounds=args.rounds,
            ram_samples_per_s=ram,
            ram_runs_samples_per_s=ram_runs,
            disk_over_ram_samples_per_s=median(speed["disk_25"]),
            disk_over_ram_rounds=speed["disk_25"],
            disk10_over_ram_samples_per_s=median(speed["disk_10"]),
            disk10_over_ram_rounds=speed["disk_10"],
            mmap_over_ram_samples_per_s=by["mmap"]["samples_per_s"] / ram,
            random_reads_per_s=rates,
        )
        for key, r in speed.items():
            print(f"{key} / ram: median {median(r):.3f} of {len(r)} rounds, spread {min(r):.3f}-{max(r):.3f}")
    if optimum:
        out["offline_optimum"] = optimum
    write_json(args.json, {**out, **figs, **ratios, "runs": runs})


if __name__ == "__main__":
    main()
