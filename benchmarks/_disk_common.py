"""The disk tier benchmark's job, its lookahead constants, the disk stores' counters and figures, and each run's host
budget (``disk_tier.py``)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import lightning.pytorch as pl

from benchmarks._common import build
from torchrec_lookahead.oracle import OracleConfig, min_capacity
from torchrec_lookahead.store import DiskStore

HORIZON, PREFETCH_DEPTH, QUEUE_DEPTH = 64, 1, 8  # the lookahead of benchmarks/_common.train and its loader
ROW_BYTES = (16 + 1) * 4  # a row of the job's tables: 16 floats and row-wise Adagrad's state
COUNTERS = (
    "rows_read",
    "rows_first_read",
    "rows_initialised",
    "unit_reads",
    "rows_prefetched",
    "prefetch_discarded",
    "host_hits",
)


def job(args: Any) -> Any:
    """The job's model and data (one epoch of exactly the batches the runs train)."""
    batches = args.steps + args.warmup + 2
    return build(
        overrides=[f"--data.init_args.scale={args.scale}", f"--data.init_args.num_train_batches={batches}"]
    )


def disk_stores(stores: Any) -> List[DiskStore]:
    """The disk stores among ``stores`` (unwrapped)."""
    out = []
    for store in stores:
        inner = getattr(store, "inner", store)
        if isinstance(inner, DiskStore):
            out.append(inner)
    return out


def counters(stores: List[DiskStore]) -> Dict[str, int]:
    """:data:`COUNTERS` summed over ``stores``."""
    return {k: sum(s.stats()[k] for s in stores) for k in COUNTERS}


class Midpoint(pl.Callback):
    """The disk stores' counters once ``at`` steps are done (the start of the run's second half)."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.snapshot: Optional[Dict[str, int]] = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.snapshot is None and trainer.global_step >= self.at:
            self.snapshot = counters(
                disk_stores(s for m in trainer.strategy.cached_modules() for s in m.cache.stores.values())
            )


def disk_figures(end: Dict[str, int], mid: Dict[str, int], steps: int, late_steps: int) -> Dict[str, float]:
    """Per step: rows read (first reads and re-reads), rows computed, units read, rows prefetched and discarded,
    host hits over the run; rows read and re-reads over its second half."""
    late = {k: end[k] - mid[k] for k in end}
    return {
        "rows_read_per_step": end["rows_read"] / steps,
        "initialised_per_step": end["rows_initialised"] / steps,
        "first_reads_per_step": end["rows_first_read"] / steps,
        "rereads_per_step": (end["rows_read"] - end["rows_first_read"]) / steps,
        "units_read_per_step": end["unit_reads"] / steps,
        "rows_prefetched_per_step": end["rows_prefetched"] / steps,
        "prefetch_discarded_per_step": end["prefetch_discarded"] / steps,
        "host_hits_per_step": end["host_hits"] / steps,
        "late_rows_read_per_step": late["rows_read"] / late_steps,
        "late_rereads_per_step": (late["rows_read"] - late["rows_first_read"]) / late_steps,
    }


def host_windows(cli: Any, capacity: Dict[str, int], depth: int) -> Dict[str, int]:
    """The rows of each cached table's largest host window (a batch and the next ``depth``) over the job's
    batches: the least its host tier may hold."""
    f2t = {f: f"t_{f}" for f in cli.datamodule.num_embeddings_per_feature}
    cli.datamodule.setup("fit")
    stream = (b.sparse_features for b in cli.datamodule.train_dataloader())
    return min_capacity(stream, depth, OracleConfig(capacity=capacity, feature_to_table=f2t))


def host_budgets(
    name: str, rows: Dict[str, int], windows: Dict[str, int]
) -> Tuple[Dict[str, int], List[str]]:
    """Run ``name``'s (``disk_<pct>[_lookahead]``) host bytes per cached table (``rows``): its share of the
    percentage, raised to its host window where below; and the tables raised."""
    share = {t: n * ROW_BYTES * int(name.split("_")[1]) // 100 for t, n in rows.items()}
    budgets = {t: max(share[t], windows[t] * ROW_BYTES) for t in rows}
    return budgets, sorted(t for t in rows if budgets[t] > share[t])


def disk_kwargs(
    name: str, args: Any, rows: Dict[str, int], windows: Dict[str, int]
) -> Tuple[int, Dict[str, Any], List[str]]:
    """The host budget, the sharder's disk options of run ``name`` (``disk_<pct>[_lookahead]``) and the tables
    whose share was raised to their host window."""
    budgets, raised = host_budgets(name, rows, windows)
    kwargs: Dict[str, Any] = {"store": "disk", "host_budget_bytes": budgets}
    if name.endswith("_lookahead"):
        kwargs["disk_options"] = {"host_policy": "lookahead", "disk_prefetch_depth": args.disk_prefetch_depth}
    return sum(budgets.values()), kwargs, raised


NO_DISK = dict.fromkeys(
    ("rows_read_per_step", "initialised_per_step", "first_reads_per_step", "rereads_per_step",
     "units_read_per_step",
     "rows_prefetched_per_step", "prefetch_discarded_per_step", "host_hits_per_step", "late_rows_read_per_step",
     "late_rereads_per_step"),
)  # fmt: skip
