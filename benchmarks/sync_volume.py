"""Rows synchronised per step by W data-parallel ranks: replicated cache vs LRPP, from the oracle's plans.

W ranks are simulated in one process: one oracle with ``num_ranks=W`` plans the global batch and every
``TablePlan`` carries a ``RankAnnotation`` (which ranks' ``tensor_split`` slice reads each unique id). Per
step, summed over the tables:

* replicated: a replicated cache all-reduces every touched row = unique ids of the global batch;
* LRPP: rows read by two or more ranks (popcount(reader_mask) >= 2), summed in one compacted collective;
* critical: ``shared_next`` rows, shared and needed at the next step, which cannot be delayed;
* delayed: ``shared_delayed`` rows, synchronised in the background;
* skipped: ``single_rank`` rows, updated by their only reader, never synchronised.

Data: Criteo-Kaggle-shaped synthetic ids (``benchmarks/_zipf.py``: the 26 published Kaggle cardinalities,
33.76 M rows, bounded Zipf 1.05 per table, single-hot, ``--scale`` to shrink the tables), global batch 16,384
split over W = 2, 4, 8 ranks. The oracle's capacity is ``min(rows, 4 x batch)`` per table (at least twice the
two-batch working set); only the annotations are used. The first ``--warmup`` steps and the last step (no
next batch, so nothing can be "needed at the next step") are left out of the averages.

A naive numpy recount (per-rank ``np.unique`` and ``np.isin``) is checked against the annotations on a few
steps of every W, and on a small uneven multi-hot batch (B % W != 0, two features sharing a table).

``--gloo`` also spawns 2 gloo processes on 127.0.0.1 and times, per step, an ``all_reduce`` of a float32
buffer of (replicated rows x 16) vs (LRPP rows x 16) vs (critical rows x 16), with the W=2 per-step counts;
and a step with delayed synchronisation off (every LRPP row blocking) vs on (critical rows blocking, delayed
rows async on a second group, waited for after ``--gap-ms`` standing for the rest of the step).

    python benchmarks/sync_volume.py [--quick] [--json PATH] [--gloo [--gap-ms 20]] [--scale 1.0] [--batch 16384]
"""

from __future__ import annotations

import csv
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import free_port, machine, median, parser, table, write_json  # noqa: E402
from benchmarks._zipf import KAGGLE_ROWS, table_names, zipf_ids  # noqa: E402
from torchrec_lookahead._arrays import sorted_unique  # noqa: E402
from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig, RankAnnotation  # noqa: E402

HEAD = (
    Path(__file__).resolve().parents[2]
    / "shared"
    / "data"
    / "criteo_kaggle_head"
    / "head8000_split_train.txt"
)
DIM = 16  # embedding dimension of the gloo buffers
SMALL = 16_384  # tables with fewer rows than this are "small" in the breakdown
KINDS = ("replicated", "lrpp", "critical", "delayed", "skipped", "all_ranks", "refresh")
# a batch as the oracle takes it: feature -> (ids, lengths)
Batch = Dict[str, Tuple[torch.Tensor, torch.Tensor]]


# ---------------------------------------------------------------------------------------------- data
def make_batches(steps: int, batch: int, rows: Sequence[int], seed: int, alpha: float) -> List[Batch]:
    """``steps`` single-hot batches, ``feature -> (ids, lengths of ones)`` (same ids as ``criteo_batches``)."""
    rng = np.random.default_rng(seed)
    per_table = [zipf_ids(rng, int(n), steps * batch, alpha).reshape(steps, batch) for n in rows]
    ones = torch.ones(batch, dtype=torch.int64)
    names = table_names(len(rows))
    return [
        {name: (torch.from_numpy(per_table[i][t]), ones) for i, name in enumerate(names)}
        for t in range(steps)
    ]


def criteo_head(path: Path, batch: int) -> Tuple[List[Batch], Dict[str, int]]:
    """The 26 categorical columns of a Criteo Kaggle sample (file order), relabelled 0..n-1 per column."""
    with open(path, newline="") as f:
        lines = [r for r in csv.reader(f, delimiter="\t") if len(r) >= 40]
    names = [f"c{j}" for j in range(26)]
    cols, rows = {}, {}
    for j, name in enumerate(names):
        _, inv = np.unique(np.array([r[14 + j] for r in lines]), return_inverse=True)
        cols[name], rows[name] = inv.astype(np.int64), int(inv.max()) + 1
    ones = torch.ones(batch, dtype=torch.int64)
    steps = len(lines) // batch
    out = [
        {n: (torch.from_numpy(cols[n][t * batch : (t + 1) * batch].copy()), ones) for n in names}
        for t in range(steps)
    ]
    return out, rows


def non_singleton(batches: Sequence[Batch]) -> float:
    """Mean over ``batches`` of the ids occurring at least twice in the global batch, summed over tables:
    the most rows any W can find shared (an id seen once has one reader)."""
    tot = 0
    for b in batches:
        for ids, _ in b.values():
            _, counts = np.unique(ids.numpy(), return_counts=True)
            tot += int(np.count_nonzero(counts >= 2))
    return tot / max(len(batches), 1)


# ------------------------------------------------------------------------------------------ counting
def multi_bit(mask: np.ndarray) -> np.ndarray:
    """popcount(mask) >= 2, elementwise."""
    return (mask & (mask - 1)) != 0


def count_plan(ann: RankAnnotation, num_ranks: int) -> Dict[str, int]:
    mask = ann.reader_mask.numpy()
    shared = multi_bit(mask)
    single = ann.single_rank.numpy()
    nxt = ann.shared_next.numpy()
    dly = ann.shared_delayed.numpy()
    # internal consistency of one annotation: the three classes partition the unique ids
    assert np.array_equal(single, ~shared), "single_rank is not popcount(reader_mask) == 1"
    assert not np.any(nxt & dly) and np.array_equal(nxt | dly, shared), (
        "shared_next/delayed do not split shared"
    )
    assert np.all(mask > 0) and np.all(mask < (1 << num_ranks)), "reader_mask has no bit or a bit >= W"
    return {
        "replicated": int(mask.size),
        "lrpp": int(shared.sum()),
        "critical": int(nxt.sum()),
        "delayed": int(dly.sum()),
        "skipped": int(single.sum()),
        "all_ranks": int(np.count_nonzero(mask == (1 << num_ranks) - 1)),
    }


def count_refresh(ann: RankAnnotation, last: np.ndarray) -> int:
    """Rows whose previous use was single-rank (by rank r) and that a rank other than r reads now.

    Such a row was updated locally by r only, so the replica of the new reader is stale: it must be refreshed
    (written back by r, fetched by the new reader) before this step. ``last[id]`` holds the previous sole
    reader's bit (0: never seen, or last synchronised by a collective); it is updated in place.
    """
    ids = ann.unique_ids.numpy()
    mask = ann.reader_mask.numpy()
    prev = last[ids]
    stale = int(np.count_nonzero((prev != 0) & ((mask & ~prev) != 0)))
    last[ids] = np.where(ann.single_rank.numpy(), mask, 0)
    return stale


def naive_annotation(
    feats: Sequence[Tuple[np.ndarray, np.ndarray]], nxt_ids: Optional[np.ndarray], batch: int, num_ranks: int
) -> Dict[str, np.ndarray]:
    """Recount one table from scratch: ``feats`` are the (ids, lengths) of the features of the table,
    ``nxt_ids`` every id of the table in the next batch (``None`` at the end of the stream)."""
    bounds = [s.size for s in np.array_split(np.arange(batch), num_ranks)]  # tensor_split slice sizes
    ends = np.cumsum([0] + bounds)
    per_rank: List[List[np.ndarray]] = [[] for _ in range(num_ranks)]
    for ids, lengths in feats:
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for r in range(num_ranks):
            per_rank[r].append(ids[offsets[ends[r]] : offsets[ends[r + 1]]])
    rank_ids = [sorted_unique(np.concatenate(p)) for p in per_rank]
    uniq = sorted_unique(np.concatenate([f[0] for f in feats]))
    mask = np.zeros(uniq.size, dtype=np.int64)
    nreaders = np.zeros(uniq.size, dtype=np.int64)
    for r in range(num_ranks):
        hit = np.isin(uniq, rank_ids[r])
        mask[hit] |= 1 << r
        nreaders += hit
    needed = np.isin(uniq, nxt_ids) if nxt_ids is not None else np.zeros(uniq.size, dtype=bool)
    shared = nreaders >= 2
    return {
        "unique_ids": uniq,
        "reader_mask": mask,
        "single_rank": nreaders == 1,
        "shared_next": shared & needed,
        "shared_delayed": shared & ~needed,
    }


def check_annotation(ann: RankAnnotation, want: Dict[str, np.ndarray], where: str) -> None:
    for key, expected in want.items():
        got = getattr(ann, key).numpy()
        if not np.array_equal(got, expected):
            bad = int(np.count_nonzero(got != expected)) if got.shape == expected.shape else -1
            raise AssertionError(
                f"{where}: annotation field {key} differs from the naive recount ({bad} ids)"
            )


def check_uneven(seed: int = 7) -> str:
    """Small multi-hot batches with B % W != 0 and two features sharing one table, against the recount."""
    rng = np.random.default_rng(seed)
    batch, steps, rows = 1001, 4, 500
    batches = []
    for _ in range(steps):
        b = {}
        for f in ("f_a", "f_b"):
            lengths = rng.integers(0, 4, size=batch)
            ids = rng.integers(0, rows, size=int(lengths.sum()))
            b[f] = (torch.from_numpy(ids), torch.from_numpy(lengths))
        batches.append(b)
    for w in (3, 7):
        cfg = OracleConfig(
            capacity={"t": rows},
            num_embeddings={"t": rows},
            horizon=2,
            num_ranks=w,
            feature_to_table={"f_a": "t", "f_b": "t"},
        )
        for plan in LookaheadOracle(cfg).plan_stream(batches):
            t = plan.step
            feats = [(batches[t][f][0].numpy(), batches[t][f][1].numpy()) for f in ("f_a", "f_b")]
            nxt = None
            if t + 1 < steps:
                nxt = np.concatenate([batches[t + 1][f][0].numpy() for f in ("f_a", "f_b")])
            check_annotation(
                plan.tables["t"].ranks, naive_annotation(feats, nxt, batch, w), f"uneven W={w} step {t}"
            )
    return f"uneven multi-hot check passed (B={batch}, W=3 and 7, two features on one table, {steps} steps)"


# -------------------------------------------------------------------------------------------- oracle
def simulate(
    batches: List[Batch],
    rows: Mapping[str, int],
    batch: int,
    num_ranks: int,
    warmup: int,
    check_steps: Sequence[int],
) -> Dict[str, Any]:
    """Run the oracle with ``num_ranks`` over the stream; per-step counts summed over tables."""
    cfg = OracleConfig(
        capacity={t: min(n, 4 * batch) for t, n in rows.items()},
        num_embeddings=dict(rows),
        horizon=2,
        prefetch_depth=1,
        num_ranks=num_ranks,
    )
    oracle = LookaheadOracle(cfg)
    per_step: List[Dict[str, int]] = []
    small = {k: 0 for k in ("replicated", "lrpp", "critical")}
    checked = 0
    last = {name: np.zeros(n, dtype=np.int64) for name, n in rows.items()}
    start = time.perf_counter()
    for plan in oracle.plan_stream(batches):
        t = plan.step
        tot = dict.fromkeys(KINDS, 0)
        in_avg = warmup <= t < len(batches) - 1
        for name, tp in plan.tables.items():
            assert tp.ranks is not None, "num_ranks > 1 but the plan has no RankAnnotation"
            c = count_plan(tp.ranks, num_ranks)
            c["refresh"] = count_refresh(tp.ranks, last[name])
            for k in KINDS:
                tot[k] += c[k]
            if in_avg and rows[name] < SMALL:
                for k in small:
                    small[k] += c[k]
            if t in check_steps:
                ids, lengths = batches[t][name]
                nxt = batches[t + 1][name][0].numpy() if t + 1 < len(batches) else None
                want = naive_annotation([(ids.numpy(), lengths.numpy())], nxt, batch, num_ranks)
                check_annotation(tp.ranks, want, f"W={num_ranks} step {t} table {name}")
                checked += 1
        per_step.append(tot)
    seconds = time.perf_counter() - start
    avg_steps = per_step[warmup:-1]
    mean = {k: float(np.mean([s[k] for s in avg_steps])) for k in KINDS}
    n = len(avg_steps)
    return {
        "per_step": per_step,
        "mean": mean,
        "small_tables_mean": {k: v / n for k, v in small.items()},
        "checked_tables": checked,
        "last_step_critical": per_step[-1]["critical"],
        "seconds": seconds,
    }


def rank_rows(sims: Mapping[int, Dict[str, Any]], batch: int) -> List[Dict[str, Any]]:
    out = []
    for w, s in sims.items():
        m = s["mean"]
        out.append(
            {
                "W": w,
                "per-rank batch": batch // w,
                "replicated": m["replicated"],
                "LRPP": m["lrpp"],
                "critical": m["critical"],
                "delayed": m["delayed"],
                "skipped": m["skipped"],
                "read by all W": m["all_ranks"],
                "refresh": m["refresh"],
                "LRPP/repl": m["lrpp"] / m["replicated"],
                "crit/repl": m["critical"] / m["replicated"],
            }
        )
    return out


# ---------------------------------------------------------------------------------------------- gloo
def _gloo_worker(
    rank: int, port: int, sizes: Dict[str, List[int]], warmup: int, gap_ms: float, queue: Any
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=120),
    )
    try:
        biggest = max(max(v) for v in sizes.values())
        pool = torch.randn(biggest * DIM)
        times: Dict[str, List[float]] = {k: [] for k in sizes}
        steps = len(next(iter(sizes.values())))
        for t in range(steps):
            for kind, rows in sizes.items():  # interleaved, so that load drifts hit every kind alike
                buf = pool[: rows[t] * DIM]
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(buf)
                dt = time.perf_counter() - t0
                if t >= warmup:
                    times[kind].append(dt * 1e3)
        # Delayed synchronisation off vs on, per step: off = one blocking all_reduce of every shared row; on =
        # a blocking all_reduce of the critical rows, then an async one of the delayed rows on a group of its
        # own, waited for after the rest of the step (a sleep of gap_ms standing for the dense backward and
        # optimizer step, i.e. ideal overlap). "blocked" = time the training thread waits on collectives.
        group = dist.new_group(backend="gloo")
        second = torch.randn(biggest * DIM)
        for kind in ("step_off", "step_on", "blocked_off", "blocked_on"):
            times[kind] = []
        for t in range(steps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(pool[: sizes["lrpp"][t] * DIM])
            t1 = time.perf_counter()
            time.sleep(gap_ms / 1e3)
            t2 = time.perf_counter()
            dist.barrier()
            t3 = time.perf_counter()
            dist.all_reduce(pool[: sizes["critical"][t] * DIM])
            delayed = sizes["lrpp"][t] - sizes["critical"][t]
            work = dist.all_reduce(second[: delayed * DIM], group=group, async_op=True) if delayed else None
            t4 = time.perf_counter()
            time.sleep(gap_ms / 1e3)
            t5 = time.perf_counter()
            if work is not None:
                work.wait()
            t6 = time.perf_counter()
            if t >= warmup:
                times["blocked_off"].append((t1 - t0) * 1e3)
                times["step_off"].append((t2 - t0) * 1e3)
                times["blocked_on"].append((t4 - t3 + t6 - t5) * 1e3)
                times["step_on"].append((t6 - t3) * 1e3)
        if rank == 0:
            queue.put({k: median(v) for k, v in times.items()})
    finally:
        dist.destroy_process_group()


def gloo_times(sizes: Dict[str, List[int]], warmup: int, gap_ms: float = 20.0) -> Dict[str, float]:
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_gloo_worker, args=(free_port(), sizes, warmup, gap_ms, queue), nprocs=2, join=True)
    return queue.get()


# ---------------------------------------------------------------------------------------------- main
def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = parser(__doc__)
    p.add_argument("--gloo", action="store_true", help="also time all_reduce on 2 gloo processes")
    p.add_argument(
        "--gap-ms",
        type=float,
        default=20.0,
        help="--gloo: rest of a training step (a sleep) that the delayed all_reduce overlaps",
    )
    p.add_argument("--scale", type=float, default=1.0, help="table sizes = Kaggle sizes x scale (min 3 rows)")
    p.add_argument("--batch", type=int, default=16_384, help="global batch, split over the W ranks")
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent")
    p.add_argument("--steps", type=int, default=None, help="averaged steps (default 100, --quick 12)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out at the start")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--real", action="store_true", help="also the Criteo Kaggle head sample, batch 2,048")
    p.add_argument("--criteo-head", type=Path, default=HEAD, help="path of the Criteo head sample (--real)")
    args = p.parse_args(argv)
    start = time.perf_counter()
    steps = args.steps or (12 if args.quick else 100)
    total = args.warmup + steps + 1  # + the last step, which has no next batch
    srows = [max(3, int(round(r * args.scale))) for r in KAGGLE_ROWS]
    rows = dict(zip(table_names(len(srows)), srows))
    ranks = sorted(set(args.ranks) | ({2} if args.gloo else set()))

    print(check_uneven())
    batches = make_batches(total, args.batch, srows, args.seed, args.alpha)
    check_steps = (args.warmup, args.warmup + 1, total - 1)
    sims = {w: simulate(batches, rows, args.batch, w, args.warmup, check_steps) for w in ranks}
    print(
        f"naive recount matches the annotations on steps {list(check_steps)} of every table for W = "
        f"{', '.join(map(str, ranks))}; the last step has {sims[ranks[0]]['last_step_critical']} critical rows"
    )

    multi = non_singleton(batches[args.warmup : -1])
    print(
        f"\nrows synchronised per step, mean of {steps} steps after {args.warmup} warm-up steps; "
        f"{len(srows)} tables, {sum(srows):,} rows (Kaggle x {args.scale}), Zipf {args.alpha}, "
        f"global batch {args.batch:,}"
    )
    print(table(rank_rows(sims, args.batch)))
    repl = sims[ranks[0]]["mean"]["replicated"]
    print(
        f"ids occurring >= 2 times in the global batch (LRPP's limit as W grows): {multi:,.0f} per step, "
        f"{multi / repl:.3f} of replicated"
    )
    small_rows = []
    for w, s in sims.items():
        sm, m = s["small_tables_mean"], s["mean"]
        small_rows.append(
            {
                "W": w,
                f"repl (tables < {SMALL:,} rows)": sm["replicated"],
                "LRPP (small)": sm["lrpp"],
                "critical (small)": sm["critical"],
                "LRPP/repl (large tables only)": (m["lrpp"] - sm["lrpp"])
                / (m["replicated"] - sm["replicated"]),
                "crit/repl (large only)": (m["critical"] - sm["critical"])
                / (m["replicated"] - sm["replicated"]),
            }
        )
    print(f"\nshare of the {sum(1 for r in srows if r < SMALL)} small tables")
    print(table(small_rows))

    figures: Dict[str, Any] = {
        "config": {
            "tables": len(srows),
            "rows": sum(srows),
            "scale": args.scale,
            "alpha": args.alpha,
            "global_batch": args.batch,
            "steps": steps,
            "warmup": args.warmup,
            "oracle": "belady, horizon 2, prefetch_depth 1, capacity min(rows, 4 x batch)",
        },
        "lrpp_over_replicated": {
            str(w): s["mean"]["lrpp"] / s["mean"]["replicated"] for w, s in sims.items()
        },
        "critical_over_replicated": {
            str(w): s["mean"]["critical"] / s["mean"]["replicated"] for w, s in sims.items()
        },
        "rows_per_step": {str(w): s["mean"] for w, s in sims.items()},
        "small_tables_rows_per_step": {str(w): s["small_tables_mean"] for w, s in sims.items()},
        "oracle_seconds": {str(w): s["seconds"] for w, s in sims.items()},
        "naive_check_steps": list(check_steps),
        "non_singleton_per_step": multi,
        "non_singleton_over_replicated": multi / repl,
    }
    if args.real:
        if not args.criteo_head.exists():
            print(f"\nskipping --real: {args.criteo_head} is absent")
        else:
            hb = min(args.batch, 2048)
            real, hrows = criteo_head(args.criteo_head, hb)
            rs = {w: simulate(real, hrows, hb, w, 0, (0, len(real) - 1)) for w in ranks}
            hm = non_singleton(real[:-1])
            print(
                f"\nreal Criteo Kaggle head ({args.criteo_head.name}): {len(real)} batches of {hb}, mean of the "
                f"first {len(real) - 1} (the last has no next batch); naive recount matches"
            )
            print(table(rank_rows(rs, hb)))
            print(
                f"ids occurring >= 2 times in the global batch: {hm / rs[ranks[0]]['mean']['replicated']:.3f}"
            )
            figures["criteo_head"] = {
                "batch": hb,
                "steps": len(real) - 1,
                "lrpp_over_replicated": {
                    str(w): s["mean"]["lrpp"] / s["mean"]["replicated"] for w, s in rs.items()
                },
                "critical_over_replicated": {
                    str(w): s["mean"]["critical"] / s["mean"]["replicated"] for w, s in rs.items()
                },
                "rows_per_step": {str(w): s["mean"] for w, s in rs.items()},
                "non_singleton_per_step": hm,
            }
    if args.gloo:
        per = sims[2]["per_step"][args.warmup : -1]
        sizes = {k: [s[k] for s in per] for k in ("replicated", "lrpp", "critical")}
        g = gloo_times(sizes, warmup=min(3, len(per) // 4), gap_ms=args.gap_ms)
        figures["gloo_ms_replicated"] = g["replicated"]
        figures["gloo_ms_lrpp"] = g["lrpp"]
        figures["gloo_ms_critical"] = g["critical"]
        figures["gloo_rows"] = {k: float(np.mean(v)) for k, v in sizes.items()}
        print(
            f"\n2 gloo ranks (127.0.0.1, 1 thread each), all_reduce float32 rows x {DIM}, median of "
            f"{len(per) - min(3, len(per) // 4)} steps (W=2 per-step row counts):"
        )
        print(
            table(
                [
                    {"buffer": k, "rows (mean)": figures["gloo_rows"][k], "ms (median)": g[k]}
                    for k in ("replicated", "lrpp", "critical")
                ]
            )
        )
        figures["gloo_delayed_sync"] = {
            "gap_ms": args.gap_ms,
            "critical_path_rows_off": figures["gloo_rows"]["lrpp"],
            "critical_path_rows_on": figures["gloo_rows"]["critical"],
            "blocked_ms_off": g["blocked_off"],
            "blocked_ms_on": g["blocked_on"],
            "step_ms_off": g["step_off"],
            "step_ms_on": g["step_on"],
        }
        print(
            f"\ndelayed synchronisation on 2 gloo ranks: per step, one blocking all_reduce of every shared row "
            f"(off) vs the critical rows blocking + the delayed rows async on their own group, waited for after "
            f"the rest of the step (on; a {args.gap_ms:g} ms sleep); medians:"
        )
        print(
            table(
                [
                    {"delayed sync": mode, "critical-path rows": figures["gloo_rows"][rows],
                     "blocked in collectives ms": g[f"blocked_{mode}"], "step ms": g[f"step_{mode}"]}
                    for mode, rows in (("off", "lrpp"), ("on", "critical"))
                ]
            )
        )  # fmt: skip
    figures["seconds"] = time.perf_counter() - start
    print(f"\n{figures['seconds']:.0f} s; {machine()['cpu']}")
    write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
