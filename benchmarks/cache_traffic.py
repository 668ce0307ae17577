"""Rows fetched and written back per step by each policy, at 1%, 5% and 10% capacity.

Synthetic Criteo-Kaggle-shaped data (the 26 Kaggle table sizes times ``--scale``, default 0.1: 3.38 M rows,
batch 4,096) and the real samples in ``<repo>/../shared/data`` (Taobao user,item,category; MovieLens
userId,movieId; Criteo head, 26 categorical columns), in file order. Capacities below one prefetch window's
working set are bumped to the minimum (the number of bumped tables is reported per fraction). Also Bagpipe's
Table 3 shape: ttl's peak cache rows and fetches against the horizon.

    python benchmarks/cache_traffic.py [--quick] [--json PATH] [--scale 0.1] [--batch 4096] [--steps 400]
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._report import write_json  # noqa: E402
from benchmarks._zipf import KAGGLE_ROWS, criteo_batches, table_names  # noqa: E402
from torchrec_lookahead.errors import LookaheadError  # noqa: E402
from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig, min_capacity  # noqa: E402

DATA = REPO.parent / "shared" / "data"
Batches = List[Dict[str, torch.Tensor]]
WINDOW = 8  # cDLRM window length used for policy "window"
LARGE = 100_000  # tables of at least this many rows are reported as "large"


def traffic(batches: Batches, cfg: OracleConfig) -> Dict[str, float]:
    oracle = LookaheadOracle(cfg)
    for _ in oracle.plan_stream(batches):
        pass
    st = oracle.stats()
    steps = len(batches)
    return {
        "fetch_per_step": sum(s["fetches"] for s in st.values()) / steps,
        "writeback_per_step": sum(s["evictions"] for s in st.values()) / steps,
        "peak_rows": sum(s["peak_rows"] for s in st.values()),
    }


def no_cache(batches: Batches) -> Dict[str, float]:
    uniq = sum(int(torch.unique(ids).numel()) for b in batches for ids in b.values())
    return {"fetch_per_step": uniq / len(batches), "writeback_per_step": uniq / len(batches), "peak_rows": 0}


def compulsory(batches: Batches) -> Dict[str, float]:
    """First-touch fetches: distinct ids of the whole stream per step, what any cache (even an unbounded one)
    must fetch once; the floor under every policy's fetches."""
    keys = batches[0].keys()
    distinct = sum(int(torch.unique(torch.cat([b[k] for b in batches])).numel()) for k in keys)
    return {"fetch_per_step": distinct / len(batches), "writeback_per_step": 0.0, "peak_rows": distinct}


def run_dataset(
    name: str, batches: Batches, rows: Dict[str, int], horizon: int, fractions: List[float]
) -> Dict:
    horizon = min(horizon, len(batches) - 1)
    base = OracleConfig(capacity={t: 1 for t in rows})
    minimum = min_capacity(batches, 1, base)
    window_min = min_capacity(batches, WINDOW - 1, base)
    out: Dict[str, Any] = {
        "tables": len(rows),
        "steps": len(batches),
        "horizon": horizon,
        "rows": sum(rows.values()),
        "results": {},
    }
    out["results"]["none"] = no_cache(batches)
    out["results"]["compulsory"] = compulsory(batches)
    ttl_cfg = OracleConfig(capacity=dict(rows), num_embeddings=rows, horizon=max(horizon, 2), policy="ttl")
    out["results"]["ttl"] = traffic(batches, ttl_cfg)
    for frac in fractions:
        cap = {t: max(1, int(r * frac)) for t, r in rows.items()}
        bumped = {t: minimum[t] for t in rows if cap[t] < minimum[t]}
        cap.update(bumped)
        key = f"{round(frac * 100)}pct"
        res: Dict[str, Any] = {
            "capacity_rows": sum(cap.values()),
            "bumped_tables": len(bumped),
            "bumped_rows": sum(bumped.values()),
            # bumped tables that are not simply held whole (their minimum is below their size)
            "bumped_partial_tables": sum(1 for t in bumped if bumped[t] < rows[t]),
            "large_tables": sum(1 for t in rows if rows[t] >= LARGE),
            "bumped_large_tables": sum(1 for t in bumped if rows[t] >= LARGE),
        }
        for policy in ("belady", "lru", "window"):
            kw: Dict[str, Any] = dict(window=WINDOW) if policy == "window" else {}
            pcap = dict(cap)
            if policy == "window":
                # a set-associative cache needs the whole window's ids and slack against set conflicts
                need = {t: min(rows[t], 2 * window_min[t]) for t in rows}
                wb = {t: need[t] for t in rows if pcap[t] < need[t]}
                pcap.update(wb)
                res["window_bumped_tables"] = len(wb)
                res["window_capacity_rows"] = sum(pcap.values())
            try:
                cfg = OracleConfig(
                    capacity=pcap, num_embeddings=rows, horizon=max(horizon, WINDOW), policy=policy, **kw
                )
                res[policy] = traffic(batches, cfg)
            except LookaheadError as e:
                res[policy] = {"error": str(e).split(";")[0]}
        out["results"][key] = res
    return out


def read_rows(path: Path, cols: List[int], skip_header: bool, delim: str = ",") -> List[List[str]]:
    with open(path, newline="") as f:
        reader = csv.reader(f, delimiter=delim)
        if skip_header:
            next(reader)
        return [[row[c] for c in cols] for row in reader if len(row) > max(cols)]


def to_batches(rows: List[List[str]], names: List[str], batch: int) -> (Batches, Dict[str, int]):
    ids = []
    sizes = {}
    for j, name in enumerate(names):
        _, inv = np.unique(np.array([r[j] for r in rows]), return_inverse=True)
        # relabel in a hashed order so that ids are not sorted by value
        perm = np.argsort([zlib.crc32(str(i).encode()) for i in range(inv.max() + 1)])
        ids.append(perm[inv].astype(np.int64))
        sizes[name] = int(inv.max()) + 1
    steps = len(rows) // batch
    out = [
        {n: torch.from_numpy(ids[j][t * batch : (t + 1) * batch].copy()) for j, n in enumerate(names)}
        for t in range(steps)
    ]
    return out, sizes


def real_datasets(quick: bool) -> Dict[str, Any]:
    if not DATA.exists():
        print(f"skipping real data: {DATA} is absent")
        return {}
    out = {}
    taobao = DATA / "taobao_userbehavior_head" / "UserBehavior_head.csv"
    if taobao.exists():
        out["taobao (user,item,category) b=1024"] = (
            read_rows(taobao, [0, 1, 2], False),
            ["user", "item", "cat"],
            1024,
        )
    ml = DATA / "movielens_latest_small_2016" / "ratings.csv"
    if ml.exists():
        out["movielens (user,movie) b=1024"] = (read_rows(ml, [0, 1], True), ["user", "movie"], 1024)
    criteo = DATA / "criteo_kaggle_head" / "head8000_split_train.txt"
    if criteo.exists():
        out["criteo head (26 cat) b=256"] = (
            read_rows(criteo, list(range(14, 40)), False, "\t"),
            [f"c{i}" for i in range(26)],
            256,
        )
    return out


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer steps (about a minute)")
    parser.add_argument("--json", type=str, default=None)
    parser.add_argument("--horizon", type=int, default=200)
    parser.add_argument(
        "--scale",
        type=float,
        default=0.1,
        help="synthetic table sizes = Criteo Kaggle sizes x scale (at least 3 rows); 0.1 = 3.38 M rows",
    )
    parser.add_argument("--batch", type=int, default=4096, help="synthetic batch size")
    parser.add_argument("--steps", type=int, default=None, help="synthetic steps (default 400, --quick 120)")
    parser.add_argument("--no-real", action="store_true", help="skip the real data samples")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    fractions = [0.01, 0.05, 0.10]
    srows = [max(3, int(r * args.scale)) for r in KAGGLE_ROWS]
    steps = args.steps or (120 if args.quick else 400)
    batch = args.batch
    names = table_names()
    synth = criteo_batches(steps, batch, srows, seed=1)
    results: Dict[str, Any] = {"datasets": {}}
    results["datasets"]["synthetic criteo-shaped"] = run_dataset(
        "synthetic", synth, dict(zip(names, srows)), args.horizon, fractions
    )
    for name, (rows, cols, b) in ({} if args.no_real else real_datasets(args.quick)).items():
        batches, sizes = to_batches(rows, cols, b)
        results["datasets"][name] = run_dataset(name, batches, sizes, args.horizon, fractions)
    table3 = {}
    for h in (5, 10, 50, 100, 200, 300):
        if h >= steps:
            continue
        cfg = OracleConfig(
            capacity=dict(zip(names, srows)), num_embeddings=dict(zip(names, srows)), horizon=h, policy="ttl"
        )
        table3[h] = traffic(synth, cfg)
    results["ttl_vs_horizon"] = table3
    s5 = results["datasets"]["synthetic criteo-shaped"]["results"]["5pct"]
    results["belady_over_lru_5pct"] = s5["belady"]["fetch_per_step"] / s5["lru"]["fetch_per_step"]
    comp = results["datasets"]["synthetic criteo-shaped"]["results"]["compulsory"]["fetch_per_step"]
    results["belady_over_lru_5pct_above_compulsory"] = (s5["belady"]["fetch_per_step"] - comp) / (
        s5["lru"]["fetch_per_step"] - comp
    )
    results["synthetic"] = {"scale": args.scale, "batch": batch, "steps": steps, "rows": sum(srows)}
    results["seconds"] = time.perf_counter() - start

    for dname, d in results["datasets"].items():
        print(f"\n{dname}: {d['steps']} steps, {d['rows']} rows, horizon {d['horizon']}")
        r = d["results"]
        print(f"  {'policy':<10}{'capacity':>10}{'fetch/step':>12}{'wb/step':>10}")
        print(
            f"  {'none':<10}{'-':>10}{r['none']['fetch_per_step']:>12.0f}{r['none']['writeback_per_step']:>10.0f}"
        )
        print(f"  {'compulsory':<10}{'-':>10}{r['compulsory']['fetch_per_step']:>12.0f}{'-':>10}")
        print(
            f"  {'ttl':<10}{'peak ' + str(r['ttl']['peak_rows']):>10}{r['ttl']['fetch_per_step']:>12.0f}"
            f"{r['ttl']['writeback_per_step']:>10.0f}"
        )
        for frac in ("1pct", "5pct", "10pct"):
            res = r[frac]
            for pol in ("belady", "lru", "window"):
                x = res[pol]
                if "error" in x:
                    print(f"  {pol:<10}{frac:>10}  {x['error'][:70]}")
                else:
                    print(
                        f"  {pol:<10}{frac:>10}{x['fetch_per_step']:>12.0f}{x['writeback_per_step']:>10.0f}"
                    )
            print(
                f"  ({frac}: capacity {res['capacity_rows']} rows; {res['bumped_tables']} of {d['tables']} "
                f"tables bumped to their prefetch working set ({res['bumped_tables'] - res['bumped_partial_tables']} "
                f"of them held whole), {res['bumped_large_tables']} of the {res['large_tables']} tables of >= "
                f"{LARGE:,} rows; window: "
                f"{res['window_bumped_tables']} tables bumped to 2x the {WINDOW}-batch working set, "
                f"{res['window_capacity_rows']} rows)"
            )
    print("\nttl (Bagpipe Table 3 shape), synthetic: horizon -> peak rows, fetch/step")
    for h, x in table3.items():
        print(f"  {h:>4} {x['peak_rows']:>10} {x['fetch_per_step']:>10.0f}")
    print(
        f"\nsynthetic: Kaggle sizes x {args.scale} ({sum(srows):,} rows), batch {batch}, {steps} steps; "
        f"{results['seconds']:.0f} s"
    )
    print(f"belady / lru fetches at 5% (synthetic): {results['belady_over_lru_5pct']:.3f}")
    print(
        "belady / lru fetches at 5% above the compulsory first-touch fetches: "
        f"{results['belady_over_lru_5pct_above_compulsory']:.3f}"
    )
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
