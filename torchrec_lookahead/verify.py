"""``python -m torchrec_lookahead verify --config <yaml> [--steps N]``: cached vs resident, side by side.

Trains the config as written (with its lookahead sharder and :class:`~torchrec_lookahead.data.LookaheadDataModule`)
and the same model with every table resident (TorchRec's own sharders, the unwrapped DataModule), with the
same seed, data order and optimizers, then prints one JSON line. The model may be any LightningModule whose
model holds TorchRec collections (the strategy finds them), its batches TorchRec ``Batch`` es or any others read
through the LookaheadDataModule's ``batch_adapter``::

    {"max_abs_weight_diff": 0.0, "max_abs_loss_diff": 0.0, "steps": 100, "tolerance": 0.0, "passed": true, ...}

and exits with status 1 when a difference exceeds the tolerance.
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from torchrec_lookahead.bundled import resolve_config_args
from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.export import resident_key
from torchrec_lookahead.launch import build_cli, shutdown_distributed

__all__ = ["verify", "comparable_state", "main", "QUIET_TRAINER_ARGS"]

QUIET_TRAINER_ARGS: Dict[str, Any] = dict(
    max_epochs=-1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    limit_val_batches=0,
    num_sanity_val_steps=0,
)
"""Trainer arguments of a measurement run: training steps only, nothing logged, saved or validated."""


class _LossRecorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: List[float] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))


def comparable_state(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Weights by a key that is the same for the cached and the resident model (wrapper names removed,
    sharded tensors gathered whole; with several ranks a collective, complete on rank 0); optimizer-state
    entries are left out."""
    out: Dict[str, torch.Tensor] = {}
    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    for key, value in module.state_dict().items():
        if isinstance(value, ShardedTensor):
            if multi:
                full = torch.zeros(value.size()) if dist.get_rank() == 0 else None
                value.gather(0, full)
                if full is None:
                    continue
                value = full
            else:
                shards = value.local_shards()
                if not shards:
                    continue
                value = shards[0].tensor
        if isinstance(value, DTensor):  # a dense layer split by the hierarchical strategy
            value = value.full_tensor()
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        if ("embedding_bags." in key or "embeddings." in key) and not key.endswith(".weight"):
            continue
        out[resident_key(key)] = value.detach().clone()
    return out


def _build(config: Union[str, Sequence[str]], overrides: Sequence[str]) -> Any:
    configs = [config] if isinstance(config, str) else list(config)
    return build_cli(resolve_config_args([a for c in configs for a in ("--config", c)]) + list(overrides))


def _train(
    cli: Any, resident: bool, steps: int, seed: int
) -> Tuple[Dict[str, torch.Tensor], List[float], List[str]]:
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    from torchrec_lookahead.callbacks import HotColdScheduler
    from torchrec_lookahead.data import LookaheadDataModule
    from torchrec_lookahead.strategies import HierarchicalStrategy, TorchRecStrategy

    strategy = cli.trainer.strategy
    if not isinstance(strategy, TorchRecStrategy):
        raise ConfigError(
            "verify needs strategy='torchrec' or 'hierarchical' (TorchRecStrategy or HierarchicalStrategy) but "
            f"the config uses {type(strategy).__name__}"
        )
    dm = cli.datamodule
    if resident and isinstance(dm, LookaheadDataModule):
        dm = dm.datamodule
    common: Dict[str, Any] = dict(
        sharders=None if resident else strategy._sharders,
        constraints=strategy._constraints,
        compute_kernel=strategy._compute_kernel,
        sharding_types=strategy._sharding_types,
        module_name=strategy._module_name,
        init_seed=strategy._init_seed,
    )
    if isinstance(strategy, HierarchicalStrategy) and not resident:
        # The configured hierarchical run against synchronous resident DMP training.
        strategy = HierarchicalStrategy(**strategy.hierarchical_kwargs(), **common)
    else:
        strategy = TorchRecStrategy(**common)
    recorder = _LossRecorder()
    # FAE's scheduler chooses the hot/cold interleaving, Lightning's GradientAccumulationScheduler the steps'
    # accumulation by epoch: both sides train with them. Callbacks that only watch (checkpoints, monitors) stay out.
    schedulers = [
        c for c in cli.trainer.callbacks if isinstance(c, (HotColdScheduler, GradientAccumulationScheduler))
    ]
    source = cli.trainer
    trainer = pl.Trainer(
        accelerator=source.accelerator,
        devices=len(source.device_ids),
        num_nodes=source.num_nodes,
        # what changes the arithmetic of a step, as configured (both sides alike)
        precision=source.precision,
        accumulate_grad_batches=source.accumulate_grad_batches,
        gradient_clip_val=source.gradient_clip_val,
        gradient_clip_algorithm=source.gradient_clip_algorithm,
        # which batches an epoch trains, as configured (fast_dev_run's limit is a debugging run's, not an epoch's)
        limit_train_batches=1.0 if source.fast_dev_run else source.limit_train_batches,
        overfit_batches=source.overfit_batches,
        reload_dataloaders_every_n_epochs=source.reload_dataloaders_every_n_epochs,
        detect_anomaly=source._detect_anomaly,
        strategy=strategy,
        max_steps=steps,
        callbacks=[recorder, *schedulers],
        **QUIET_TRAINER_ARGS,
    )
    # overfit_batches turns validation on (on the training batches): the measurement trains only
    trainer.limit_val_batches = 0
    pl.seed_everything(seed, verbose=False)
    trainer.fit(cli.model, datamodule=dm)
    strategy.flush_caches()
    notes = [] if resident else _inexact_notes(strategy)
    return comparable_state(cli.model), recorder.losses, notes


def _inexact_notes(strategy: Any) -> List[str]:
    """Why the cached side may not be bit-exact: hierarchical training's group averaging, cDLRM's cache averaging,
    or caches trained with the PyTorch kernel for an optimizer FBGEMM has on the device (the resident side trains
    with FBGEMM's kernel)."""
    import dataclasses

    from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
    from torchrec_lookahead.distributed._optimizers import optimizer_differences
    from torchrec_lookahead.strategies import HierarchicalStrategy, TorchRecStrategy

    notes = []
    if isinstance(strategy, TorchRecStrategy) and strategy._compute_kernel is None:
        notes.append(
            "compute_kernel: null lets TorchRec's planner choose the resident side's kernels (data_parallel "
            "trains a small table with the dense optimizer), while the cache trains the embedding optimizer: set "
            "compute_kernel: fused for a bit-exact comparison"
        )
    if isinstance(strategy, HierarchicalStrategy) and strategy.num_groups > 1:
        notes.append(
            f"hierarchical training with {strategy.num_groups} groups averages the groups' dense replicas "
            f"({strategy.averaging.value}, every {strategy.sync_every} steps) instead of synchronising every step: "
            "approximate by design (docs/design.md, Hierarchical training); one group (group_size = the ranks) "
            "is exact"
        )
    if isinstance(strategy, HierarchicalStrategy) and strategy.compression.value != "none":
        # traffic between the ranks of a group: groups of one rank send nothing and compress nothing (exact)
        if strategy.group_size > 1:
            what = (
                "gradients" if strategy.compression.value == "bf16" else "gradients and forward activations"
            )
            notes.append(
                f"hierarchical compression: {strategy.compression.value} rounds the group's {what} on the way "
                "between ranks: approximate by design; compression: none is exact with one group"
            )
    sharders = strategy._sharders if isinstance(strategy, TorchRecStrategy) else None
    for sharder in sharders or ():
        declared = (
            sharder.overridden_optimizer
            if isinstance(sharder, LookaheadEmbeddingBagCollectionSharder)
            else None
        )
        if declared is not None:
            notes.append(
                "the sharder's optimizer replaces the one the model declares on the cached tables, which the "
                f"resident side trains with ({optimizer_differences(sharder.optimizer, declared)}): drop one of "
                "the two for a bit-exact comparison"
            )
    for m in strategy.cached_modules():
        if m.average_every is not None:
            notes.append(
                f"cDLRM mode (cdlrm_average_every={m.average_every}) averages the ranks' caches instead of "
                "summing gradients: approximate by design (see docs/design.md, cDLRM mode)"
            )
        cfg = m.cache.optimizer_config
        device = m.cache.device.type
        if not cfg.uses_fbgemm(device) and dataclasses.replace(cfg, kernel="auto").uses_fbgemm(device):
            notes.append(
                f"the cache trains {cfg.optim.value} with the PyTorch kernel (kernel='torch') while the resident "
                "tables train with FBGEMM's: equal to rounding only (about one ulp a step; bit-exact for SGD on "
                "unweighted features); use kernel='auto' for bit-exact training"
            )
    return sorted(set(notes))


def _check_caches_something(cli: Any, config: Union[str, Sequence[str]]) -> None:
    """Refuse a config without cached tables: verify would compare resident training with itself."""
    from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
    from torchrec_lookahead.strategies import TorchRecStrategy

    if not isinstance(cli.trainer.strategy, TorchRecStrategy):
        return  # refused with its own message when training starts
    sharders = cli.trainer.strategy._sharders or []
    if not any(
        isinstance(s, LookaheadEmbeddingBagCollectionSharder)
        and (s.capacity or s.device_budget_bytes is not None)
        for s in sharders
    ):
        raise ConfigError(
            f"verify compares cached with resident training, but {config} caches no table: its strategy has no "
            "LookaheadEmbeddingBagCollectionSharder with capacity or device_budget_bytes (see "
            "configs/dlrm_tiny_lookahead.yaml); add one, or use fit to train the resident model"
        )


def _check_resident_side(cli: Any) -> None:
    """Refuse, before the cached side trains, a config whose resident side cannot train here: on the CPU every
    resident table trains with FBGEMM's fused kernel, which lacks some optimizers the cache's kernel has."""
    from lightning.pytorch.accelerators import CPUAccelerator

    from torchrec_lookahead.models import TorchRecModule
    from torchrec_lookahead.strategies import TorchRecStrategy
    from torchrec_lookahead.strategies._sharding import cpu_fuses, cpu_unfused_optimizer

    strategy = cli.trainer.strategy
    if not isinstance(strategy, TorchRecStrategy) or strategy._compute_kernel != "fused":
        return
    if not isinstance(cli.trainer.accelerator, CPUAccelerator):
        return
    # a module of the bundled kind declares its tables' optimizer now and builds them at set-up; another may have
    # built them already
    found = cpu_unfused_optimizer(cli.model)
    if found is None and isinstance(cli.model, TorchRecModule):
        optimizer = cli.model.embedding_optimizer.optimizer_class()
        found = None if cpu_fuses(optimizer) else (optimizer.__name__, "")
    if found is not None:
        where = f" (table parameter {found[1]!r})" if found[1] else ""
        raise ConfigError(
            f"verify cannot compare this config on the CPU: its resident side trains every table with FBGEMM's "
            f"fused kernel, which has no {found[0]} on CPU{where}; run verify on CUDA, or with an embedding "
            "optimizer FBGEMM's CPU kernel has (sgd, rowwise_adagrad, adagrad)"
        )


def verify(
    config: str, steps: int = 100, tolerance: float = 0.0, overrides: Sequence[str] = ()
) -> Dict[str, Any]:
    """Train ``config`` cached and resident for ``steps`` steps and compare weights and losses.

    The default tolerance is 0: cached training is the resident training's arithmetic, bit for bit, on one
    rank and on several (against TorchRec's ``DistributedModelParallel`` with the same ranks).

    Returns:
        On rank 0 (and with one process): ``max_abs_weight_diff``, ``max_abs_loss_diff``, ``steps`` (the
        shorter run's), ``tolerance``, ``passed`` (both differences within ``tolerance`` and the runs equally
        long), ``tensors`` (compared weight tensors), ``worst`` (the key with the largest difference) and,
        where a cached table trains with arithmetic that is not the resident side's, ``notes`` saying which
        and why. On the other ranks of a multi-rank run, only ``{"passed": None, "rank": <rank>}``: the
        comparison is complete on rank 0, and :func:`main` broadcasts it.

    Raises:
        ConfigError: ``steps < 1``, ``tolerance`` negative or not finite (both checked before anything trains), a
            config file is missing, the config caches no table or does not use
            ``strategy="torchrec"``, or the two models have different weights.
    """
    if steps < 1:
        raise ConfigError(f"Expected steps >= 1 but got {steps}")
    if (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, numbers.Real)
        or not 0 <= tolerance < math.inf
    ):
        raise ConfigError(
            f"tolerance must be a finite number >= 0 but got {tolerance!r}; give the largest absolute difference "
            "that passes (0, the default: bit-exact)"
        )
    cached_cli = _build(config, overrides)
    _check_caches_something(cached_cli, config)
    _check_resident_side(cached_cli)
    seed = cached_cli.config.get("seed_everything")
    if isinstance(seed, bool) or seed is None:
        # seed_everything true/false would give the two runs different random dense weights: fix it.
        seed = 0
        cached_cli = _build(config, [*overrides, "--seed_everything=0"])
    seed = int(seed)
    overrides = [*overrides, f"--seed_everything={seed}"]
    cached_w, cached_l, notes = _train(cached_cli, resident=False, steps=steps, seed=seed)
    resident_w, resident_l, _ = _train(_build(config, overrides), resident=True, steps=steps, seed=seed)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        # The comparison is complete on rank 0 only; main() broadcasts it.
        return {"passed": None, "rank": dist.get_rank()}
    missing = sorted(set(resident_w) ^ set(cached_w))
    if missing:
        raise ConfigError(f"The cached and resident models have different weights: {missing[:10]}")
    # Store-backed tables come back on the host, device-resident ones on the accelerator: compare on the CPU.
    diffs = {k: (cached_w[k].cpu() - resident_w[k].cpu()).abs().max().item() for k in resident_w}
    worst = max(diffs, key=lambda k: diffs[k])
    loss_diff = max((abs(a - b) for a, b in zip(cached_l, resident_l)), default=0.0)
    weight_diff = diffs[worst]
    return {
        "max_abs_weight_diff": weight_diff,
        "max_abs_loss_diff": loss_diff,
        "steps": min(len(cached_l), len(resident_l)),
        "tolerance": tolerance,
        "passed": bool(
            weight_diff <= tolerance and loss_diff <= tolerance and len(cached_l) == len(resident_l)
        ),
        "tensors": len(diffs),
        "worst": worst,
        **({"notes": notes} if notes else {}),
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m torchrec_lookahead verify``; returns the exit status."""
    p = argparse.ArgumentParser(
        prog="python -m torchrec_lookahead verify", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--config",
        required=True,
        action="append",
        help="LightningCLI YAML config(s) with a lookahead sharder",
    )
    p.add_argument("--steps", type=int, default=100)
    p.add_argument(
        "--tolerance", type=float, default=0.0, help="largest difference that passes (default: bit-exact)"
    )
    args, overrides = p.parse_known_args(argv)
    code = _run_and_report(args, overrides)
    shutdown_distributed(exit_code=code)
    return code


def _run_and_report(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    result = verify(args.config, args.steps, args.tolerance, overrides)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        holder = [result]
        dist.broadcast_object_list(holder, src=0)  # rank 0 holds the whole comparison
        result = holder[0]
        if dist.get_rank() != 0:
            return 0 if result["passed"] else 1
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0 if result["passed"] else 1
