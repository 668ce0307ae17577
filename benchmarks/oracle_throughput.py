"""Oracle throughput on Criteo-Kaggle-shaped batches, against the floor of one torch.unique pass per table.

python benchmarks/oracle_throughput.py [--quick] [--json PATH] [--plan-threads N]

Every policy is timed planning its tables one after the other (``plan_threads=1``) and on ``--plan-threads``
threads (default: the oracle's default), runs of the two alternating; each reports samples/s (wall clock,
median) and the process CPU time per batch (all threads; steadier than the wall clock on a shared machine).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import write_json  # noqa: E402
from benchmarks._zipf import KAGGLE_ROWS, criteo_batches, table_names  # noqa: E402
from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig  # noqa: E402


def floor_pass(batches: List[Dict[str, torch.Tensor]]) -> float:
    start = time.perf_counter()
    for b in batches:
        for ids in b.values():
            torch.unique(ids, return_inverse=True)
    return time.perf_counter() - start


def oracle_pass(cfg: OracleConfig, batches: List[Dict[str, torch.Tensor]], with_alloc: bool = False) -> float:
    return timed_pass(cfg, batches, with_alloc)[0]


def timed_pass(
    cfg: OracleConfig, batches: List[Dict[str, torch.Tensor]], with_alloc: bool = False
) -> Tuple[float, float]:
    """(wall seconds, process CPU seconds) of planning ``batches``."""
    start, cpu = time.perf_counter(), time.process_time()
    oracle = LookaheadOracle(cfg)  # allocation of the per-id arrays is timed only with_alloc
    if not with_alloc:
        start, cpu = time.perf_counter(), time.process_time()
    for _ in oracle.plan_stream(batches):
        pass
    return time.perf_counter() - start, time.process_time() - cpu


def main(argv: Any = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer batches and runs (about a minute)")
    parser.add_argument("--json", type=str, default=None, help="write the results here")
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--horizon", type=int, default=200)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--capacity-fraction", type=float, default=0.05)
    parser.add_argument(
        "--scale", type=float, default=1.0, help="Kaggle table sizes x this (at least 3 rows)"
    )
    parser.add_argument(
        "--plan-threads",
        type=int,
        default=None,
        help="planner threads of the parallel passes (default: OracleConfig's default)",
    )
    args = parser.parse_args(argv)
    steps = args.steps or (120 if args.quick else 300)
    runs = args.runs or (1 if args.quick else 3)
    horizon = min(args.horizon, steps - 1)
    names = table_names()
    sizes = [max(3, int(r * args.scale)) for r in KAGGLE_ROWS]
    rows = dict(zip(names, sizes))
    t0 = time.perf_counter()
    batches = criteo_batches(steps, args.batch, sizes)
    gen_s = time.perf_counter() - t0
    # belady: 5% of rows, at least the working set of two batches (prefetch_depth=1) or the whole table
    cap = {n: max(int(r * args.capacity_fraction), min(r, 2 * args.batch)) for n, r in rows.items()}
    samples = steps * args.batch
    floor = statistics.median(floor_pass(batches) for _ in range(runs))
    results: Dict[str, Any] = {
        "torch_threads": torch.get_num_threads(),
        "batch": args.batch,
        "steps": steps,
        "horizon": horizon,
        "tables": len(names),
        "rows": sum(sizes),
        "generate_s": round(gen_s, 2),
        "floor_samples_per_s": samples / floor,
        "policies": {},
    }
    stats: Dict[str, Any] = {}
    threads = OracleConfig(capacity={"t": 1}, plan_threads=args.plan_threads).plan_threads
    results["plan_threads"] = threads
    for policy in ("belady", "ttl", "lru"):
        capacity = rows if policy == "ttl" else cap
        cfgs = {
            n: OracleConfig(
                capacity=capacity,
                num_embeddings=rows,
                horizon=horizon,
                prefetch_depth=1,
                policy=policy,
                plan_threads=n,
            )
            for n in sorted({1, int(threads or 1)})
        }
        timings: Dict[int, List[Tuple[float, float]]] = {n: [] for n in cfgs}
        for _ in range(runs):  # alternate, so that both see the same load on a shared machine
            for n, c in cfgs.items():
                timings[n].append(timed_pass(c, batches))
        for n, got in timings.items():
            secs = statistics.median(w for w, _ in got)
            cpu_ms = 1e3 * statistics.median(c for _, c in got) / steps
            key = policy if n == 1 else f"{policy}, {n} threads"
            results["policies"][key] = {
                "samples_per_s": samples / secs,
                "seconds": secs,
                "cpu_ms_per_batch": cpu_ms,
            }
        oracle = LookaheadOracle(cfgs[1])
        if policy == "ttl":
            for _ in oracle.plan_stream(batches[: min(steps, 60)]):
                pass
            stats["ttl_peak_rows_60_steps"] = sum(s["peak_rows"] for s in oracle.stats().values())
    # belady without table sizes: the per-id arrays grow while planning, so the ratio to the sized oracle
    # times the allocation of the per-id arrays in both (pairs run alternately, median of the pair ratios)
    unsized = OracleConfig(capacity=cap, horizon=horizon, prefetch_depth=1, policy="belady", plan_threads=1)
    sized = OracleConfig(
        capacity=cap, num_embeddings=rows, horizon=horizon, prefetch_depth=1, policy="belady", plan_threads=1
    )
    pairs = [(oracle_pass(sized, batches, True), oracle_pass(unsized, batches, True)) for _ in range(runs)]
    secs = statistics.median(u for _, u in pairs)
    results["policies"]["belady, no num_embeddings"] = {"samples_per_s": samples / secs, "seconds": secs}
    # belady over one pooled cache of every table (the product's default layout: all tables share dimension and
    # kernel), alternating with the per-table oracle
    # threads reading the members of the one space (two unless --plan-threads says otherwise: a pooled space has
    # one unit, so the default of one thread per four cores would leave a 2-core host's second core idle)
    space_threads = max(2, int(args.plan_threads or 2))
    pooled = {
        n: OracleConfig(
            capacity=cap,
            num_embeddings=rows,
            horizon=horizon,
            prefetch_depth=1,
            policy="belady",
            plan_threads=n,
            slot_spaces={"pooled": names},
        )
        for n in (1, space_threads)
    }
    pooled_runs = [
        (
            oracle_pass(pooled[1], batches),
            oracle_pass(pooled[space_threads], batches),
            oracle_pass(sized, batches),
        )
        for _ in range(runs)
    ]
    secs = statistics.median(p for p, _, _ in pooled_runs)
    results["policies"]["belady, pooled"] = {"samples_per_s": samples / secs, "seconds": secs}
    secs = statistics.median(p for _, p, _ in pooled_runs)
    results["policies"][f"belady, pooled, {space_threads} threads"] = {
        "samples_per_s": samples / secs,
        "seconds": secs,
    }
    results["pooled_samples_per_s"] = samples / secs
    results["pooled_over_per_table"] = statistics.median(p / t for p, _, t in pooled_runs)
    results["samples_per_s"] = results["policies"]["belady"]["samples_per_s"]
    results["unsized_over_sized"] = statistics.median(s / u for s, u in pairs)
    results.update(stats)
    print(f"{'pass':<34}{'samples/s':>14}{'x floor':>10}{'CPU ms/batch':>14}")
    print(f"{'torch.unique floor':<34}{results['floor_samples_per_s']:>14,.0f}{1.0:>10.2f}")
    for policy, r in results["policies"].items():
        ratio = r["samples_per_s"] / results["floor_samples_per_s"]
        cpu = f"{r['cpu_ms_per_batch']:>14.2f}" if "cpu_ms_per_batch" in r else ""
        print(f"{'oracle ' + policy:<34}{r['samples_per_s']:>14,.0f}{ratio:>10.2f}{cpu}")
    print(f"belady without / with num_embeddings: {results['unsized_over_sized']:.2f}")
    print(f"belady pooled / per table, seconds: {results['pooled_over_per_table']:.2f}")
    print(f"({steps} batches of {args.batch}, {len(names)} tables, horizon {horizon}, median of {runs} runs)")
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
