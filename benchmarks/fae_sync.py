"""FAE on two ranks: what the pinned hot rows cost and save in synchronisation, against the LRPP cache alone.

The default job's data (``CriteoSyntheticDataModule``) on ``W = 2`` gloo ranks (``torch.distributed.run``), two
runs in the same processes, one after the other:

* ``lookahead``: every large table behind the lookahead cache (configs/dlrm_lookahead.yaml's capacities, doubled
  for the global batch of two ranks), LRPP with exact gradient exchange;
* ``fae``: FAE's hot/cold batches with the ``HotColdScheduler`` and the hot rows (4 MiB budget) pinned in the
  same caches (capacity = pinned rows + the same dynamic slots): every rank holds every hot row, and the
  gradients of every bag reading one travel in the step's exchange.

Per step and rank: gradient bytes sent in the exchange (``grad_bytes_per_step``: the hot rows' reduction plus
LRPP's shared rows), rows whose gradients were synchronised by LRPP (``rows_grad_synced_per_step``), rows
refreshed from another rank (``rows_refreshed_per_step``), rows fetched from the host stores per trained sample,
and the median step time. Headline: ``fae_over_lookahead_grad_bytes`` and ``fae_over_lookahead_rows_fetched``.

    python benchmarks/fae_sync.py [--quick] [--json PATH] [--steps 100] [--batch-size 1024]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._common import machine, parser, table, torchrun_worker, write_json  # noqa: E402
from torchrec_lookahead.launch import shutdown_distributed  # noqa: E402

WORLD = 2
MIB = 1 << 20


def _worker(out: str, steps: int, batch: int) -> None:
    """One torchrun process: both runs in turn; rank 0 writes the results."""
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    import yaml

    from benchmarks._common import StepTimer
    from benchmarks.fae import default_model
    from torchrec_lookahead.callbacks import HotColdScheduler
    from torchrec_lookahead.data import CriteoSyntheticDataModule, LookaheadDataModule
    from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
    from torchrec_lookahead.fae import HotColdDataModule
    from torchrec_lookahead.strategies import TorchRecStrategy

    cfg = yaml.safe_load((REPO / "configs" / "dlrm_lookahead.yaml").read_text())
    base = cfg["trainer"]["strategy"]["init_args"]["sharders"][0]["init_args"]["capacity"]
    dynamic = {t: WORLD * int(c) for t, c in base.items()}  # rows for the global batch
    results: Dict[str, Any] = {}
    for kind in ("lookahead", "fae"):
        pl.seed_everything(0, verbose=False)
        inner = CriteoSyntheticDataModule(
            batch_size=batch, num_train_batches=steps * WORLD, num_val_batches=2
        )
        dm: Any = LookaheadDataModule(inner, horizon=64)
        callbacks: List[Any] = []
        capacity = dict(dynamic)
        if kind == "fae":
            hot = HotColdDataModule(inner, hot_budget_bytes=4 * MIB, embedding_dim=16)
            hot.setup("fit")
            assert hot.hot_set is not None
            capacity = {t: c + hot.hot_set.hot_rows[t] for t, c in capacity.items()}
            dm = LookaheadDataModule(hot, horizon=64)
            callbacks.append(HotColdScheduler())
        strategy = TorchRecStrategy(sharders=[LookaheadEmbeddingBagCollectionSharder(capacity=capacity)])
        timer = StepTimer(warmup=5)
        trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=steps, max_epochs=1,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                             callbacks=[*callbacks, timer])  # fmt: skip
        trainer.fit(default_model(inner), datamodule=dm)
        session = strategy.cache_session()
        assert session is not None
        stats = session.stats()
        counters = {k: float(v) for k, v in stats.sync.items()}
        fetched = sum(s["rows_fetched"] for s in stats.tables.values())
        sent = torch.tensor([counters.get("grad_floats_sent", 0.0), float(fetched)], dtype=torch.float64)
        dist.all_reduce(sent)  # both ranks' exchange floats and fetched rows
        n = max(trainer.global_step, 1)
        step_s = sorted(timer.times)[len(timer.times) // 2]
        results[kind] = {
            "grad_bytes_per_step": 4.0 * float(sent[0]) / n / WORLD,
            "rows_grad_synced_per_step": counters.get("rows_grad_synced", 0.0) / n,
            "rows_refreshed_per_step": counters.get("rows_refreshed", 0.0) / n,
            "rows_fetched_per_sample": float(sent[1]) / (n * WORLD * batch),
            "device_cache_rows": float(sum(capacity.values())),
            "median_step_ms": 1e3 * step_s,
            "steps": float(trainer.global_step),
        }
        dist.barrier()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))


def sync(steps: int, batch: int) -> Dict[str, Any]:
    """Both runs under ``torch.distributed.run`` with two ranks; their per-step figures."""
    figures: Dict[str, Any] = torchrun_worker(__file__, WORLD, str(steps), str(batch))
    return figures


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        _worker(argv[1], int(argv[2]), int(argv[3]))
        shutdown_distributed(exit_code=0)  # gloo's threads torn down by the interpreter can abort the rank
        return {}
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="steps of each run (default 100; --quick 20)")
    p.add_argument("--batch-size", type=int, default=None, help="rows per rank (default 1024; --quick 256)")
    args = p.parse_args(argv)
    steps = args.steps if args.steps is not None else (20 if args.quick else 100)
    batch = args.batch_size if args.batch_size is not None else (256 if args.quick else 1024)
    print(machine())
    runs = sync(steps, batch)
    print(table([{"run": k, **v} for k, v in runs.items()]))
    la, fae = runs["lookahead"], runs["fae"]
    headline = {
        "fae_over_lookahead_grad_bytes": fae["grad_bytes_per_step"] / max(la["grad_bytes_per_step"], 1e-9),
        "fae_over_lookahead_rows_fetched": fae["rows_fetched_per_sample"]
        / max(la["rows_fetched_per_sample"], 1e-9),
        "fae_over_lookahead_step_time": fae["median_step_ms"] / la["median_step_ms"],
    }
    print(headline)
    write_json(
        args.json, {**headline, "runs": runs, "steps": steps, "batch_size": batch, "quick": args.quick}
    )
    return runs


if __name__ == "__main__":
    main()
