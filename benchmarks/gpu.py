"""Cached vs resident vs TorchRec's UVM cache vs naive host-embedding training of the default DLRM on one CUDA GPU.

Not run by CI (it needs a GPU; docs/benchmarks.md has the figures, docs/benchmarks_history.md the set-up).
Eight ways to train the same model (``configs/dlrm_synthetic.yaml``: 26 Criteo-shaped tables, dim 16, batch
2,048, row-wise Adagrad embeddings, Adagrad dense) on ``--device`` (default ``cuda``), alternated in one process:

* ``resident``: every table on the GPU, TorchRec's fused FBGEMM kernel (``strategy="torchrec"``);
* ``resident_bg``: the same, its batches read by a background thread as the cached job's planner thread reads
  them (:class:`~benchmarks._common.BackgroundLoadingDataModule`), so that the two differ by the cache only;
* ``cached``: tables above ``--min-cached-rows`` rows in host stores, a GPU cache of ``--fraction`` of their
  rows planned by the lookahead oracle (``LookaheadEmbeddingBagCollectionSharder`` + ``LookaheadDataModule``);
* ``fae``: FAE on the cached job: ``configs/dlrm_fae.yaml``'s hot budget and calibration sample, hot and cold
  mini-batches with the ``HotColdScheduler``, the hot rows pinned in the GPU caches (each cached table's
  capacity is ``cached``'s plus its hot rows), the lookahead oracle planning the cold batches;
* ``host``: the naive way to train tables that do not fit: every table on the CPU (``EmbeddingBagCollection``
  on CPU, Adagrad on CPU), the pooled embeddings copied to the GPU each step and their gradients back; dense
  layers on the GPU. A plain PyTorch loop (no Lightning);
* ``uvm_lru``, ``uvm_lfu``: TorchRec's own answer, the anchor: the tables ``cached`` caches in host memory with
  FBGEMM's HBM cache (``FUSED_UVM_CACHING``, LRU with ``PrefetchTrainPipelineSparseDist`` one batch ahead; LFU
  with ``TrainPipelineSparseDist``, FBGEMM's prefetch pipeline being LRU-only), its cache holding the bytes of
  ``cached``'s (load factors in ``benchmarks/_uvm.py``, which explains the byte accounting); a plain TorchRec
  loop under ``DistributedModelParallel``, batches read by a background thread. CUDA only: with ``--device cpu``
  they are recorded as skipped with the reason, and the CPU-checkable part (byte-equal load factors, TorchRec's
  plan with the ``fused_uvm_caching`` kernel) is in the JSON (``uvm_plan``);
* ``cached_hbm``: ``cached`` at equal total embedding HBM instead of equal cache bytes: its cache holds the whole
  HBM ``uvm_lru`` uses (FBGEMM's cache, its index and locks, and the row-wise optimizer state of every row of
  the cached tables, which FBGEMM keeps on the device; ``benchmarks/_uvm.py``'s ``equal_hbm_capacity``), each
  table's capacity scaled alike (at most its rows). JSON ``cached_hbm_over_uvm_lru``.

Figures: median step time and samples/s of each, and the ratios cached / resident, cached / resident with
background loading, FAE / resident, host / resident and cached / UVM (JSON ``cached_over_resident``,
``cached_over_resident_background_loading``, ``fae_over_resident``, ``host_over_resident``,
``cached_over_uvm_lru``, ``cached_over_uvm_lfu``, ``*_samples_per_s``). Per run (JSON ``runs``): rows and bytes
moved host -> device and device -> host per step (``cached`` and ``fae``: the cache's rows fetched and written
back, with their optimizer state; UVM: FBGEMM's cache statistics), the hit rate (1 - rows moved in / distinct
rows a step reads from the cached tables), and on CUDA the floor those bytes imply at the host <-> device
bandwidth measured in the same process (``link``: a pinned 256 MiB buffer copied each way) and the step time
over that floor; ``rows_moved_cached_over_uvm_lru`` / ``_lfu`` compare the rows moved in. Add ``--scale 1.0``
for the Kaggle-sized tables (33.8 M rows; the host baseline then moves the dense gradient of every table each
step, which is why it is naive). ``--fraction 0.01 0.05`` adds the cached and UVM runs at each further fraction
(named ``cached_5pct``, ``uvm_lru_5pct``, ...); ``--runs`` picks the kinds. Each run but ``host`` profiles its
last timed step with ``torch.profiler`` (the training thread's operators, CPU and on CUDA device time; JSON
``runs.<run>.profile``: the 15 with the most self CPU time and the 15 with the most self device time), so that a
gap between two runs has a name; ``--no-profile`` turns it off (that step is one of the step-time samples).

``--split planner`` splits the cache bytes of each ``--fraction`` (the fixed split's rows x 68 B: weights and
row-wise Adagrad state) among the cached tables with the product's ``LookaheadPlanner`` (what a user who sets
``device_budget_bytes`` gets; fetch curves on the first ``--plan-sample`` of the run's batches) instead of the
same fraction of each table: ``cached``, its further fractions and ``fae`` take the planner's capacities, a table
it makes resident trains resident, a cached one is bumped to the oracle's minimum over the run's batches if the
sample missed it. The UVM runs keep the fixed split's bytes: FBGEMM shares one cache among the cached tables, so
only the total counts (``benchmarks/rows_gap.py``: the per-table split is what made ours move more rows).
The JSON records the split (``split``) and per fraction both splits (``fractions``).

``--device cpu`` runs the same code paths on the CPU (a smoke test of the script where there is no GPU);
``--dry-run`` only computes and prints the cache capacities and the UVM anchor's plan (no training).

    python benchmarks/gpu.py [--quick] [--json PATH] [--device cuda|cpu] [--scale 0.01] [--fraction F [F ...]]
                             [--runs KIND [KIND ...]] [--split fraction|planner] [--plan-sample N] [--dry-run]
"""

from __future__ import annotations

import gc
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import (  # noqa: E402
    CONFIG,
    StepProfiler,
    batch_size,
    build,
    cache_counters,
    capacities,
    fae_settings,
    feature_tables,
    machine,
    median,
    oracle_floors,
    parser,
    planner_split,
    quiet,
    table,
    table_rows,
    train,
    write_json,
)
from benchmarks._uvm import (  # noqa: E402
    NEEDS_CUDA,
    UVM_KINDS,
    algorithm_of,
    anchor_plan,
    distinct_rows,
    equal_hbm_capacity,
    link_bandwidth,
    our_row_bytes,
    our_traffic,
    per_step,
    uvm_run,
)
from torchrec_lookahead.distributed.planner.types import Placement  # noqa: E402

#: every kind of run, in the order a round runs them (rotated per round)
KINDS = ("resident", "resident_bg", "cached", "fae", "host", *UVM_KINDS, "cached_hbm")
#: the kinds run once per ``--fraction`` (the others depend on no cache size, or on the first: ``fae``)
PER_FRACTION = ("cached", *UVM_KINDS, "cached_hbm")


class _ToDevice(nn.Module):
    """Runs the sparse arch on the CPU and copies its pooled output to ``device`` (autograd copies back)."""

    def __init__(self, inner: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.inner = inner
        self.device = device

    def forward(self, features: Any) -> torch.Tensor:
        return self.inner(features).to(self.device, non_blocking=True)


def host_embedding_run(cli: Any, device: torch.device, steps: int, warmup: int) -> Dict[str, Any]:
    """The naive baseline: tables and their optimizer on the CPU, dense layers on ``device``."""
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_lookahead.modules import init_embedding_bag_tables_

    lm = cli.model
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=lm.tables, device=torch.device("cpu"))
    init_embedding_bag_tables_(ebc, lm.tables, seed=0)
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=lm.num_dense_features,
        dense_arch_layer_sizes=lm.dense_arch_layer_sizes,
        over_arch_layer_sizes=lm.over_arch_layer_sizes,
        dense_device=device,
    )
    model.sparse_arch = _ToDevice(model.sparse_arch, device)
    emb_params = list(ebc.parameters())
    emb_ids = {id(p) for p in emb_params}
    dense_params = [p for p in model.parameters() if id(p) not in emb_ids]
    emb_lr = float(lm.embedding_optimizer.optimizer_kwargs().get("lr", 0.05))
    emb_opt = torch.optim.Adagrad(emb_params, lr=emb_lr)
    dense_opt = lm.dense_optimizer.build(dense_params)
    loss_fn = nn.BCEWithLogitsLoss()
    dm = cli.datamodule
    dm.setup("fit")
    times: List[float] = []
    last = time.perf_counter()
    for i, batch in enumerate(dm.train_dataloader()):
        if i >= steps + warmup:
            break
        dense = batch.dense_features.to(device, non_blocking=True)
        labels = batch.labels.to(device, non_blocking=True)
        logits = model(dense, batch.sparse_features).squeeze(-1)
        loss = loss_fn(logits, labels)
        emb_opt.zero_grad(set_to_none=True)
        dense_opt.zero_grad(set_to_none=True)
        loss.backward()
        emb_opt.step()
        dense_opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        if i >= warmup:
            times.append(now - last)
        last = now
    step = median(times)
    return {"times": times, "step_ms": step * 1e3, "samples_per_s": batch_size(dm) / step}


class _Sync:
    """Lightning callback factory: synchronise CUDA at each step end so step times are real."""

    @staticmethod
    def make(device: torch.device) -> Any:
        import lightning.pytorch as pl

        class Sync(pl.Callback):
            def on_train_batch_end(self, *args: Any) -> None:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)

        return Sync()


def fae_run(
    cli: Any,
    capacity: Dict[str, int],
    steps: int,
    warmup: int,
    device: torch.device,
    accelerator: str,
    callbacks: Sequence[Any] = (),
) -> Dict[str, Any]:
    """The cached job with FAE: the config's DataModule regrouped into hot and cold batches (hot set calibrated
    with configs/dlrm_fae.yaml's budget and sample), its hot rows pinned on top of ``capacity``."""
    from types import SimpleNamespace

    from torchrec_lookahead.callbacks import HotColdScheduler
    from torchrec_lookahead.fae import HotColdDataModule

    dim = int(cli.model.hparams.get("embedding_dim", 16))
    hot = HotColdDataModule(cli.datamodule, **fae_settings(), embedding_dim=dim)
    hot.setup("fit")
    assert hot.hot_set is not None
    pinned = {t: c + hot.hot_set.hot_rows[t] for t, c in capacity.items()}
    return train(
        SimpleNamespace(model=cli.model, datamodule=hot),
        pinned,
        steps,
        warmup=warmup,
        callbacks=[HotColdScheduler(), _Sync.make(device), *callbacks],
        accelerator=accelerator,
    )


class _CacheWindow:
    """Lightning callback factory: the lookahead caches' counters (``cache_counters``, summed over the cached
    tables) at the end of step ``warmup`` and of the last step, as :class:`~benchmarks._common.StepTimer` times
    the steps after ``warmup``."""

    @staticmethod
    def make(warmup: int) -> Any:
        import lightning.pytorch as pl

        class CacheWindow(pl.Callback):
            def __init__(self) -> None:
                self.first: Optional[Tuple[int, Dict[str, int]]] = None
                self.last: Optional[Tuple[int, Dict[str, int]]] = None

            def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
                if trainer.global_step < warmup:
                    return
                snap = (int(trainer.global_step), cache_counters(trainer.strategy))
                if self.first is None:
                    self.first = snap
                self.last = snap

            def delta(self) -> Tuple[int, Dict[str, int]]:
                """Steps between the two snapshots and the counters' differences."""
                if self.first is None or self.last is None:
                    return 0, {}
                (s0, a), (s1, b) = self.first, self.last
                return s1 - s0, {k: b.get(k, 0) - a.get(k, 0) for k in b}

        return CacheWindow()


def planned_capacities(
    dm: Any, fixed: Dict[str, int], floors: Dict[str, int], embedding_dim: int, optimizer: str, sample: int
) -> Tuple[Dict[str, int], Dict[str, Any]]:
    """The bytes of the fixed split ``fixed`` re-split among its tables by the ``LookaheadPlanner`` on the first
    ``sample`` training batches of ``dm`` (:func:`benchmarks._common.planner_split`). Returns the capacity of
    each table the plan caches (the tables it makes resident are left out: the job trains them resident), bumped
    to ``floors`` (the oracle's minimum over all the run's batches) where the sample missed it, and what the JSON
    records."""
    rows = table_rows(dm)
    f2t = feature_tables(dm)
    dm.setup("fit")
    t0 = time.perf_counter()

    def feed() -> Any:
        for i, b in enumerate(dm.train_dataloader()):
            if i >= sample:
                return
            ids = b.sparse_features.to_dict()
            yield {f2t[f]: ids[f].values() for f in ids if f2t[f] in fixed}

    plan = planner_split(rows, fixed, feed(), embedding_dim, optimizer, num_sample_batches=sample)
    seconds = time.perf_counter() - t0
    cap = {tp.name: int(tp.capacity) for tp in plan.tables if tp.placement == Placement.CACHED}
    resident = sorted(tp.name for tp in plan.tables if tp.placement == Placement.RESIDENT)
    bumped = {t: c for t, c in cap.items() if c < floors[t]}
    cap.update({t: floors[t] for t in bumped})
    info = {
        "budget_bytes": int(plan.budget_bytes),
        "bytes": sum(tp.capacity * tp.bytes_per_row for tp in plan.tables),
        "sample_batches": int(plan.num_sample_batches),
        "resident": resident,
        "bumped_from": bumped,
        "fetches_per_step_estimate": {tp.name: float(tp.fetches_per_step) for tp in plan.tables},
        "seconds": seconds,
    }
    return cap, info


def _suffix(fraction: float, first: float) -> str:
    """The run-name suffix of a cache fraction: none for the first ``--fraction``, else ``_5pct`` (0.05),
    ``_1_5pct`` (0.015).

    >>> _suffix(0.05, 0.01), _suffix(0.015, 0.01), _suffix(0.01, 0.01)
    ('_5pct', '_1_5pct', '')
    """
    return "" if fraction == first else "_" + f"{fraction * 100:g}".replace(".", "_") + "pct"


def _loader_figures(figures: Dict[str, Any], loaders: Dict[str, List[Dict[str, float]]]) -> None:
    """Beside each cached run's step time (``figures["runs"][name]["loader"]``): the medians over its runs of the
    training thread's waits (ms a step) and of the reader, planner and stager threads' CPU (ms a batch)."""
    for name, rows in loaders.items():
        if rows and name in figures.get("runs", {}):
            figures["runs"][name]["loader"] = {k: median([r[k] for r in rows]) for k in rows[0]}


def _profile_figures(figures: Dict[str, Any], profiles: Dict[str, Dict[str, Any]]) -> None:
    """Beside each run's step time (``figures["runs"][name]["profile"]``): its profiled step's top operators."""
    for name, ops in profiles.items():
        if name in figures.get("runs", {}):
            figures["runs"][name]["profile"] = ops


def _summarize(
    figures: Dict[str, Any],
    times: Dict[str, List[float]],
    traffic: Dict[str, List[Dict[str, Any]]],
    uvm_info: Dict[str, Dict[str, Any]],
    skipped: Dict[str, str],
    batch: int,
    distinct_per_step: Optional[float],
    bandwidth: Optional[Dict[str, float]],
) -> Dict[str, float]:
    """Add to ``figures`` the medians, samples/s and ratios of the runs done so far, and per run (``runs``) its
    traffic figures (:func:`~benchmarks._uvm_traffic.per_step`), the step time over its bandwidth floor and a UVM run's
    FBGEMM facts; returns the median step times (ms)."""
    med = {k: median(v) * 1e3 for k, v in times.items() if v}
    figures.update({f"{k}_step_ms": v for k, v in med.items()})
    figures.update({f"{k}_samples_per_s": batch / v * 1e3 for k, v in med.items()})
    for key, (a, b) in {
        "cached_over_resident": ("cached", "resident"),
        "cached_over_resident_background_loading": ("cached", "resident_bg"),
        "fae_over_resident": ("fae", "resident"),
        "host_over_resident": ("host", "resident"),
    }.items():
        if a in med and b in med:
            figures[key] = med[a] / med[b]
    per_run: Dict[str, Any] = {name: {"skipped": reason} for name, reason in skipped.items()}
    for name, step_ms in med.items():
        rec: Dict[str, Any] = {"step_ms": step_ms, "samples_per_s": batch / step_ms * 1e3}
        if traffic[name]:
            rec.update(per_step(traffic[name], distinct_per_step, bandwidth))
            rec["step_over_floor"] = step_ms / rec["floor_ms"] if rec.get("floor_ms") else None
        rec.update(uvm_info.get(name, {}))
        per_run[name] = rec
    figures["runs"] = per_run
    for name in per_run:
        if not name.startswith("cached"):
            continue
        # cached_hbm (equal total HBM) against the UVM runs of its fraction, as cached (equal cache bytes)
        sfx = name[len("cached_hbm" if name.startswith("cached_hbm") else "cached") :]
        ours = per_run[name]
        for algorithm in ("lru", "lfu"):
            theirs = per_run.get(f"uvm_{algorithm}{sfx}", {})
            if "step_ms" not in ours or "step_ms" not in theirs:
                continue
            figures[f"{name}_over_uvm_{algorithm}{sfx}"] = ours["step_ms"] / theirs["step_ms"]
            a, b = ours.get("rows_h2d_per_step"), theirs.get("rows_h2d_per_step")
            figures[f"rows_moved_{name}_over_uvm_{algorithm}{sfx}"] = a / b if a is not None and b else None
    return med


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--config", default=CONFIG)
    p.add_argument(
        "--scale", type=float, default=None, help="table sizes = Kaggle sizes x scale (config: 0.01)"
    )
    p.add_argument(
        "--fraction",
        type=float,
        nargs="+",
        default=[0.05],
        help="cache rows / rows of each cached table; each further value adds cached and UVM runs at it",
    )
    p.add_argument("--min-cached-rows", type=int, default=5000)
    p.add_argument(
        "--split",
        choices=["fraction", "planner"],
        default="fraction",
        help="cached tables' capacities: the fraction of each (fraction) or its bytes split by LookaheadPlanner",
    )
    p.add_argument(
        "--plan-sample", type=int, default=50, help="--split planner: the planner's sample batches"
    )
    p.add_argument("--runs", nargs="+", choices=KINDS, default=list(KINDS), help="the kinds to run (all)")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds of every run, in an order rotated per round",
    )
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--no-profile",
        action="store_true",
        help="do not profile each run's last timed step (torch.profiler: its top 15 ops in the JSON)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="only compute and print the capacities and UVM plan"
    )
    args = p.parse_args(argv)
    quiet()
    rounds = args.rounds or (1 if args.quick else 3)
    steps = args.steps or (20 if args.quick else 100)
    # Just the batches a run trains (LookaheadDataModule's capacity pre-scan reads the whole epoch first).
    overrides = [f"--data.init_args.num_train_batches={steps + args.warmup + 2}"]
    if args.scale is not None:
        overrides.append(f"--data.init_args.scale={args.scale}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available() and not args.dry_run:
        sys.exit(
            "benchmarks/gpu.py: torch sees no CUDA device (torch.cuda.is_available() is False). Install a CUDA "
            "build of torch with fbgemm-gpu and torchrec (docs/benchmarks_history.md, GPU), or pass --device cpu to "
            "run the same code paths on the CPU, or --dry-run to only plan the capacities."
        )
    if device.type == "cuda" and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())

    fractions = list(dict.fromkeys(args.fraction))
    first = fractions[0]
    probe = build(args.config, overrides)
    lm = probe.model
    dim, optimizer = int(lm.tables[0].embedding_dim), lm.embedding_optimizer.name
    # the fixed split (the UVM runs' bytes) and the cached runs' capacities: the same, or the planner's
    fixed: Dict[float, Dict[str, int]] = {}
    caps: Dict[float, Dict[str, int]] = {}
    bumps: Dict[float, Dict[str, int]] = {}
    planned: Dict[float, Dict[str, Any]] = {}
    rows = table_rows(probe.datamodule)
    # the oracle's minimum per cached table over the run's batches, read once for every fraction and split
    floors = oracle_floors(probe.datamodule, [t for t, n in rows.items() if n > args.min_cached_rows])
    for f in fractions:
        fixed[f], bumps[f] = capacities(probe.datamodule, f, args.min_cached_rows, floors=floors)
        caps[f] = fixed[f]
        if args.split == "planner":
            caps[f], planned[f] = planned_capacities(
                probe.datamodule, fixed[f], floors, dim, optimizer, args.plan_sample
            )
    # the cached_hbm runs' capacities: the fixed split scaled to uvm_lru's whole HBM (at most each table's rows)
    hbm_caps = {f: equal_hbm_capacity(fixed[f], rows, dim, optimizer) for f in fractions}
    capacity, bumped = fixed[first], bumps[first]
    print(
        f"device {device}; {len(capacity)} cached tables ({sum(rows[t] for t in capacity):,} of "
        f"{sum(rows.values()):,} rows), cache {sum(capacity.values()):,} rows; bumped: {bumped or 'none'}"
    )
    for f, info in planned.items():
        print(
            f"planner split at {f:g} ({info['sample_batches']} sample batches, {info['seconds']:.1f} s): "
            f"{caps[f]}; resident: {info['resident'] or 'none'}; {info['bytes']:,} of {info['budget_bytes']:,} B"
        )
    figures: Dict[str, Any] = {
        "device": str(device),
        "split": args.split,
        "capacity": caps[first],
        "bumped_from": bumped,
    }
    figures["fractions"] = {
        f"fraction{_suffix(f, first)}": {
            "fraction": f,
            "capacity": caps[f],
            "capacity_equal_hbm": hbm_caps[f],
            "bumped_from": bumps[f],
            **({"fraction_capacity": fixed[f], "planner": planned[f]} if f in planned else {}),
        }
        for f in fractions
    }
    uvm_wanted = [k for k in args.runs if k in UVM_KINDS]
    if uvm_wanted:
        # the anchor's byte accounting and TorchRec's plan for it: what the CPU can check of the UVM runs
        for f in fractions:
            plan = anchor_plan(probe.model, probe.datamodule, fixed[f])
            figures[f"uvm_plan{_suffix(f, first)}"] = plan
            print(
                f"UVM anchor at {f:g}: FBGEMM cache {plan['fbgemm_cache_slots']:,} rows x "
                f"{plan['row_bytes_fbgemm']} B for our {sum(fixed[f].values()):,} rows x {plan['row_bytes_ours']} B"
            )
    if args.dry_run:
        write_json(args.json, figures)
        return figures
    accelerator = "gpu" if device.type == "cuda" else "cpu"
    # (run name, kind, fraction), in KINDS order, the further fractions' runs last
    runs = [(k, k, first) for k in KINDS if k in args.runs]
    runs += [(k + _suffix(f, first), k, f) for f in fractions[1:] for k in PER_FRACTION if k in args.runs]
    skipped = {name: NEEDS_CUDA for name, kind, _ in runs if kind in UVM_KINDS and device.type != "cuda"}
    runs = [r for r in runs if r[0] not in skipped]
    cached_tables = sorted(capacity)
    # distinct rows the timed batches read from the cached tables (the same batches in every run)
    distinct = distinct_rows(probe.datamodule, cached_tables, steps + args.warmup + 2)[args.warmup + 1 :]
    distinct_per_step = sum(distinct) / len(distinct) if distinct else None
    bandwidth: Optional[Dict[str, float]] = None
    if device.type == "cuda":
        bandwidth = link_bandwidth(device)
        figures["link"] = bandwidth
        print(
            f"host -> device {bandwidth['h2d_gb_s']:.1f} GB/s, device -> host {bandwidth['d2h_gb_s']:.1f} GB/s "
            "(pinned 256 MiB copies)"
        )
    else:
        figures["link"] = {"skipped": "no host <-> device link on the CPU"}
    ours_row = our_row_bytes(dim, optimizer)
    times: Dict[str, List[float]] = {name: [] for name, _, _ in runs}
    traffic: Dict[str, List[Dict[str, Any]]] = {name: [] for name, _, _ in runs}
    # the lookahead loader's threads, per cached run: batch wait, stager wait, each thread's CPU per batch
    loaders: Dict[str, List[Dict[str, float]]] = {name: [] for name, _, _ in runs}
    # per run, the last round's profile of its last timed step (the host run is not profiled)
    profiles: Dict[str, Dict[str, Any]] = {}
    uvm_info: Dict[str, Dict[str, Any]] = {}
    out_rows: List[Dict[str, Any]] = []
    batch = batch_size(probe.datamodule)
    figures.update(rounds=rounds, steps_per_run=steps, distinct_rows_per_step=distinct_per_step)
    for r in range(rounds):
        order = runs[r % len(runs) :] + runs[: r % len(runs)]  # rotated: load falls on each alike
        for name, kind, f in order:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            cli = build(args.config, overrides)
            window = _CacheWindow.make(args.warmup) if kind in ("cached", "cached_hbm", "fae") else None
            profiler = (
                None if args.no_profile or kind == "host" else StepProfiler(args.warmup + 1 + steps, device)
            )
            if kind == "host":
                res = host_embedding_run(cli, device, steps, args.warmup)
            elif kind == "fae":
                res = fae_run(
                    cli,
                    caps[f],
                    steps,
                    args.warmup,
                    device,
                    accelerator,
                    callbacks=[window, *filter(None, [profiler])],
                )
            elif kind in UVM_KINDS:
                res = uvm_run(cli, fixed[f], algorithm_of(kind), steps, args.warmup, device, profiler)
                traffic[name].append(res["traffic"])
                uvm_info[name] = {k: v for k, v in res.items() if k not in ("times", "traffic")}
            else:
                res = train(
                    cli,
                    {"cached": caps[f], "cached_hbm": hbm_caps[f]}.get(kind),
                    steps,
                    warmup=args.warmup,
                    callbacks=[_Sync.make(device), *filter(None, [window, profiler])],
                    accelerator=accelerator,
                    background_loading=kind == "resident_bg",
                )
            if window is not None:
                window_steps, counted = window.delta()
                traffic[name].append(our_traffic(counted, window_steps, ours_row))
            times[name] += res["times"]
            if res.get("loader"):
                loaders[name].append(res["loader"])
            if profiler is not None and profiler.ops is not None:
                profiles[name] = profiler.ops
            moved = per_step(traffic[name][-1:], distinct_per_step, bandwidth) if traffic[name] else {}
            row = {
                "round": r,
                "kind": name,
                "step_ms": res["step_ms"],
                "samples/s": res["samples_per_s"],
                "rows in/step": "" if moved.get("rows_h2d_per_step") is None else moved["rows_h2d_per_step"],
                "hit rate": "" if moved.get("hit_rate") is None else moved["hit_rate"],
            }
            out_rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)
            del res, cli
            # a run cut short (a time limit) keeps the runs it finished
            _summarize(figures, times, traffic, uvm_info, skipped, batch, distinct_per_step, bandwidth)
            _loader_figures(figures, loaders)
            _profile_figures(figures, profiles)
            write_json(args.json, {**figures, "complete": False})
    med = _summarize(figures, times, traffic, uvm_info, skipped, batch, distinct_per_step, bandwidth)
    _loader_figures(figures, loaders)
    _profile_figures(figures, profiles)
    figures["complete"] = True
    print()
    print(table(out_rows))
    summary = ", ".join(f"{k} {v:.2f} ms" for k, v in med.items())
    ratios = ", ".join(f"{k} {v:.3f}" for k, v in figures.items() if "_over_" in k and isinstance(v, float))
    print(f"\nmedian step: {summary}; {ratios}  on {machine()['cuda'] or machine()['cpu']}")
    for name, reason in skipped.items():
        print(f"{name}: skipped ({reason})")
    write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
