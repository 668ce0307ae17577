"""Hierarchical training: quality against synchronous and flat averaging, and bytes on the critical path.

Quality (HT's Figure 7). Four gloo ranks (``torch.distributed.run --nproc_per_node=4``), the same model,
data, global batch (4 x ``--batch`` rows) and number of steps for every run; the final validation log-loss of
each run (the mean over the four ranks' validation shards):

* ``sync``: synchronous data parallel (``strategy="torchrec"``: DMP, DDP over all four ranks);
* ``flat_mean``, ``flat_easgd``: four dense replicas (``group_size=1``) averaged every ``--sync-every`` steps
  in the background, by the plain mean and by EASGD (the strategy's default);
* ``ht_2x2_mean``, ``ht_2x2``: two groups of two (``group_size=2``, the tagger's placement), the same two
  averagings in the background;
* ``ht_2x2_split``: ``ht_2x2`` (EASGD) with the over arch's first two layers split across each group (a
  co-partitioned pair), so the quality runs exercise real splits too.

Every hierarchical run is the strategy's defaults plus ``background=True`` (HT's ShadowSync rounds); each fit
ends with its groups on the replicas' mean (``average_at_end``). ``ht_over_flat_val_logloss`` compares like
with like (the same averaging, two replicas against four). ``--seeds`` repeats everything with other model
initialisations and data; the headline figures are means over seeds, with each seed's ratio beside them.

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
        [--elastic-alpha A] [--seeds 0,1,2]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import machine, parser, table, torchrun_worker, write_json  # noqa: E402
from torchrec_lookahead.launch import shutdown_distributed  # noqa: E402
from torchrec_lookahead.models import DLRMModule  # noqa: E402
from torchrec_lookahead.strategies._splits import (  # noqa: E402
    LayerPlacement,
    consecutive_pairs,  # noqa: E402
    dense_linears,
)
from torchrec_lookahead.strategies._tagger import CostModel, _costs, tag  # noqa: E402

WORLD = 4
RUNS: Dict[str, Any] = {
    "sync": "torchrec",
    "flat_mean": {"group_size": 1, "averaging": "mean"},
    "flat_easgd": {"group_size": 1, "averaging": "easgd"},
    "ht_2x2_mean": {"group_size": 2, "averaging": "mean"},
    "ht_2x2": {"group_size": 2, "averaging": "easgd"},
    # real splits: the over arch's first two layers as a co-partitioned pair (256 columns, then 256 rows)
    "ht_2x2_split": {"group_size": 2, "averaging": "easgd",
                     "placement": {"over_arch.model.0._mlp.0._linear": "colwise",
                                   "over_arch.model.0._mlp.1._linear": "rowwise"}},
}  # fmt: skip
MODEL = {"embedding_dim": 16, "dense_arch_layer_sizes": [64, 16], "over_arch_layer_sizes": [256, 64, 1]}
WIDE = {
    "embedding_dim": 64,
    "dense_arch_layer_sizes": [512, 256, 64],
    "over_arch_layer_sizes": [2048, 2048, 512, 1],
}


def _data_args(steps: int, batch: int, seed: int) -> Dict[str, Any]:
    return dict(batch_size=batch, num_train_batches=steps * WORLD, num_val_batches=8 * WORLD, num_test_batches=4,
                scale=0.002, min_rows=200, zipf_exponent=1.05, seed=seed)  # fmt: skip


def _worker(out: str, steps: int, batch: int, sync_every: int, seeds: List[int], alpha: float) -> None:
    """One torchrun process: every run in turn, for every seed; rank 0 writes the results."""
    import lightning.pytorch as pl
    import torch.distributed as dist

    from benchmarks._common import StepTimer
    from torchrec_lookahead.data import CriteoSyntheticDataModule
    from torchrec_lookahead.optim import DenseOptimizerSpec, EmbeddingOptimizerSpec
    from torchrec_lookahead.strategies import HierarchicalStrategy

    results: Dict[str, Any] = {}
    for seed in seeds:
        for name, spec in RUNS.items():
            pl.seed_everything(seed, verbose=False)
            dm = CriteoSyntheticDataModule(**_data_args(steps, batch, seed))
            model = DLRMModule(dm.num_embeddings_per_feature, dm.num_dense_features, **MODEL,
                               embedding_optimizer=EmbeddingOptimizerSpec("rowwise_adagrad", lr=0.05),
                               dense_optimizer=DenseOptimizerSpec("adagrad", lr=0.05))  # fmt: skip
            strategy: Any = spec
            if isinstance(
                spec, dict
            ):  # the replicas are validated, then averaged (the fit's default) and again
                kw = {"sync_every": sync_every, "elastic_alpha": alpha, **spec, "average_at_end": False}
                strategy = HierarchicalStrategy(**kw)
            timer = StepTimer(warmup=5)
            trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=steps, max_epochs=1,
                                 logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                                 callbacks=[timer])  # fmt: skip
            trainer.fit(model, datamodule=dm)
            trainer.limit_val_batches = 1.0  # the fit ended with every group on the replicas' mean
            val = trainer.validate(model, datamodule=dm, verbose=False)[0]
            step_s = sorted(timer.times)[len(timer.times) // 2]
            results.setdefault(name, []).append({"val_logloss": float(val["val/logloss"]),
                                                 "val_auc": float(val["val/auc"]),
                                                 "examples_per_s": WORLD * batch / step_s})  # fmt: skip
            dist.barrier()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))


def quality(steps: int, batch: int, sync_every: int, seeds: List[int], alpha: float) -> Dict[str, Any]:
    """Per run, one row per seed (``val_logloss``: after the fit's final averaging, the mean over the ranks'
    validation shards)."""
    figures: Dict[str, Any] = torchrun_worker(
        __file__, WORLD, str(steps), str(batch), str(sync_every), ",".join(map(str, seeds)), str(alpha)
    )
    return figures


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
        splits = sum(p is not LayerPlacement.REPLICATE for p in t.placement.values())
        step_ms = 1e3 * sum(c.seconds(cm) for c in costs.values())
        rows.append({"variant": name, "critical_bytes": crit, "over_sync": crit / sync_bytes,
                     "split_layers": splits, "model_step_ms": step_ms})  # fmt: skip

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
    p.add_argument(
        "--sync-every", type=int, default=1, help="steps between rounds (default: the strategy's, 1)"
    )
    p.add_argument(
        "--elastic-alpha", type=float, default=0.5, help="EASGD runs (default: the strategy's, 0.5)"
    )
    p.add_argument("--seeds", type=str, default=None, help="comma-separated seeds (default 0,1; --quick 0)")
    p.add_argument("--skip-quality", action="store_true", help="the traffic model only (no training)")
    args = p.parse_args(argv)
    steps = args.steps or (60 if args.quick else 300)
    batch = args.batch or (128 if args.quick else 256)
    seeds = [int(x) for x in (args.seeds or ("0" if args.quick else "0,1")).split(",")]
    figures: Dict[str, Any] = {"steps": steps, "batch_per_rank": batch, "sync_every": args.sync_every,
                               "elastic_alpha": args.elastic_alpha, "seeds": seeds}  # fmt: skip
    if not args.skip_quality:
        q = quality(steps, batch, args.sync_every, seeds, args.elastic_alpha)
        rows = [{"run": k, "seed": seed, **v,
                 "examples_s_over_sync": v["examples_per_s"] / q["sync"][i]["examples_per_s"]}
                for k, vs in q.items() for i, (seed, v) in enumerate(zip(seeds, vs))]  # fmt: skip
        print(f"Quality: 4 gloo ranks, {steps} steps, global batch {WORLD * batch}, sync_every={args.sync_every}, "
              f"elastic_alpha={args.elastic_alpha}, seeds {seeds}")  # fmt: skip
        print(table(rows))
        figures["quality"] = q

        def ratio(a: str, b: str) -> List[float]:
            return [x["val_logloss"] / y["val_logloss"] for x, y in zip(q[a], q[b])]

        # per seed, and the mean over seeds (the headline figures)
        for fig, (a, b) in {
            "ht_over_sync_val_logloss": ("ht_2x2", "sync"),
            "ht_over_flat_val_logloss": ("ht_2x2", "flat_easgd"),  # like for like: two replicas against four
            "ht_mean_over_sync_val_logloss": ("ht_2x2_mean", "sync"),
            "ht_mean_over_flat_mean_val_logloss": ("ht_2x2_mean", "flat_mean"),
            "ht_split_over_sync_val_logloss": ("ht_2x2_split", "sync"),
            "ht_split_over_flat_val_logloss": ("ht_2x2_split", "flat_easgd"),
        }.items():
            figures[f"{fig}_per_seed"] = ratio(a, b)
            figures[fig] = sum(figures[f"{fig}_per_seed"]) / len(seeds)
    for name, spec in (("benchmark model", MODEL), ("wide model", WIDE)):
        rows = traffic(spec, batch, args.sync_every)
        print(f"\nCritical-path bytes per rank and step, {name} ({spec['over_arch_layer_sizes']} over-arch), "
              f"batch {batch} per rank")  # fmt: skip
        print(table(rows, ["variant", "critical_bytes", "over_sync", "split_layers", "model_step_ms"]))
        key = "model" if spec is MODEL else "wide"
        figures[f"traffic_{key}"] = rows
        figures[f"ht_over_sync_critical_bytes_{key}"] = rows[1]["over_sync"]
        figures[f"ht_uncompressed_over_sync_critical_bytes_{key}"] = rows[3]["over_sync"]
    for k, v in figures.items():
        if k.endswith("val_logloss"):
            print(
                f"{k} = {v:.4f}  (per seed: {', '.join(f'{x:.4f}' for x in figures.get(k + '_per_seed', []))})"
            )
    figures["machine"] = machine()
    write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
                [int(x) for x in sys.argv[6].split(",")], float(sys.argv[7]))  # fmt: skip
        shutdown_distributed(exit_code=0)  # gloo's threads torn down by the interpreter can abort the rank
    else:
        main()
