"""Step time of cached vs resident training of the same model, data and optimizer, side by side.

The default job (``configs/dlrm_synthetic.yaml``: DLRM, 26 Criteo-shaped tables, dim 16, batch 2,048,
row-wise Adagrad embeddings, Adagrad dense) is trained alternately with every table resident (TorchRec's
fused kernel) and with the tables of more than ``--min-cached-rows`` rows behind the lookahead cache
(``LookaheadEmbeddingBagCollectionSharder``, ``LookaheadDataModule``, belady, horizon 64, prefetch depth 1)
at ``--fraction`` of their rows, in one process: resident, resident with background loading, cached, ...
The figure is the median step time of each kind over all runs after warm-up, and their ratios: cached over
resident (JSON ``step_time_ratio``), and cached over the resident job whose batches a background thread
reads, as the cached job's planner thread does (JSON ``step_time_ratio_background_loading``), which measures
the cache rather than where the batches are generated.
``--profile`` adds a cProfile breakdown of a few cached steps (training thread and background threads).

Both report ``cache/training_thread_ms``, the time the training thread spends in cache code a step (JSON
``cached_training_thread_ms``), and a second run measures it at Criteo Kaggle sizes (the same job at
``scale=1.0``: 33.8 M rows) with ``--kaggle-fraction`` caches, timed once every cache is full and every step
evicts (JSON ``kaggle``; ``--kaggle-steps 0`` skips it), and its plans are replayed through ``apply_plan`` alone,
without training, for the training thread's part of applying them with the noise of a shared machine left out
(JSON ``kaggle.replay``).

    python benchmarks/cache_overhead.py [--quick] [--json PATH] [--profile] [--kaggle-steps N]

The job's helpers (``build``, ``train``, ``capacities``) are in ``_common.py``, shared with ``memory.py``,
``scale.py`` and ``gpu.py``.
"""

from __future__ import annotations

import cProfile
import gc
import io
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import (  # noqa: E402
    CONFIG,
    batch_size,
    build,
    cache_counters,
    capacities,
    machine,
    median,
    parser,
    quiet,
    table,
    table_rows,
    train,
    write_json,
)


class _Profile(pl.Callback):
    """cProfile of the training thread over steps ``start`` .. ``start + count``."""

    def __init__(self, start: int, count: int) -> None:
        self.start, self.count = start, count
        self.prof = cProfile.Profile()
        self.wall = 0.0
        self._t0 = 0.0
        self._active = False

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if not self._active and trainer.global_step == self.start:
            self._t0 = time.perf_counter()
            self._active = True
            self.prof.enable()
        elif self._active and trainer.global_step >= self.start + self.count:
            self.prof.disable()
            self.wall = time.perf_counter() - self._t0
            self._active = False


#: the JSON's name of each kind of run
KIND_NAMES = {"resident": "resident", "resident_background_loading": "resident_bg", "cached": "cached"}
#: the per-step series of a run (``train()``'s result) and the JSON figure of each
PER_STEP = {
    "cpu_times": "train_thread_cpu_ms",
    "runq_times": "train_thread_runq_ms",
    "other_cpu_times": "other_threads_cpu_ms",
}


def _profiled_threads() -> Tuple[Dict[str, cProfile.Profile], Any]:
    """Profile the lookahead loader's oracle and stager threads; returns the profiles and an undo function."""
    from torchrec_lookahead.runtime import loader as la

    profiles: Dict[str, cProfile.Profile] = {}
    orig = {"_plan": la.LookaheadLoader._plan, "_stage": la.LookaheadLoader._stage}

    def wrap(name: str, fn: Any) -> Any:
        def run(self: Any, *a: Any) -> Any:
            prof = cProfile.Profile()
            profiles[name] = prof
            prof.enable()
            try:
                return fn(self, *a)
            finally:
                prof.disable()

        return run

    for attr, fn in orig.items():
        setattr(la.LookaheadLoader, attr, wrap(attr, fn))

    def undo() -> None:
        for attr, fn in orig.items():
            setattr(la.LookaheadLoader, attr, fn)

    return profiles, undo


def _cum(prof: cProfile.Profile, path: str, fn: str) -> Tuple[float, int]:
    """(cumulative seconds, calls) of the function ``fn`` defined in a file ending with ``path``."""
    best = (0.0, 0)
    for (file, _line, name), (_cc, nc, _tt, ct, _callers) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        if name == fn and file.replace("\\", "/").endswith(path):
            best = max(best, (ct, nc))
    return best


_MAIN_PARTS = {
    "next batch (data generation / planned queue)": [
        ("lightning/pytorch/loops/fetchers.py", "__next__"),
    ],
    "batch_to_device (cached: apply_plan)": [
        ("torchrec_lookahead/strategies/torchrec.py", "batch_to_device")
    ],
    "  apply_plan: validate the plan": [("torchrec_lookahead/modules/cached_ebc.py", "_validate")],
    "  apply_plan: write back + load rows": [("torchrec_lookahead/modules/cached_ebc.py", "_move")],
    "forward (training_step)": [("torchrec_lookahead/models/dlrm.py", "training_step")],
    "  cached tables' lookup": [("torchrec_lookahead/modules/cached_ebc.py", "forward")],
    "backward (+ fused embedding update)": [("lightning/pytorch/strategies/strategy.py", "backward")],
    "optimizer step incl. closure": [("torchrec_lookahead/optim.py", "step")],
}
_THREAD_PARTS = {
    "oracle thread: synthetic batch generation": ("torchrec_lookahead/data/synthetic.py", "batch"),
    "oracle thread: oracle planning": ("torchrec_lookahead/oracle/oracle.py", "feed"),
    "oracle thread: remap ids -> slots": ("torchrec_lookahead/modules/remap.py", "remap_kjt"),
    "stager thread: gather rows from the stores": ("torchrec_lookahead/modules/staging.py", "stage_rows"),
}


def profile_pair(config: str, capacity: Dict[str, int], steps: int) -> Dict[str, Any]:
    """cProfile of ``steps`` steps of a resident and a cached run (after 5 steps), side by side: per-step
    milliseconds of the parts of a step (training thread), and per-batch milliseconds of the background
    threads' work (whole cached run)."""
    out: Dict[str, Dict[str, float]] = {}
    threads: Dict[str, cProfile.Profile] = {}
    for kind in ("resident", "cached"):
        cb = _Profile(start=5, count=steps)
        undo = None
        if kind == "cached":
            threads, undo = _profiled_threads()
        try:
            train(build(config), capacity if kind == "cached" else None, steps + 6, warmup=3, callbacks=[cb])
        finally:
            if undo is not None:
                undo()
        parts = {"wall per step (profiled)": cb.wall / steps * 1e3}
        for label, keys in _MAIN_PARTS.items():
            parts[label] = max(_cum(cb.prof, p, f)[0] for p, f in keys) / steps * 1e3
        out[kind] = parts
        out[kind + "_profile"] = cb.prof  # type: ignore[assignment]
    thread_rows = {}
    for label, (path, fn) in _THREAD_PARTS.items():
        prof = threads.get("_stage" if label.startswith("stager") else "_plan")
        if prof is not None:
            ct, nc = _cum(prof, path, fn)
            thread_rows[label] = ct / max(nc, 1) * 1e3
    return {"parts": out, "threads": thread_rows, "thread_profiles": threads}


class _Fill(pl.Callback):
    """Cache occupancy (filled slots / cache rows, every cached table together) and the summed cache counters
    at the end of step ``at`` and of the last step."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.occupancy = 0.0
        self.first: Dict[str, int] = {}
        self.last: Dict[str, int] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step < self.at:
            return
        counters = cache_counters(trainer.strategy)  # type: ignore[arg-type]
        if not self.first:
            self.first = counters
            filled = rows = 0
            for m in trainer.strategy.cached_modules():  # type: ignore[attr-defined]
                for t, cap in m.cache.capacity.items():
                    filled += int((m.cache.slot_ids(t) >= 0).sum())
                    rows += cap
            self.occupancy = filled / max(rows, 1)
        self.last = counters


def kaggle_run(args: Any, steps: int, warmup: int) -> Dict[str, Any]:
    """The default job at Criteo Kaggle sizes (``--kaggle-scale``, 1.0), ``--kaggle-fraction`` caches, timed after
    ``warmup`` steps (the caches full): the training thread's time in cache code, the step time, the waits."""
    overrides = [
        f"--data.init_args.scale={args.kaggle_scale}",
        f"--data.init_args.num_train_batches={steps + warmup + 2}",
    ]
    probe = build(CONFIG, overrides)
    capacity, bumped = capacities(probe.datamodule, args.kaggle_fraction, args.min_cached_rows)
    del probe
    gc.collect()
    fill = _Fill(warmup)
    res = train(build(CONFIG, overrides), capacity, steps, warmup, callbacks=[fill],
                lookahead_kwargs={"planner_nice": args.planner_nice})  # fmt: skip
    n = max((fill.last.get("steps", 0) - fill.first.get("steps", 0)) // len(capacity), 1)
    loader = res["loader"]
    out = {
        "training_thread_ms": loader["training thread cache ms/step"],
        "cached_step_ms": res["step_ms"],
        "train_thread_cpu_ms": median(res["cpu_times"]) * 1e3,
        "batch_wait_ms_per_step": loader["batch wait ms/step"],
        "stager_wait_ms_per_step": loader["stager wait ms/step"],
        "reader_cpu_ms_per_batch": loader["reader cpu ms/batch"],
        "planner_cpu_ms_per_batch": loader["planner cpu ms/batch"],
        "stager_cpu_ms_per_batch": loader["stager cpu ms/batch"],
        "occupancy_at_warmup_end": fill.occupancy,
        "rows_written_back_per_step": (fill.last["rows_written_back"] - fill.first["rows_written_back"]) / n,
        "rows_fetched_per_step": (fill.last["rows_fetched"] - fill.first["rows_fetched"]) / n,
        "fraction": args.kaggle_fraction,
        "scale": args.kaggle_scale,
        "capacity_rows": sum(capacity.values()),
        "bumped_from": bumped,
        "warmup_steps": warmup,
        "steps": steps,
    }
    print(
        f"\nKaggle sizes, {100 * args.kaggle_fraction:g} % caches ({out['capacity_rows']:,} rows, "
        f"{100 * fill.occupancy:.1f} % full after {warmup} steps), {steps} steps: training thread in cache code "
        f"{out['training_thread_ms']:.2f} ms/step, step {out['cached_step_ms']:.1f} ms, batch wait "
        f"{out['batch_wait_ms_per_step']:.2f} ms/step, rows written back {out['rows_written_back_per_step']:,.0f}"
        f"/step, fetched {out['rows_fetched_per_step']:,.0f}/step",
        flush=True,
    )
    return out


def kaggle_replay(args: Any, steps: int, warmup: int) -> Dict[str, Any]:
    """The training thread's part of applying the Kaggle-sized run's plans, replayed without training: the
    planner's moves and the stager's rows made ahead (untimed), each ``apply_plan`` timed alone on one thread,
    after ``warmup`` plans (the caches full). A shared machine's noise moves the median little."""
    from torchrec import EmbeddingBagConfig

    from torchrec_lookahead.modules import CachedEmbeddingBagCollection, CacheOptimizerConfig
    from torchrec_lookahead.oracle import LookaheadOracle

    overrides = [
        f"--data.init_args.scale={args.kaggle_scale}",
        f"--data.init_args.num_train_batches={steps + warmup + 2}",
    ]
    dm = build(CONFIG, overrides).datamodule
    cap, _ = capacities(dm, args.kaggle_fraction, args.min_cached_rows)
    tables = [
        EmbeddingBagConfig(name=f"t_{f}", embedding_dim=16, num_embeddings=int(n), feature_names=[f])
        for f, n in dm.num_embeddings_per_feature.items()
        if f"t_{f}" in cap
    ]
    cache = CachedEmbeddingBagCollection(
        tables, cap, CacheOptimizerConfig("rowwise_adagrad", learning_rate=0.05)
    )
    oracle = LookaheadOracle(cache.oracle_config(horizon=64, prefetch_depth=1))
    dm.setup("fit")
    plans = []
    for b in dm.train_dataloader():
        plans += oracle.feed(b.sparse_features)
    plans += oracle.finish()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times = []
    try:
        for plan in plans[: warmup + steps]:
            prepared, staged = cache.prepare_plan(plan), cache.stage(plan)
            t0 = time.perf_counter()
            cache.apply_plan(plan, staged, trusted=True, prepared=prepared, defer_write_backs=True)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    timed = sorted(t * 1e3 for t in times[warmup:])
    filled = sum(int((cache.slot_ids(t) >= 0).sum()) for t in cap) / sum(cap.values())
    out = {
        "apply_median_ms": median(timed),
        "apply_min_ms": timed[0],
        "occupancy": filled,
        "steps": len(timed),
    }
    print(
        f"Kaggle sizes, apply replayed ({len(timed)} plans after {warmup}, caches {100 * filled:.0f} % full): "
        f"{out['apply_median_ms']:.2f} ms median, {out['apply_min_ms']:.2f} ms min",
        flush=True,
    )
    return out


def _top(prof: cProfile.Profile, n: int = 25) -> str:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(n)
    return s.getvalue()


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--config", default=CONFIG)
    p.add_argument("--fraction", type=float, default=0.05, help="cache rows / table rows of cached tables")
    p.add_argument("--min-cached-rows", type=int, default=5000, help="cache tables with more rows than this")
    p.add_argument("--pairs", type=int, default=None, help="(resident, cached) run pairs")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--profile", action="store_true", help="add a cProfile breakdown (resident vs cached steps)"
    )
    p.add_argument("--planner-nice", type=int, default=19, help="LookaheadDataModule(planner_nice=...)")
    for flag, kind, default, what in (
        ("--kaggle-steps", int, None, "timed steps of the Kaggle-sized run (0: no such run)"),
        ("--kaggle-warmup", int, 300, "steps before the Kaggle-sized run is timed"),
        ("--kaggle-fraction", float, 0.01, "cache fraction of the Kaggle-sized run"),
        ("--kaggle-scale", float, 1.0, "Kaggle sizes x this (smaller: a smoke test)"),
    ):
        p.add_argument(flag, type=kind, default=default, help=what)
    p.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)"
    )
    p.add_argument(
        "--fuse-resident",
        choices=["auto", "off"],
        default="auto",
        help="the sharder's fuse_resident: auto (resident tables in the cache's kernel) or off (TorchRec's module)",
    )
    args = p.parse_args()
    quiet()
    if args.threads:
        # Lightning's DDP set-up resets torch's threads to cores / processes unless OMP_NUM_THREADS is set
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
        torch.set_num_threads(args.threads)
    pairs = args.pairs or (2 if args.quick else 5)
    steps = args.steps or (20 if args.quick else 60)

    probe = build(args.config)
    capacity, bumped = capacities(probe.datamodule, args.fraction, args.min_cached_rows)
    rows = table_rows(probe.datamodule)
    batch = batch_size(probe.datamodule)
    del probe
    cached_rows = sum(rows[t] for t in capacity)
    print(
        f"{len(capacity)} cached tables ({cached_rows:,} of {sum(rows.values()):,} rows), capacity "
        f"{sum(capacity.values()):,} rows ({100 * sum(capacity.values()) / cached_rows:.1f} % of them); "
        f"bumped to the oracle's minimum: {bumped or 'none'} -> "
        f"{ {t: capacity[t] for t in bumped} if bumped else '' }",
        flush=True,
    )

    results: List[Dict[str, Any]] = []
    kinds = ("resident", "resident_bg", "cached")
    times: Dict[str, List[float]] = {k: [] for k in kinds}
    # per timed step of each kind: the training thread's CPU, its run-queue wait, the other threads' CPU
    per_step: Dict[str, Dict[str, List[float]]] = {s: {k: [] for k in kinds} for s in PER_STEP}
    background: Dict[str, List[float]] = {}
    pair_ratios: List[float] = []
    pair_ratios_bg: List[float] = []
    threads: Dict[str, int] = {}
    counters: Dict[str, int] = {}
    for r in range(pairs):
        pair: Dict[str, float] = {}
        for kind in kinds:
            gc.collect()
            res = train(build(args.config), capacity if kind == "cached" else None, steps, args.warmup,
                        lookahead_kwargs={"planner_nice": args.planner_nice},
                        sharder_kwargs={"fuse_resident": None if args.fuse_resident == "auto" else False},
                        background_loading=kind == "resident_bg")  # fmt: skip
            times[kind] += res["times"]
            pair[kind] = res["step_ms"]
            row: Dict[str, Any] = {
                "run": r,
                "kind": kind,
                "step_ms": res["step_ms"],
                "samples/s": res["samples_per_s"],
            }
            threads[kind] = res["torch_threads"]
            if kind == "resident_bg" and "batch wait ms/step" in res["loader"]:
                row["batch wait ms/step"] = res["loader"]["batch wait ms/step"]
                background.setdefault("resident_bg batch wait ms/step", []).append(row["batch wait ms/step"])
            if kind == "cached":
                c = cache_counters(res["strategy"])
                counters = c
                n = max(c["steps"] // len(capacity), 1)
                row["fetch/step"] = c["rows_fetched"] / n
                row["hit rate"] = c["hits"] / max(c["lookups"], 1)
                row.update(res["loader"])
                for key in (
                    "batch wait ms/step",
                    "reader cpu ms/batch",
                    "planner cpu ms/batch",
                    "stager cpu ms/batch",
                    "training thread cache ms/step",
                ):
                    background.setdefault(key, []).append(row[key])
            row["train-thread cpu ms/step"] = median(res["cpu_times"]) * 1e3
            # the training thread runnable but off the CPU, and the CPU of the process's other threads (the step's
            # intra-op workers, the loader threads): who holds the cores
            row["train-thread runq ms/step"] = median(res["runq_times"]) * 1e3 if res["runq_times"] else None
            row["other threads cpu ms/step"] = median(res["other_cpu_times"]) * 1e3
            for series in PER_STEP:
                per_step[series][kind] += res[series]
            results.append(row)
            print(table([row]).splitlines()[-1], flush=True)
            del res
        pair_ratios.append(pair["cached"] / pair["resident"])
        pair_ratios_bg.append(pair["cached"] / pair["resident_bg"])
    print()
    print(
        table(
            results,
            [
                "run",
                "kind",
                "step_ms",
                "train-thread cpu ms/step",
                "train-thread runq ms/step",
                "other threads cpu ms/step",
                "samples/s",
                "fetch/step",
                "hit rate",
                "stager wait ms/step",
                "batch wait ms/step",
                "reader cpu ms/batch",
                "planner cpu ms/batch",
                "stager cpu ms/batch",
                "training thread cache ms/step",
            ],  # fmt: skip
        )
    )
    res_ms = median(times["resident"]) * 1e3
    bg_ms = median(times["resident_bg"]) * 1e3
    cac_ms = median(times["cached"]) * 1e3
    figures: Dict[str, Any] = {
        "step_time_ratio": cac_ms / res_ms,
        "step_time_ratio_median_of_pairs": median(pair_ratios),
        "pair_ratios": pair_ratios,
        "step_time_ratio_background_loading": cac_ms / bg_ms,
        "pair_ratios_background_loading": pair_ratios_bg,
        "resident_step_ms": res_ms,
        "resident_background_loading_step_ms": bg_ms,
        "cached_step_ms": cac_ms,
        # per kind (resident, resident_background_loading, cached) and series: its median a step (None where the
        # OS does not report it: the run-queue wait off Linux)
        **{
            f"{name}_{key}": median(per_step[series][k]) * 1e3 if per_step[series][k] else None
            for series, key in PER_STEP.items()
            for name, k in KIND_NAMES.items()
        },
        "cached_batch_wait_ms_per_step": median(background["batch wait ms/step"]),
        # the same wait of the resident job whose loader thread reads its batches: does that thread keep up?
        "resident_background_loading_batch_wait_ms_per_step": median(
            background.get("resident_bg batch wait ms/step") or [float("nan")]
        ),
        "reader_cpu_ms_per_batch": median(background["reader cpu ms/batch"]),
        "planner_cpu_ms_per_batch": median(background["planner cpu ms/batch"]),
        "stager_cpu_ms_per_batch": median(background["stager cpu ms/batch"]),
        "cached_training_thread_ms": median(background["training thread cache ms/step"]),
        "resident_samples_per_s": batch / res_ms * 1e3,
        "cached_samples_per_s": batch / cac_ms * 1e3,
        "batch_size": batch,
        "pairs": pairs,
        "steps_per_run": steps,
        "warmup_steps": args.warmup,
        "torch_threads": threads["resident"],
        "cached_torch_threads": threads["cached"],
        "planner_nice": args.planner_nice,
        "fuse_resident": args.fuse_resident,
        "load_average_at_end": os.getloadavg(),
        "capacity": capacity,
        "bumped_from": bumped,
        "cached_table_rows": {t: rows[t] for t in capacity},
        "last_cached_run_counters": counters,
    }
    print(
        f"\nmedian step over all runs: resident {res_ms:.1f} ms ({figures['resident_samples_per_s']:,.0f} "
        f"samples/s), cached {cac_ms:.1f} ms ({figures['cached_samples_per_s']:,.0f} samples/s)\n"
        f"cached / resident = {figures['step_time_ratio']:.3f} (per pair: "
        f"{', '.join(f'{x:.2f}' for x in pair_ratios)})\n"
        f"resident with background loading {bg_ms:.1f} ms; cached / it = "
        f"{figures['step_time_ratio_background_loading']:.3f} (per pair: "
        f"{', '.join(f'{x:.2f}' for x in pair_ratios_bg)})  on {machine()['cpu']}, {machine()['threads']} threads; "
        f"torch threads resident {threads['resident']}, cached {threads['cached']}\n"
        f"waiting for the next batch, ms a step: cached {figures['cached_batch_wait_ms_per_step']:.2f}, resident "
        f"with background loading {figures['resident_background_loading_batch_wait_ms_per_step']:.2f}"
    )
    kaggle_steps = args.kaggle_steps if args.kaggle_steps is not None else (30 if args.quick else 60)
    if kaggle_steps > 0:
        figures["kaggle"] = kaggle_run(args, kaggle_steps, args.kaggle_warmup)
        figures["kaggle"]["replay"] = kaggle_replay(args, kaggle_steps, args.kaggle_warmup)
    if args.profile:
        n = 10 if args.quick else 30
        prof = profile_pair(args.config, capacity, n)
        parts = prof["parts"]
        rows_out = [
            {"part": k, "resident ms": parts["resident"][k], "cached ms": parts["cached"][k]}
            for k in parts["resident"]
        ]
        print(f"\ncProfile, training thread, ms per step ({n} steps each; profiling inflates times):")
        print(table(rows_out))
        print("\nbackground threads of the cached run, ms per batch:")
        print(table([{"work": k, "ms/batch": v} for k, v in prof["threads"].items()]))
        print("\ncached run, training thread, top functions by own time:")
        print(_top(parts["cached_profile"], 25))
        for name, tp in prof["thread_profiles"].items():
            print(f"--- {name} thread, top functions by own time ---")
            print(_top(tp, 12))
        figures["profile_ms_per_step"] = {
            k: {"resident": parts["resident"][k], "cached": parts["cached"][k]} for k in parts["resident"]
        }
        figures["profile_threads_ms_per_batch"] = prof["threads"]
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
