"""Cached vs resident vs naive host-embedding training of the default DLRM on one CUDA GPU.

Not run by CI (it needs a GPU; docs/benchmarks.md has the set-up and the figures). Four ways to train the same
model (``configs/dlrm_synthetic.yaml``: 26 Criteo-shaped tables, dim 16, batch 2,048, row-wise Adagrad
embeddings, Adagrad dense) on ``--device`` (default ``cuda``), alternated in one process:

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
  layers on the GPU. A plain PyTorch loop (no Lightning).

Figures: median step time and samples/s of each, and the ratios cached / resident, cached / resident with
background loading, FAE / resident and host / resident (JSON ``cached_over_resident``,
``cached_over_resident_background_loading``, ``fae_over_resident``, ``host_over_resident``,
``*_samples_per_s``). Add ``--scale 1.0`` for the Kaggle-sized tables (33.8 M rows; the host baseline then
moves the dense gradient of every table each step, which is why it is naive).

``--device cpu`` runs the same code paths on the CPU (a smoke test of the script where there is no GPU);
``--dry-run`` only computes and prints the cache capacities (no training).

    python benchmarks/gpu.py [--quick] [--json PATH] [--device cuda|cpu] [--scale 0.01] [--dry-run]
"""

from __future__ import annotations

import gc
import os
import sys
import time
from typing import Any, Dict, List, Optional

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import (  # noqa: E402
    CONFIG,
    batch_size,
    build,
    capacities,
    fae_settings,
    machine,
    median,
    parser,
    quiet,
    table,
    table_rows,
    train,
    write_json,
)


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
    cli: Any, capacity: Dict[str, int], steps: int, warmup: int, device: torch.device, accelerator: str
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
        callbacks=[HotColdScheduler(), _Sync.make(device)],
        accelerator=accelerator,
    )


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--config", default=CONFIG)
    p.add_argument(
        "--scale", type=float, default=None, help="table sizes = Kaggle sizes x scale (config: 0.01)"
    )
    p.add_argument("--fraction", type=float, default=0.05, help="cache rows / rows of each cached table")
    p.add_argument("--min-cached-rows", type=int, default=5000)
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds of (resident, resident_bg, cached, fae, host), rotated",
    )
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dry-run", action="store_true", help="only compute and print the capacities")
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
            "build of torch with fbgemm-gpu and torchrec (docs/benchmarks.md), or pass --device cpu to run the "
            "same code paths on the CPU, or --dry-run to only plan the capacities."
        )

    probe = build(args.config, overrides)
    capacity, bumped = capacities(probe.datamodule, args.fraction, args.min_cached_rows)
    rows = table_rows(probe.datamodule)
    print(
        f"device {device}; {len(capacity)} cached tables ({sum(rows[t] for t in capacity):,} of "
        f"{sum(rows.values()):,} rows), cache {sum(capacity.values()):,} rows; bumped: {bumped or 'none'}"
    )
    figures: Dict[str, Any] = {"device": str(device), "capacity": capacity, "bumped_from": bumped}
    if args.dry_run:
        write_json(args.json, figures)
        return figures
    accelerator = "gpu" if device.type == "cuda" else "cpu"
    kinds = ("resident", "resident_bg", "cached", "fae", "host")
    times: Dict[str, List[float]] = {k: [] for k in kinds}
    out_rows: List[Dict[str, Any]] = []
    for r in range(rounds):
        for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:  # rotated: load falls on each alike
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            cli = build(args.config, overrides)
            if kind == "host":
                res = host_embedding_run(cli, device, steps, args.warmup)
            elif kind == "fae":
                res = fae_run(cli, capacity, steps, args.warmup, device, accelerator)
            else:
                res = train(
                    cli,
                    capacity if kind == "cached" else None,
                    steps,
                    warmup=args.warmup,
                    callbacks=[_Sync.make(device)],
                    accelerator=accelerator,
                    background_loading=kind == "resident_bg",
                )
            times[kind] += res["times"]
            row = {"round": r, "kind": kind, "step_ms": res["step_ms"], "samples/s": res["samples_per_s"]}
            out_rows.append(row)
            print(table([row]).splitlines()[-1], flush=True)
            del res, cli
    batch = batch_size(build(args.config, overrides).datamodule)
    med = {k: median(v) * 1e3 for k, v in times.items()}
    figures.update(
        {
            **{f"{k}_step_ms": v for k, v in med.items()},
            **{f"{k}_samples_per_s": batch / v * 1e3 for k, v in med.items()},
            "cached_over_resident": med["cached"] / med["resident"],
            "cached_over_resident_background_loading": med["cached"] / med["resident_bg"],
            "fae_over_resident": med["fae"] / med["resident"],
            "host_over_resident": med["host"] / med["resident"],
            "rounds": rounds,
            "steps_per_run": steps,
        }
    )
    print()
    print(table(out_rows))
    print(
        f"\nmedian step: resident {med['resident']:.2f} ms (background loading {med['resident_bg']:.2f} ms), "
        f"cached {med['cached']:.2f} ms, FAE {med['fae']:.2f} ms, host {med['host']:.2f} ms; cached / resident "
        f"{figures['cached_over_resident']:.3f} (/ background loading "
        f"{figures['cached_over_resident_background_loading']:.3f}), host / resident "
        f"{figures['host_over_resident']:.3f}  on {machine()['cuda'] or machine()['cpu']}"
    )
    write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
