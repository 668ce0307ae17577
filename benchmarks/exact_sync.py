"""What the exact multi-rank gradient synchronisation costs against the all-reduce of partial sums it replaced.

The LRPP cache on W ranks updates the rows that several ranks read from the gradients of the whole global batch.
Two ways, timed side by side per step in the same gloo processes (127.0.0.1, one thread each), on the default
job's data and cached tables:

* **exact** (what the cache does): ``exact_sync.exchange_index`` then ``exchange`` (one all-gather of the pooled-output
  gradients of other ranks' bags that hold a shared row, compacted, then the global bags keeping the ids of rows
  this rank holds) and the kernel's own FBGEMM backward over that batch (``_CacheKernel.apply_batch``): bit for
  bit TorchRec's sharded arithmetic. With delayed synchronisation on, the shared rows no rank reads at the next
  step go to a second, asynchronous all-gather; its landing (wait + a second ``apply_batch``) is timed apart.
* **partial** (what the cache did before): per-row sums of the local batch's gradients (``index_add_`` in bag
  order), one ``all_reduce`` of the shared rows' sums (float32, shared rows x 16, at least one element) and the
  row update: FBGEMM's ``apply_batch`` over one id per bag carrying the summed gradient (the same kernel as
  exact). Not bit-exact against TorchRec (the sums round differently). The update with the PyTorch kernel's
  ``_apply`` (what the old code ran) is timed apart as ``partial_torch_update``.

Data: the batches of ``configs/dlrm_lookahead.yaml``'s ``CriteoSyntheticDataModule`` (scale 0.01, min_rows 1000,
Zipf 1.05, seed 0, single-hot) at a global batch of 2,048 split over the W ranks, its five cached tables
(t_cat_2, t_cat_3, t_cat_11, t_cat_15, t_cat_20, dim 16, row-wise Adagrad lr 0.05) with the capacities doubled
for 2 ranks; ``LookaheadOracle(num_ranks=W)`` (belady, horizon 64, prefetch_depth 1) and ``LRPPTracker`` plan
the global batches. Each rank's pooled-output gradient is random (seeded per step and rank), divided by W as
TorchRec divides it. Every timed block starts after a barrier; the modes rotate their order from step to step.

Per step the slowest rank's time is taken (the step waits for it); the tables give medians over the steps.
``*_cpu``: CPU time of the rank's training thread in the same block (gloo's own threads not counted): what the
work costs apart from waiting for the peer and for a core.
Floats sent per rank: the payload (this rank's compacted gradients; exact checks it against an independent
numpy recount of the bags holding shared rows) and the wire volume: a gloo all-gather of unequal buffers pads
them to the largest and sends (W-1) x that size; a ring all-reduce sends about 2(W-1)/W x the buffer.

Check, on the first step (every kernel starts from the same weights): exact with delayed synchronisation on and
off update every row bit for bit alike; partial updates the same rows, to rounding.

    python benchmarks/exact_sync.py [--quick] [--json PATH] [--ranks 2 4] [--steps N] [--batch 2048]
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import free_port, machine, median, parser, table, write_json  # noqa: E402
from torchrec_lookahead._arrays import sorted_unique  # noqa: E402
from torchrec_lookahead.data.synthetic import CriteoSyntheticDataset, SyntheticCriteoConfig  # noqa: E402
from torchrec_lookahead.distributed.exact_sync import (  # noqa: E402
    ExchangeSpec,
    KernelLayout,
    exchange,
    exchange_index,
)
from torchrec_lookahead.distributed.lrpp import LRPPTracker, slice_samples  # noqa: E402
from torchrec_lookahead.modules import CacheOptimizerConfig, remap_kjt  # noqa: E402
from torchrec_lookahead.modules._kernels import make_kernel  # noqa: E402
from torchrec_lookahead.oracle import (  # noqa: E402
    LookaheadOracle,
    OracleConfig,
    table_ids,  # noqa: E402
)

DIM = 16
#: configs/dlrm_lookahead.yaml's cached tables, capacities doubled for 2 ranks
CAPACITY = {"t_cat_2": 10200, "t_cat_3": 4400, "t_cat_11": 8400, "t_cat_15": 5600, "t_cat_20": 7200}
FEATURES = [t[2:] for t in CAPACITY]
TABLES = list(CAPACITY)
F2T = dict(zip(FEATURES, TABLES))
LR = 0.05
MODES = ("exact_off", "exact_on", "partial")
#: per-step times every rank records, in milliseconds
PARTS = (
    "exact_off", "exact_off_exchange", "exact_off_apply", "exact_off_cpu", "exact_on", "exact_on_land",
    "exact_on_cpu", "partial", "partial_sums", "partial_all_reduce", "partial_update", "partial_torch_update",
    "partial_cpu",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------- plans
def plan_steps(total: int, batch: int, num_ranks: int, seed: int = 0) -> Tuple[List[Dict[str, Any]], float]:
    """Plan ``total`` global batches of the default job's data; per step the slot-remapped global batch of the
    cached features (values, lengths) and, per table, the shared and delayed slots. The oracle also sees one
    more batch, so that the last step has a next one. Returns the steps and the planning seconds."""
    cfg = SyntheticCriteoConfig(
        batch_size=batch, num_batches=total + 1, scale=0.01, min_rows=1000, zipf_exponent=1.05, seed=seed
    )
    data = CriteoSyntheticDataset(cfg)
    rows = data.num_embeddings_per_feature()
    kjts = [data.batch(i).sparse_features for i in range(total + 1)]
    kjts = [k.permute([k.keys().index(f) for f in FEATURES]) for k in kjts]
    oracle = LookaheadOracle(
        OracleConfig(
            capacity=dict(CAPACITY),
            num_embeddings={F2T[f]: rows[f] for f in FEATURES},
            horizon=64,
            prefetch_depth=1,
            policy="belady",
            num_ranks=num_ranks,
            feature_to_table=F2T,
        )
    )
    tracker = LRPPTracker(CAPACITY, num_ranks)
    steps = []
    start = time.perf_counter()
    for plan, kjt in zip(oracle.plan_stream(kjts), kjts):
        if plan.step >= total:
            break
        remapped = remap_kjt(kjt, plan, F2T, TABLES)
        lrpp = tracker.step(plan, table_ids(kjt, F2T, TABLES), features=remapped)
        steps.append(
            {
                "values": remapped.values().clone(),
                "lengths": remapped.lengths().clone(),
                "shared": [lrpp.tables[t].shared_slots.clone() for t in TABLES],
                "delayed": [lrpp.tables[t].delayed_slots.clone() for t in TABLES],
            }
        )
    return steps, time.perf_counter() - start


def payloads(step: Dict[str, Any], select: Sequence[torch.Tensor], num_ranks: int) -> np.ndarray:
    """Floats each rank contributes to the exchange all-gather of the rows ``select`` (per table, slots): its
    bags holding one of them x 16, counted from scratch (single-hot or multi-hot, one feature per table)."""
    batch = step["lengths"].numel() // len(FEATURES)
    local = batch // num_ranks
    values = step["values"].numpy()
    lengths = step["lengths"].numpy().reshape(len(FEATURES), batch)
    out = np.zeros(num_ranks, dtype=np.int64)
    start = 0
    for f in range(len(FEATURES)):
        n = int(lengths[f].sum())
        bag = np.repeat(np.arange(batch), lengths[f])
        hit = np.isin(values[start : start + n], select[f].numpy())
        out += np.bincount(sorted_unique(bag[hit]) // local, minlength=num_ranks) * DIM
        start += n
    return out


def volumes(step: Dict[str, Any], num_ranks: int) -> Dict[str, Any]:
    """Rows and floats of one step: payloads per rank and the wire volume sent per rank."""
    w = num_ranks
    shared, delayed = step["shared"], step["delayed"]
    critical = [s[~torch.isin(s, d)] for s, d in zip(shared, delayed)]
    off = payloads(step, shared, w)
    now, late = payloads(step, critical, w), payloads(step, delayed, w)
    rows = sum(int(s.numel()) for s in shared)
    rows_delayed = sum(int(d.numel()) for d in delayed)
    return {
        "rows_shared": rows,
        "rows_delayed": rows_delayed,
        "payload_off": off.tolist(),
        "payload_on": (now + late).tolist(),
        "payload_critical": now.tolist(),
        "payload_delayed": late.tolist(),
        "wire_exact_off": (w - 1) * max(int(off.max()), 1),
        "wire_exact_on": (w - 1) * max(int(now.max()), 1) + ((w - 1) * max(int(late.max()), 1) if rows_delayed else 0),
        "wire_partial": 2 * (w - 1) / w * max(rows * DIM, 1),
    }  # fmt: skip


# --------------------------------------------------------------------------------------------- worker
def _layout() -> KernelLayout:
    n = len(TABLES)
    return KernelLayout(
        features=list(FEATURES),
        feature_table=list(range(n)),
        tables=list(TABLES),
        capacity=[CAPACITY[t] for t in TABLES],
        dims=[DIM] * n,
        mean=False,
        weighted=False,
    )


def _kernel(kernel: str) -> Any:
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

    cfg = CacheOptimizerConfig("exact_row_wise_adagrad", learning_rate=LR, kernel=kernel)
    k = make_kernel([CAPACITY[t] for t in TABLES], [DIM] * len(TABLES), list(range(len(TABLES))),
                    PoolingMode.SUM, cfg, torch.device("cpu"), TABLES)  # fmt: skip
    g = torch.Generator().manual_seed(11)
    for t in range(len(TABLES)):  # the same weights in every kernel
        k.weights(t).copy_(torch.rand(CAPACITY[TABLES[t]], DIM, generator=g) * 0.02 - 0.01)
    return k


def _kernel_batch(kjt: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """A KJT as the kernel sees it in backward: flat indices and offsets, feature-major."""
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), kjt.lengths().cumsum(0)])
    return kjt.values(), offsets


def partial_sums(
    indices: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Per table (one feature each): the rows the local batch reads and their gradient sums in bag order."""
    nf = len(FEATURES)
    batch = (offsets.numel() - 1) // nf
    lengths = torch.diff(offsets)
    out = []
    for f in range(nf):
        lo, hi = int(offsets[f * batch]), int(offsets[(f + 1) * batch])
        bag = torch.repeat_interleave(torch.arange(batch), lengths[f * batch : (f + 1) * batch])
        uniq, inverse = torch.unique(indices[lo:hi], return_inverse=True)
        gsum = torch.zeros(uniq.numel(), DIM)
        gsum.index_add_(0, inverse, grad[:, f * DIM : (f + 1) * DIM].index_select(0, bag))
        out.append((uniq, gsum))
    return out


def all_reduce_shared(sums: List[Tuple[torch.Tensor, torch.Tensor]], shared: Sequence[torch.Tensor]) -> None:
    """The old synchronisation: one all-reduce of the shared rows' sums (zeros where this rank reads none)."""
    import torch.distributed as dist

    bases = np.concatenate([[0], np.cumsum([int(s.numel()) for s in shared])]).tolist()
    buf = torch.zeros(max(int(bases[-1]), 1), DIM)
    located = []
    for (uniq, gsum), s, base in zip(sums, shared, bases):
        pos = torch.searchsorted(s, uniq)
        hit = (pos < s.numel()) & (s[pos.clamp(max=max(s.numel() - 1, 0))] == uniq) if s.numel() else None
        if hit is not None and bool(hit.any()):
            buf[base + pos[hit]] = gsum[hit]
            located.append((gsum, hit, base + pos[hit]))
    dist.all_reduce(buf)
    for gsum, hit, rows in located:
        gsum[hit] = buf[rows]


def apply_sums(kernel: Any, sums: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The row update through the kernel's backward: one id per bag carrying its row's summed gradient (bags of
    shorter features padded empty)."""
    bags = max(max(int(u.numel()) for u, _ in sums), 1)
    lengths = torch.zeros(len(sums), bags, dtype=torch.int64)
    grad = torch.zeros(bags, len(sums) * DIM)
    for f, (uniq, gsum) in enumerate(sums):
        lengths[f, : uniq.numel()] = 1
        grad[: uniq.numel(), f * DIM : (f + 1) * DIM] = gsum
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.reshape(-1).cumsum(0)])
    kernel.apply_batch(torch.cat([u for u, _ in sums]), offsets, None, grad)


def _weights(kernel: Any) -> List[torch.Tensor]:
    return [kernel.weights(t).clone() for t in range(len(TABLES))]


def _first_step_check(kernels: Dict[str, Any], torch_kernel: Any) -> Dict[str, Any]:
    """After one step from the same weights: exact with delayed sync on vs off, partial vs exact."""
    off, on, part, tor = (_weights(k) for k in (kernels["exact_off"], kernels["exact_on"], kernels["partial"],
                                                 torch_kernel))  # fmt: skip
    base = _weights(_kernel("fbgemm"))

    def max_abs(xs: List[torch.Tensor]) -> float:
        return max(float((a - b).abs().max()) for a, b in zip(xs, off))

    return {
        "exact_on_vs_off_max_abs": max_abs(on),
        "partial_vs_exact_max_abs": max_abs(part),
        "partial_torch_vs_exact_max_abs": max_abs(tor),
        "rows_updated_exact": sum(int((a != b).any(1).sum()) for a, b in zip(off, base)),
        "same_rows_updated": all(
            torch.equal((a != c).any(1), (b != c).any(1)) for a, b, c in zip(off, part, base)
        ),
    }


def _time_partial(
    kernel: Any,
    torch_kernel: Any,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    grad: torch.Tensor,
    shared: Sequence[torch.Tensor],
) -> Dict[str, float]:
    """One step of the old synchronisation, timed in parts (seconds); the PyTorch update timed apart."""
    c0, t0 = time.thread_time(), time.perf_counter()
    sums = partial_sums(indices, offsets, grad)
    t1 = time.perf_counter()
    all_reduce_shared(sums, shared)
    t2 = time.perf_counter()
    apply_sums(kernel, sums)
    t3, c3 = time.perf_counter(), time.thread_time()
    for f, (uniq, gsum) in enumerate(sums):
        torch_kernel._apply(f, uniq, gsum)
    t4 = time.perf_counter()
    return {"partial": t3 - t0, "partial_sums": t1 - t0, "partial_all_reduce": t2 - t1,
            "partial_update": t3 - t2, "partial_torch_update": t4 - t3, "partial_cpu": c3 - c0}  # fmt: skip


def _time_exact(
    mode: str,
    kernel: Any,
    layout: KernelLayout,
    kjt: Any,
    grad: torch.Tensor,
    rank: int,
    world: int,
    shared: Sequence[torch.Tensor],
    delayed: Sequence[torch.Tensor],
    delayed_group: Any,
) -> Tuple[Dict[str, float], int]:
    """One step of the exact synchronisation as the backward hook runs it, timed in parts (seconds), then the
    delayed rows' landing (what ``apply_plan`` does before the next step); and the floats it reports sent."""
    c0, t0 = time.thread_time(), time.perf_counter()
    index = exchange_index(ExchangeSpec(layout, True), kjt, rank, world, shared, delayed)
    now, later, sent = exchange(index, grad, None, delayed_group)
    t1 = time.perf_counter()
    kernel.apply_batch(now.indices, now.offsets, now.weights, now.grad)
    t2, c2 = time.perf_counter(), time.thread_time()
    if later is not None:
        batch = later.batch()
        kernel.apply_batch(batch.indices, batch.offsets, batch.weights, batch.grad)
    t3 = time.perf_counter()
    if mode == "exact_on":
        return {"exact_on": t2 - t0, "exact_on_land": t3 - t2, "exact_on_cpu": c2 - c0}, sent
    return {
        "exact_off": t2 - t0,
        "exact_off_exchange": t1 - t0,
        "exact_off_apply": t2 - t1,
        "exact_off_cpu": c2 - c0,
    }, sent


def _worker(rank: int, world: int, port: int, steps: List[Dict[str, Any]], queue: Any) -> None:
    import torch.distributed as dist
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))  # fmt: skip
    try:
        delayed_group = dist.new_group(backend="gloo")
        layout = _layout()
        kernels = {mode: _kernel("fbgemm") for mode in MODES}
        torch_kernel = _kernel("torch")
        empty = [torch.zeros(0, dtype=torch.int64)] * len(TABLES)
        times: Dict[str, List[float]] = {k: [] for k in PARTS}
        sent: Dict[str, List[int]] = {"exact_off": [], "exact_on": []}
        check: Dict[str, Any] = {}
        for t, step in enumerate(steps):
            kjt = KeyedJaggedTensor(keys=FEATURES, values=step["values"], lengths=step["lengths"])
            local = int(step["lengths"].numel()) // len(FEATURES) // world
            indices, offsets = _kernel_batch(slice_samples(kjt, rank * local, (rank + 1) * local))
            g = torch.Generator().manual_seed(1000 * t + rank)
            grad = torch.randn(local, len(TABLES) * DIM, generator=g) / world
            for i in range(len(MODES)):
                mode = MODES[(t + i) % len(MODES)]
                dist.barrier()
                if mode == "partial":
                    parts = _time_partial(kernels[mode], torch_kernel, indices, offsets, grad, step["shared"])
                else:
                    delayed = step["delayed"] if mode == "exact_on" else empty
                    parts, n = _time_exact(mode, kernels[mode], layout, kjt, grad, rank, world, step["shared"],
                                           delayed, delayed_group)  # fmt: skip
                    sent[mode].append(n)
                for k, v in parts.items():
                    times[k].append(v * 1e3)
            if t == 0:  # every kernel started from the same weights
                check = _first_step_check(kernels, torch_kernel)
        queue.put({"rank": rank, "times": times, "sent": sent, "check": check})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(world: int, steps: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Spawn ``world`` gloo processes over ``steps``; every rank's record."""
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(world, free_port(), steps, queue), nprocs=world, join=True)
    out = [queue.get() for _ in range(world)]
    return sorted(out, key=lambda r: r["rank"])


# ----------------------------------------------------------------------------------------------- main
def summarise(
    world: int, steps: List[Dict[str, Any]], records: List[Dict[str, Any]], warmup: int
) -> Dict[str, Any]:
    """Medians over the timed steps of the slowest rank's time, the ratios, volumes and the first-step check."""
    vols = [volumes(s, world) for s in steps]
    for r in records:  # the payloads the exchange reports equal the recount
        for mode in ("off", "on"):
            got = r["sent"][f"exact_{mode}"]
            want = [v[f"payload_{mode}"][r["rank"]] for v in vols]
            if got != want:
                raise AssertionError(
                    f"W={world} rank {r['rank']}: exchange payloads {got[:5]} != recount {want[:5]}"
                )
    per_step = {k: np.max([r["times"][k] for r in records], axis=0)[warmup:] for k in PARTS}
    ms = {k: median(v.tolist()) for k, v in per_step.items()}
    timed = vols[warmup:]
    mean = {k: float(np.mean([v[k] for v in timed])) for k in ("rows_shared", "rows_delayed", "wire_exact_off",
                                                                "wire_exact_on", "wire_partial")}  # fmt: skip
    for k in ("payload_off", "payload_critical", "payload_delayed"):  # per rank
        mean[k] = float(np.mean([np.mean(v[k]) for v in timed]))
    checks = [r["check"] for r in records]
    if any(c["exact_on_vs_off_max_abs"] != 0.0 or not c["same_rows_updated"] for c in checks):
        raise AssertionError(f"W={world}: first-step check failed: {checks}")
    return {
        "world": world,
        "local_batch": int(steps[0]["lengths"].numel()) // len(FEATURES) // world,
        "timed_steps": len(timed),
        "ms": ms,
        "ratio_exact_off_over_partial": ms["exact_off"] / ms["partial"],
        "ratio_exact_on_over_partial": ms["exact_on"] / ms["partial"],
        "ratio_cpu_exact_off_over_partial": ms["exact_off_cpu"] / ms["partial_cpu"],
        "ratio_per_step_median": median((per_step["exact_off"] / per_step["partial"]).tolist()),
        "mean": mean,
        "wire_ratio_exact_off_over_partial": mean["wire_exact_off"] / mean["wire_partial"],
        "check": {
            "exact_on_vs_off_max_abs": max(c["exact_on_vs_off_max_abs"] for c in checks),
            "partial_vs_exact_max_abs": max(c["partial_vs_exact_max_abs"] for c in checks),
            "partial_torch_vs_exact_max_abs": max(c["partial_torch_vs_exact_max_abs"] for c in checks),
            "rows_updated_exact": [c["rows_updated_exact"] for c in checks],
        },
    }


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = parser(__doc__)
    p.add_argument("--ranks", type=int, nargs="+", default=None, help="world sizes (default 2 4; --quick 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 100, --quick 12)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out at the start")
    p.add_argument("--batch", type=int, default=2048, help="global batch, split over the W ranks")
    args = p.parse_args(argv)
    start = time.perf_counter()
    ranks = args.ranks or ([2] if args.quick else [2, 4])
    steps_n = args.steps if args.steps is not None else (12 if args.quick else 100)
    if any(w < 2 or args.batch % w for w in ranks):
        p.error(f"--ranks must be >= 2 and divide --batch {args.batch}, got {ranks}")
    if steps_n < 1 or args.warmup < 0:
        p.error(f"--steps must be >= 1 and --warmup >= 0, got {steps_n} and {args.warmup}")
    figures: Dict[str, Any] = {
        "config": {
            "data": "CriteoSyntheticDataModule scale 0.01, min_rows 1000, zipf 1.05, seed 0 "
            "(configs/dlrm_lookahead.yaml)",
            "global_batch": args.batch,
            "tables": dict(CAPACITY),
            "dim": DIM,
            "optimizer": f"row-wise Adagrad lr {LR}",
            "oracle": "belady, horizon 64, prefetch_depth 1",
            "steps": steps_n,
            "warmup": args.warmup,
        },
        "results": {},
    }  # fmt: skip
    rows = []
    for w in ranks:
        steps, plan_s = plan_steps(args.warmup + steps_n, args.batch, w)
        s = summarise(w, steps, run(w, steps), args.warmup)
        s["plan_seconds"] = plan_s
        figures["results"][str(w)] = s
        ms, m = s["ms"], s["mean"]
        rows.append(
            {"W": w, "rows shared": m["rows_shared"], "exact ms": ms["exact_off"], "exact+delayed ms": ms["exact_on"],
             "partial ms": ms["partial"], "exact/partial": s["ratio_exact_off_over_partial"],
             "exact+delayed/partial": s["ratio_exact_on_over_partial"],
             "CPU exact/partial": s["ratio_cpu_exact_off_over_partial"],
             "floats sent exact": m["wire_exact_off"], "exact+delayed": m["wire_exact_on"],
             "partial": m["wire_partial"]}
        )  # fmt: skip
    print(
        f"exact exchange batch vs all-reduce of partial sums; global batch {args.batch}, 5 cached tables x {DIM}, "
        f"medians over {steps_n} steps after {args.warmup} warm-up steps (slowest rank per step), gloo 127.0.0.1"
    )
    print(table(rows))
    print("\nwhere the time goes (ms, medians):")
    print(table([{"W": w, **s["ms"]} for w, s in figures["results"].items()]))
    for w, s in figures["results"].items():
        c = s["check"]
        print(
            f"W={w} first-step check: exact with delayed sync on == off bit for bit; partial updates the same "
            f"{c['rows_updated_exact']} rows, max |diff| {c['partial_vs_exact_max_abs']:.3g} (FBGEMM update), "
            f"{c['partial_torch_vs_exact_max_abs']:.3g} (PyTorch update)"
        )
    figures["seconds"] = time.perf_counter() - start
    print(f"\n{figures['seconds']:.0f} s; {machine()['cpu']}")
    write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
