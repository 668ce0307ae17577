"""Hierarchical training: quality against synchronous and flat averaging, and bytes on the critical path.

Quality (HT's Figure 7). Four gloo ranks (``torch.distributed.run --nproc_per_node=4``), the same model,
data, global batch (4 x ``--batch`` rows) and number of steps for every run; the final validation log-loss of
each run (the mean over the four ranks' validation shards):

* ``sync``: synchronous data parallel (``strategy="torchrec"``: DMP, DDP over all four ranks);
* ``flat_easgd``, ``flat_mean``: four dense replicas (``group_size=1``) averaged every ``--sync-every`` steps
  in the background, by EASGD and by the plain mean;
* ``ht_2x2``, ``ht_2x2_mean``: two groups of two (``group_size=2``, the tagger's placement), EASGD / mean in
  the background.

``ht_over_flat_val_logloss`` compares like with like (EASGD, two replicas against four).

The embedding tables are sharded over all four ranks and exact in every run; only the dense part differs.

Traffic (HT's Figures 8-11), from the tagger's cost model on the layer shapes (``_tagger.layer_cost``), per rank
and step, for the benchmark's model and for a wide one (HT's models have FC layers of thousands of units):

* synchronous data parallel: the ring all-reduce of every dense gradient over all ranks,
  ``2 (W-1)/W x dense bytes``;
* HT: the in-group traffic (gradient all-reduce of replicated layers, activations of split layers), with and
  without compression; background averaging is off the critical path;
* ablations: without the tagger's refinement (rules only), without co-partitioning, without compression.

Embedding traffic (TorchRec's all-to-all) is the same in both and left out. Examples/s are measured on this
machine (4 processes on its cores), reported as ratios to ``sync``.

    python benchmarks/hierarchical.py [--quick] [--json PATH] [--steps N] [--batch B] [--sync-every K]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import machine, parser, table, write_json  # noqa: E402
from torchrec_lookahead.models import DLRMModule  # noqa: E402
from torchrec_lookahead.strategies._splits import (  # noqa: E402
    Placement,
    consecutive_pairs,  # noqa: E402
    dense_linears,
)
from torchrec_lookahead.strategies._tagger import CostModel, _costs, tag  # noqa: E402

WORLD = 4
RUNS: Dict[str, Any] = {
    "sync": "torchrec",
    "flat_easgd": {"group_size": 1, "averaging": "easgd", "background": True},
    "flat_mean": {"group_size": 1, "averaging": "mean", "background": True},
    "ht_2x2": {"group_size": 2, "averaging": "easgd", "background": True},
    "ht_2x2_mean": {"group_size": 2, "averaging": "mean", "background": True},
}
MODEL = {"embedding_dim": 16, "dense_arch_layer_sizes": [64, 16], "over_arch_layer_sizes": [256, 64, 1]}
WIDE = {
    "embedding_dim": 64,
    "dense_arch_layer_sizes": [512, 256, 64],
    "over_arch_layer_sizes": [2048, 2048, 512, 1],
}


def _data_args(steps: int, batch: int) -> Dict[str, Any]:
    return dict(batch_size=batch, num_train_batches=steps * WORLD, num_val_batches=8 * WORLD, num_test_batches=4,
                scale=0.002, min_rows=200, zipf_exponent=1.05, seed=0)  # fmt: skip


def _worker(out: str, steps: int, batch: int, sync_every: int) -> None:
    """One torchrun process: every run in turn; rank 0 writes the results."""
    import lightning.pytorch as pl
    import torch.distributed as dist

    from benchmarks._common import StepTimer
    from torchrec_lookahead.data import CriteoSyntheticDataModule
    from torchrec_lookahead.optim import DenseOptimizerSpec, EmbeddingOptimizerSpec
    from torchrec_lookahead.strategies import HierarchicalStrategy

    results: Dict[str, Any] = {}
    for name, spec in RUNS.items():
        pl.seed_everything(0, verbose=False)
        dm = CriteoSyntheticDataModule(**_data_args(steps, batch))
        model = DLRMModule(dm.num_embeddings_per_feature, dm.num_dense_features, **MODEL,
                           embedding_optimizer=EmbeddingOptimizerSpec("rowwise_adagrad", lr=0.05),
                           dense_optimizer=DenseOptimizerSpec("adagrad", lr=0.05))  # fmt: skip
        strategy: Any = spec if isinstance(spec, str) else HierarchicalStrategy(sync_every=sync_every, **spec)
        timer = StepTimer(warmup=5)
        trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=steps, max_epochs=1,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                             callbacks=[timer])  # fmt: skip
        trainer.fit(model, datamodule=dm)
        if isinstance(strategy, HierarchicalStrategy) and strategy.averager is not None:
            strategy.averager.finish()
        trainer.limit_val_batches = 1.0
        val = trainer.validate(model, datamodule=dm, verbose=False)[0]
        step_s = sorted(timer.times)[len(timer.times) // 2]
        results[name] = {
            "val_logloss": float(val["val/logloss"]),
            "val_auc": float(val["val/auc"]),
            "examples_per_s": WORLD * batch / step_s,
        }
        dist.barrier()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))


def quality(steps: int, batch: int, sync_every: int) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "quality.json"
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
        }
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--standalone",
               __file__, "--worker", str(out), str(steps), str(batch), str(sync_every)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-4000:])
        return json.loads(out.read_text())


def _model(spec: Dict[str, Any]) -> torch.nn.Module:
    m = DLRMModule({f"cat_{i}": 100 for i in range(26)}, 13, **spec)
    return m.build_model(torch.device("meta"))


def traffic(spec: Dict[str, Any], batch: int, sync_every: int) -> List[Dict[str, Any]]:
    """Critical-path bytes per rank and step (and the cost model's step time) for the variants."""
    model = _model(spec)
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    lin = dense_linears(model, skip=(EmbeddingBagCollection,))
    dense_bytes = sum(4 * sum(p.numel() for p in layer.parameters()) for layer in lin.values())
    sync_bytes = 2 * (WORLD - 1) / WORLD * dense_bytes
    rows: List[Dict[str, Any]] = [
        {"variant": "sync data parallel", "critical_bytes": sync_bytes, "over_sync": 1.0}
    ]
    pairs = consecutive_pairs(model, lin)

    def variant(name: str, act: int, grad: int, refine: bool = True, copartition: bool = True) -> None:
        cm = CostModel(batch_size=batch, group_size=2, num_groups=WORLD // 2, sync_every=sync_every,
                       activation_bytes=act, gradient_bytes=grad, background=True)  # fmt: skip
        t = tag(model, lin, cm, refine=refine, copartition=copartition)
        costs = _costs(lin, t.placement, pairs if copartition else [], cm)
        crit = sum(c.group_bytes for c in costs.values())  # background averaging: off the critical path
        splits = sum(p is not Placement.REPLICATE for p in t.placement.values())
        rows.append({"variant": name, "critical_bytes": crit, "over_sync": crit / sync_bytes,
                     "split_layers": splits, "model_step_ms": 1e3 * sum(c.seconds(cm) for c in costs.values())})  # fmt: skip

    variant("HT 2x2, int8 + bf16", 1, 2)
    variant("HT 2x2, bf16", 4, 2)
    variant("HT 2x2, no compression", 4, 4)
    variant("HT 2x2, no refinement", 1, 2, refine=False)
    variant("HT 2x2, no co-partitioning", 1, 2, copartition=False)
    return rows


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 300; --quick 60)")
    p.add_argument(
        "--batch", type=int, default=None, help="rows per rank and step (default 256; --quick 128)"
    )
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--skip-quality", action="store_true", help="the traffic model only (no training)")
    args = p.parse_args(argv)
    steps = args.steps or (60 if args.quick else 300)
    batch = args.batch or (128 if args.quick else 256)
    figures: Dict[str, Any] = {"steps": steps, "batch_per_rank": batch, "sync_every": args.sync_every}
    if not args.skip_quality:
        q = quality(steps, batch, args.sync_every)
        rows = [{"run": k, **v, "examples_s_over_sync": v["examples_per_s"] / q["sync"]["examples_per_s"]}
                for k, v in q.items()]  # fmt: skip
        print(
            f"Quality: 4 gloo ranks, {steps} steps, global batch {WORLD * batch}, sync_every={args.sync_every}"
        )
        print(table(rows))
        figures["quality"] = q
        figures["ht_over_sync_val_logloss"] = q["ht_2x2"]["val_logloss"] / q["sync"]["val_logloss"]
        # like for like (the same averaging, two replicas instead of four), and against the better flat run
        figures["ht_over_flat_val_logloss"] = q["ht_2x2"]["val_logloss"] / q["flat_easgd"]["val_logloss"]
        figures["ht_mean_over_flat_mean_val_logloss"] = (
            q["ht_2x2_mean"]["val_logloss"] / q["flat_mean"]["val_logloss"]
        )
        best_ht = min(q["ht_2x2"]["val_logloss"], q["ht_2x2_mean"]["val_logloss"])
        best_flat = min(q["flat_easgd"]["val_logloss"], q["flat_mean"]["val_logloss"])
        figures["best_ht_over_best_flat_val_logloss"] = best_ht / best_flat
        figures["best_ht_over_sync_val_logloss"] = best_ht / q["sync"]["val_logloss"]
    for name, spec in (("benchmark model", MODEL), ("wide model", WIDE)):
        rows = traffic(spec, batch, args.sync_every)
        print(f"\nCritical-path bytes per rank and step, {name} ({spec['over_arch_layer_sizes']} over-arch), "
              f"batch {batch} per rank")  # fmt: skip
        print(table(rows, ["variant", "critical_bytes", "over_sync", "split_layers", "model_step_ms"]))
        key = "model" if spec is MODEL else "wide"
        figures[f"traffic_{key}"] = rows
        figures[f"ht_over_sync_critical_bytes_{key}"] = rows[1]["over_sync"]
        figures[f"ht_uncompressed_over_sync_critical_bytes_{key}"] = rows[3]["over_sync"]
    for k in ("ht_over_sync_val_logloss", "ht_over_flat_val_logloss", "ht_mean_over_flat_mean_val_logloss",
              "best_ht_over_best_flat_val_logloss", "best_ht_over_sync_val_logloss"):  # fmt: skip
        if k in figures:
            print(f"{k} = {figures[k]:.4f}")
    figures["machine"] = machine()
    write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
