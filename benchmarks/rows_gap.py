"""Rows fetched per step by the lookahead cache and by simulated LRU / set-associative / Belady caches of the same
size on the id stream of ``benchmarks/gpu.py --scale 1.0 --fraction F`` (CPU only, no training).

The stream is ``CriteoSyntheticDataset``'s training batches (the default config's batch size, Zipf exponent and
seed, Kaggle table sizes x ``--scale``); the cached tables and their capacities are gpu.py's (``capacities``:
``F`` of each table above ``--min-cached-rows`` rows, bumped to the oracle's minimum for ``prefetch_depth=1``).
Every cache starts cold at batch 0; the figures are means over batches ``warmup + 1 .. warmup + steps`` (gpu.py's
timed window). Caches:

* ``ours``: the lookahead cache as the product plans it by default (``LookaheadOracle`` with the slot spaces of
  ``CachedEmbeddingBagCollection``'s pooled layout for these tables, dimension 16: one cache of the summed
  capacities; the ``cached`` run's horizon 64, prefetch depth 1, Belady);
* ``ours_lru_past``: the same pooled cache with ``past_horizon="lru"``: the rows no batch within the horizon
  reads leave least recently used first, instead of by their reuse;
* ``ours_per_table``: the same oracle with ``cache_layout="per_table"``: one cache per table, gpu.py's per-table
  capacities;
* ``ours_shared``: the same oracle planning one table that concatenates the cached tables (ids offset), with the
  sum of the capacities: a check that the pooled cache plans exactly that;
* ``ours_planned``: the lookahead oracle per table, the same bytes split among the tables by the product's
  ``LookaheadPlanner`` (fetch curves on the first ``--plan-sample`` batches) instead of a fixed fraction each;
* ``lru_table``: fully associative LRU per table, the same per-table capacities;
* ``lru_shared``: fully associative LRU, one cache of the summed capacity (and of FBGEMM's slot count);
* ``setassoc_shared``: FBGEMM's LRU cache: one cache of ``--fbgemm-slots`` rows in sets of 32 ways, the set of a
  row a 64-bit murmur finaliser of its linear index modulo the sets, the ways used by the previous batch locked
  (the prefetch pipeline's lines of the batch in flight), a miss that finds no free way left uncached;
* ``min_table`` / ``min_shared``: Belady's offline MIN (evict the furthest next use over the whole stream), per
  table and shared: the floor for a cache of that size.

Each cache also reports ``link_rows_per_step`` and ``link_bytes_per_step``: rows over the link in both directions
(FBGEMM's misses that find no free way are read and updated in host memory: two transfers each).
``--equal-hbm`` adds ``ours_equal_hbm``: the pooled cache given the HBM bytes FBGEMM's whole footprint takes (its
cache, and the row-wise state of every row and its cache index, which live in HBM).

``--taobao`` replays the Taobao UserBehavior sample in time order (its three tables at TaobaoDataModule's default
sizes, batches of 512: 164 batches of which the first ``warmup + 1`` are left out) instead of the synthetic stream.

    python benchmarks/rows_gap.py [--scale 1.0] [--fraction 0.01] [--steps 200] [--warmup 5] [--zipf 1.05]
        [--taobao [CSV]] [--batch-size N] [--equal-hbm] [--json PATH]
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torchrec_lookahead._arrays import sorted_unique  # noqa: E402
from torchrec_lookahead.data import TaobaoDataModule  # noqa: E402
from torchrec_lookahead.data.readers import TAOBAO_FEATURES  # noqa: E402
from torchrec_lookahead.data.synthetic import CriteoSyntheticDataset, SyntheticCriteoConfig  # noqa: E402
from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig, min_capacity  # noqa: E402

INF = np.int64(1 << 62)
#: bytes of a row over the link: ours (16 floats and row-wise Adagrad's one), FBGEMM's cache (16 floats)
ROW_BYTES, ROW_BYTES_FBGEMM = 68, 64
#: FBGEMM's HBM bytes beside its cache rows: per table row its row-wise state (4 B), per cache slot its state
#: (``lxu_cache_state``, 8 B) and its weights (64 B)
FBGEMM_ROW_STATE_BYTES, FBGEMM_SLOT_BYTES = 4, 64 + 8


# ------------------------------------------------------------------------------------------------------- stream
def stream(
    scale: float, batches: int, batch_size: int = 2048, zipf: float = 1.05, seed: int = 0
) -> Tuple[Dict[str, int], List[Dict[str, np.ndarray]]]:
    """Table rows (``t_<feature>``) and, per batch, each table's ids (the default config's synthetic data)."""
    cfg = SyntheticCriteoConfig(
        batch_size=batch_size, num_batches=batches, scale=scale, min_rows=1000, zipf_exponent=zipf, seed=seed
    )
    ds = CriteoSyntheticDataset(cfg, "train")
    rows = {f"t_{f}": int(n) for f, n in ds.num_embeddings_per_feature().items()}
    out = []
    for b in ds:
        d = b.sparse_features.to_dict()
        out.append({f"t_{f}": d[f].values().numpy().astype(np.int64) for f in d})
    return rows, out


#: the Taobao sample beside the repository (``../shared/data``), and TaobaoDataModule's default table sizes
TAOBAO_CSV = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "..",
    "shared",
    "data",
    "taobao_userbehavior_head",
    "UserBehavior_head.csv",
)
TAOBAO_ROWS = {
    f"t_{f}": int(n)
    for f, n in zip(TAOBAO_FEATURES, inspect.signature(TaobaoDataModule).parameters["num_embeddings"].default)
}


def taobao_stream(path: str, batch_size: int) -> Tuple[Dict[str, int], List[Dict[str, np.ndarray]]]:
    """Table rows and per batch each table's ids of a Taobao UserBehavior file in time order (a stable sort by
    timestamp; ids modulo TaobaoDataModule's default sizes, as its parser takes them), whole batches only."""
    data = np.loadtxt(path, delimiter=",", dtype=np.int64, usecols=(0, 1, 2, 4), ndmin=2)
    data = data[np.argsort(data[:, 3], kind="stable")]
    ids = {t: data[:, i] % n for i, (t, n) in enumerate(TAOBAO_ROWS.items())}
    full = data.shape[0] // batch_size
    out = [{t: v[b * batch_size : (b + 1) * batch_size] for t, v in ids.items()} for b in range(full)]
    return dict(TAOBAO_ROWS), out


def capacities(
    rows: Dict[str, int], batches: List[Dict[str, np.ndarray]], fraction: float, min_cached_rows: int
) -> Tuple[Dict[str, int], Dict[str, int]]:
    """gpu.py's capacities (benchmarks._common.capacities, prefetch depth 1)."""
    cached = {t: n for t, n in rows.items() if n > min_cached_rows}
    cap = {t: max(1, int(n * fraction)) for t, n in cached.items()}
    need = min_capacity(({t: b[t] for t in cap} for b in batches), 1, OracleConfig(capacity=cap))
    bumped = {t: cap[t] for t in cap if cap[t] < need[t]}
    cap.update({t: need[t] for t in bumped})
    return cap, bumped


# ------------------------------------------------------------------------------------------------ the oracle
def run_oracle(
    batches: Sequence[Dict[str, np.ndarray]],
    capacity: Dict[str, int],
    rows: Dict[str, int],
    horizon: int,
    depth: int,
    cache_layout: str = "per_table",
    past_horizon: str = "reuse",
) -> Tuple[Dict[str, np.ndarray], Dict[str, np.ndarray]]:
    """Per table, rows fetched and rows evicted at each step by the lookahead oracle, with the slot spaces of
    the cache's ``cache_layout`` (every table of dimension 16, as gpu.py's)."""
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    from torchrec_lookahead.modules import CachedEmbeddingBagCollection

    configs = [
        EmbeddingBagConfig(name=t, embedding_dim=16, num_embeddings=rows[t], feature_names=[t]) for t in rows
    ]
    oracle = LookaheadOracle(
        OracleConfig(
            capacity=capacity,
            horizon=horizon,
            prefetch_depth=depth,
            policy="belady",
            num_embeddings={t: rows[t] for t in capacity},
            slot_spaces=CachedEmbeddingBagCollection.layout_slot_spaces(configs, capacity, cache_layout),
            past_horizon=past_horizon,
        )
    )
    fetch: Dict[str, List[int]] = {t: [] for t in capacity}
    evict: Dict[str, List[int]] = {t: [] for t in capacity}
    feed = ({t: torch.from_numpy(b[t]) for t in capacity} for b in batches)
    for plan in oracle.plan_stream(feed):
        for t, tp in plan.tables.items():
            fetch[t].append(tp.fetch_ids.numel())
            evict[t].append(tp.evict_ids.numel())
    return {t: np.array(fetch[t]) for t in capacity}, {t: np.array(evict[t]) for t in capacity}


def planned_capacities(
    batches: Sequence[Dict[str, np.ndarray]],
    capacity: Dict[str, int],
    rows: Dict[str, int],
    horizon: int,
    sample: int,
) -> Dict[str, int]:
    """The bytes of ``capacity`` (rows x 68 B: dim 16, row-wise Adagrad) split among its tables by the product's
    ``LookaheadPlanner`` (``benchmarks._common.planner_split``; a table it makes resident gets all its rows)."""
    import torch

    from benchmarks._common import planner_split

    feed = ({t: torch.from_numpy(b[t]) for t in capacity} for b in batches[:sample])
    plan = planner_split(
        rows, capacity, feed, 16, "rowwise_adagrad", horizon=horizon, num_sample_batches=sample
    )
    print(plan, flush=True)
    return {tp.name: int(tp.capacity) for tp in plan.tables}  # resident: capacity = rows


# ---------------------------------------------------------------------------------------- simulated caches
def uniques(
    batches: Sequence[Dict[str, np.ndarray]], tables: Sequence[str], offsets: Dict[str, int]
) -> List[np.ndarray]:
    """Per batch, the distinct linear ids (table offset + id) of ``tables``."""
    return [sorted_unique(np.concatenate([b[t] + offsets[t] for t in tables])) for b in batches]


def next_uses(us: Sequence[np.ndarray], n: int) -> List[np.ndarray]:
    """Per batch, the step at which each of its distinct ids occurs next (INF: never in the stream)."""
    seen = np.full(n, INF, dtype=np.int64)
    out: List[np.ndarray] = [np.empty(0, dtype=np.int64)] * len(us)
    for t in range(len(us) - 1, -1, -1):
        out[t] = seen[us[t]].copy()
        seen[us[t]] = t
    return out


def fully_assoc(
    us: Sequence[np.ndarray], n: int, cap: int, policy: str, nxt: Optional[Sequence[np.ndarray]] = None
) -> Tuple[np.ndarray, np.ndarray]:
    """Fetches and evictions per step of a fully associative cache of ``cap`` rows over ids ``< n``: ``lru``
    (evict the least recently used) or ``min`` (Belady: evict the furthest next use, then least recent); the
    ids of the current batch are never evicted."""
    resident = np.zeros(n, dtype=bool)
    last = np.full(n, -1, dtype=np.int64)
    if policy not in ("lru", "min") or (policy == "min") != (nxt is not None):
        raise ValueError(f"policy must be 'lru', or 'min' with next uses, but got {policy!r}")
    nu = np.full(n, INF, dtype=np.int64)
    res = np.empty(0, dtype=np.int64)
    fetched, evicted = np.zeros(len(us), dtype=np.int64), np.zeros(len(us), dtype=np.int64)
    for t, u in enumerate(us):
        miss = u[~resident[u]]
        last[u] = t
        if nxt is not None:
            nu[u] = nxt[t]
        over = res.size + miss.size - cap
        if over > 0:
            cand = res[last[res] < t]
            if over > cand.size:
                raise RuntimeError(f"step {t}: a batch of {u.size} distinct ids does not fit in {cap} rows")
            if policy == "lru":
                key = last[cand]  # ties: any order (ids of one batch)
            else:  # furthest next use first, ties least recent first: smallest key = best victim
                key = -np.minimum(nu[cand], 1 << 20) * (1 << 20) + last[cand]
            pick = cand[np.argpartition(key, over - 1)[:over]]
            resident[pick] = False
            evicted[t] = over
            keep = resident[res]
            res = res[keep]
        resident[miss] = True
        res = np.concatenate([res, miss])
        fetched[t] = miss.size
    return fetched, evicted


def _fmix64(x: np.ndarray) -> np.ndarray:
    """FBGEMM's cache_slot hash (murmur3's 64-bit finaliser), before the modulo."""
    h = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        h ^= h >> np.uint64(33)
        h *= np.uint64(0xFF51AFD7ED558CCD)
        h ^= h >> np.uint64(33)
        h *= np.uint64(0xC4CEB9FE1A85EC53)
        h ^= h >> np.uint64(33)
    return h


def set_assoc(
    us: Sequence[np.ndarray], n: int, slots: int, ways: int = 32, lock_prev: bool = True
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FBGEMM-like LRU set-associative cache: misses (rows fetched), evictions and conflict misses (no way free:
    read from host, not cached) per step."""
    sets = slots // ways
    way_id = np.full((sets, ways), -1, dtype=np.int64)
    way_ts = np.full((sets, ways), -(1 << 40), dtype=np.int64)
    slot_of = np.full(n, -1, dtype=np.int64)
    fetched, evicted, conflict = (np.zeros(len(us), dtype=np.int64) for _ in range(3))
    flat_id, flat_ts = way_id.reshape(-1), way_ts.reshape(-1)
    for t, u in enumerate(us):
        s = slot_of[u]
        hit = s >= 0
        flat_ts[s[hit]] = t
        miss = u[~hit]
        fetched[t] = miss.size
        if not miss.size:
            continue
        ms = (_fmix64(miss) % np.uint64(sets)).astype(np.int64)
        o = np.argsort(ms, kind="stable")
        miss, ms = miss[o], ms[o]
        rank = np.arange(ms.size) - np.searchsorted(ms, ms, side="left")
        floor = t - 1 if lock_prev else t  # ways used at t (and t - 1, locked) are not evictable
        evictable = (way_ts < floor).sum(axis=1)
        order = np.argsort(way_ts, axis=1, kind="stable")  # empty ways, then least recent first
        ok = rank < evictable[ms]
        conflict[t] = int((~ok).sum())
        target = ms[ok] * ways + order[ms[ok], rank[ok]]
        old = flat_id[target]
        occupied = old >= 0
        evicted[t] = int(occupied.sum())
        slot_of[old[occupied]] = -1
        flat_id[target] = miss[ok]
        flat_ts[target] = t
        slot_of[miss[ok]] = target
    return fetched, evicted, conflict


# --------------------------------------------------------------------------------------------------------- main
def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--fraction", type=float, default=0.01)
    p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the synthetic ids")
    p.add_argument(
        "--taobao",
        nargs="?",
        const=TAOBAO_CSV,
        default=None,
        help="replay a Taobao UserBehavior file in time order instead (default: the sample in ../shared/data); "
        "--steps is cut to the batches it holds",
    )
    p.add_argument(
        "--batch-size", type=int, default=None, help="rows per batch (default 2048; 512 with --taobao)"
    )
    p.add_argument(
        "--equal-hbm",
        action="store_true",
        help="also run the pooled cache with the HBM bytes FBGEMM's whole footprint takes (ours_equal_hbm)",
    )
    p.add_argument("--min-cached-rows", type=int, default=5000)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--horizon", type=int, default=64)
    p.add_argument(
        "--fbgemm-slots", type=int, default=None, help="FBGEMM's cache rows (default: k200.json's)"
    )
    p.add_argument("--plan-sample", type=int, default=50, help="LookaheadPlanner's sample batches")
    p.add_argument("--skip", nargs="*", default=[], help="caches not to simulate")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    nb = args.steps + args.warmup + 2
    if args.taobao is not None:
        if not os.path.isfile(args.taobao):
            raise SystemExit(f"rows_gap.py: no Taobao file at {args.taobao}; give its path after --taobao")
        rows, batches = taobao_stream(args.taobao, args.batch_size or 512)
        if len(batches) < args.warmup + 52:
            raise SystemExit(f"rows_gap.py: {args.taobao} holds {len(batches)} batches, too few to measure")
        batches = batches[:nb]
        args.steps = min(args.steps, len(batches) - args.warmup - 2)
        nb = len(batches)
    else:
        rows, batches = stream(args.scale, nb, batch_size=args.batch_size or 2048, zipf=args.zipf)
    cap, bumped = capacities(rows, batches, args.fraction, args.min_cached_rows)
    tables = sorted(cap)
    offsets, acc = {}, 0
    for t in tables:
        offsets[t], acc = acc, acc + rows[t]
    n = acc
    total = sum(cap.values())
    fbgemm = args.fbgemm_slots or ((int(total * 68 / 64) + 31) // 32 * 32)
    lo, hi = args.warmup + 1, args.warmup + 1 + args.steps  # the timed batches
    print(
        f"{len(batches)} batches, {len(tables)} cached tables, {n:,} rows, capacity {total:,} "
        f"(FBGEMM {fbgemm:,} slots); bumped {bumped}; {time.perf_counter() - t0:.0f} s",
        flush=True,
    )
    us_tab = {t: uniques(batches, [t], offsets) for t in tables}
    us_all = uniques(batches, tables, offsets)
    distinct = np.array([u.size for u in us_all])
    res: Dict[str, Any] = {
        "capacity": cap,
        "bumped_from": bumped,
        "fbgemm_slots": fbgemm,
        "window": [lo, hi],
        "distinct_per_step": float(distinct[lo:hi].mean()),
        "distinct_per_step_by_table": {t: float(np.mean([u.size for u in us_tab[t][lo:hi]])) for t in tables},
        "rows": {t: rows[t] for t in tables},
    }
    figs: Dict[str, Dict[str, Any]] = {}

    def record(
        name: str,
        fetched: np.ndarray,
        evicted: np.ndarray,
        by_table: Optional[Dict[str, Any]] = None,
        conflict: Optional[np.ndarray] = None,
        **extra: Any,
    ) -> None:
        f = fetched[lo:hi]
        # over the link: rows loaded and written back, and (FBGEMM) the rows a miss could not insert, read from
        # host memory and updated there; bytes: ours move a row's state with it (dim 16 + row-wise Adagrad's 1
        # float), FBGEMM's cache holds the weights only (its row-wise state stays in HBM)
        direct = np.zeros_like(fetched) if conflict is None else conflict
        link = (fetched + evicted + 2 * direct)[lo:hi]
        row_bytes = (
            ROW_BYTES_FBGEMM if conflict is not None or name.startswith(("lru", "setassoc")) else ROW_BYTES
        )
        rec: Dict[str, Any] = {
            "link_rows_per_step": float(link.mean()),
            "link_bytes_per_step": float(link.mean() * row_bytes),
            "fetched_per_step": float(f.mean()),
            "evicted_per_step": float(evicted[lo:hi].mean()),
            "hit_rate": float(1 - f.sum() / distinct[lo:hi].sum()),
            "fetched_first_30": float(fetched[lo : lo + 30].mean()),
            "fetched_last_50": float(fetched[hi - 50 : hi].mean()),
        }
        if by_table:
            rec["fetched_per_step_by_table"] = {
                t: float(np.asarray(v)[lo:hi].mean()) for t, v in by_table.items()
            }
        rec.update(extra)
        figs[name] = rec
        print(
            f"{name:>18}: {rec['fetched_per_step']:9.1f} rows/step in, {rec['evicted_per_step']:9.1f} out, "
            f"hit {rec['hit_rate']:.3f}  ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )

    def record_tables(name: str, fetched: Dict[str, np.ndarray], evicted: Dict[str, np.ndarray]) -> None:
        """:func:`record` of per-table figures: their sums, and the fetches per table."""
        added = np.sum(np.stack(list(fetched.values())), axis=0)
        record(name, added, np.sum(np.stack(list(evicted.values())), axis=0), fetched)

    # compulsory misses: first occurrence in the stream
    seen = np.zeros(n, dtype=bool)
    comp = np.zeros(nb, dtype=np.int64)
    for i, u in enumerate(us_all):
        comp[i] = int((~seen[u]).sum())
        seen[u] = True
    record("compulsory", comp, np.zeros(nb))
    if "ours" not in args.skip:
        record_tables("ours", *run_oracle(batches, cap, rows, args.horizon, 1, "pooled"))
    if args.equal_hbm:
        hbm = fbgemm * FBGEMM_SLOT_BYTES + n * FBGEMM_ROW_STATE_BYTES
        scale = hbm / (total * ROW_BYTES)
        big = {t: min(rows[t], int(c * scale)) for t, c in cap.items()}
        res["equal_hbm"] = {"fbgemm_hbm_bytes": hbm, "capacity": big, "scale": scale}
        record_tables("ours_equal_hbm", *run_oracle(batches, big, rows, args.horizon, 1, "pooled"))
    if "ours_lru_past" not in args.skip:
        record_tables("ours_lru_past", *run_oracle(batches, cap, rows, args.horizon, 1, "pooled", "lru"))
    if "ours_per_table" not in args.skip:
        record_tables("ours_per_table", *run_oracle(batches, cap, rows, args.horizon, 1))
    if "ours_shared" not in args.skip:
        order = [t for t in rows if t in cap]  # the pooled cache's member order (the tables' order)
        merged = [{"all": np.concatenate([b[t] + offsets[t] for t in order])} for b in batches]
        fe, ev = run_oracle(merged, {"all": total}, {"all": n}, args.horizon, 1)
        record("ours_shared", fe["all"], ev["all"])
    if "ours_planned" not in args.skip:
        planned = planned_capacities(batches, cap, rows, args.horizon, args.plan_sample)
        res["planned_capacity"] = planned
        record_tables("ours_planned", *run_oracle(batches, planned, rows, args.horizon, 1))
    if "lru_table" not in args.skip:
        lru = {t: fully_assoc(us_tab[t], n, cap[t], "lru") for t in tables}
        record_tables("lru_table", {t: v[0] for t, v in lru.items()}, {t: v[1] for t, v in lru.items()})
    if "lru_shared" not in args.skip:
        record("lru_shared", *fully_assoc(us_all, n, total, "lru"))
        record("lru_shared_fbgemm_slots", *fully_assoc(us_all, n, fbgemm, "lru"))
    if "setassoc_shared" not in args.skip:
        sa_in, sa_out, conflicts = set_assoc(us_all, n, fbgemm)
        record(
            "setassoc_shared",
            sa_in,
            sa_out,
            conflict=conflicts,
            conflict_per_step=float(conflicts[lo:hi].mean()),
        )
    if "min_table" not in args.skip:
        opt = {t: fully_assoc(us_tab[t], n, cap[t], "min", next_uses(us_tab[t], n)) for t in tables}
        record_tables("min_table", {t: v[0] for t, v in opt.items()}, {t: v[1] for t, v in opt.items()})
    if "min_shared" not in args.skip:
        nxt_all = next_uses(us_all, n)
        record("min_shared", *fully_assoc(us_all, n, total, "min", nxt_all))
        record("min_shared_fbgemm_slots", *fully_assoc(us_all, n, fbgemm, "min", nxt_all))
    res["caches"] = figs
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, sort_keys=True)
    return res


if __name__ == "__main__":
    main()
