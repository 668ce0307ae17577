"""Checks of :class:`~torchrec_lookahead.strategies.TorchRecStrategy` when its environment is set up, before
any process group, callback set-up or sharding: the launcher's process counts against the Trainer's, and
callbacks that cannot work on a model whose embedding tables the strategy builds and shards, or whose layers
are built in ``configure_model``."""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.callbacks import ModelPruning, WeightAveraging
from lightning.pytorch.trainer.states import TrainerFn

from torchrec_lookahead.errors import ConfigError, SetupError

__all__ = ["check_launcher", "refuse_unworkable_callbacks"]


def check_launcher(num_nodes: int, num_processes: int) -> None:
    """Refuse a launcher (torchrun) that started another number of processes than the Trainer is configured
    for: every process would train alone."""
    expected = num_nodes * num_processes
    launched = os.environ.get("WORLD_SIZE")
    if launched is not None and int(launched) != expected:
        raise SetupError(
            f"The launcher started WORLD_SIZE={launched} processes but the Trainer is configured for "
            f"{num_processes} device(s) x {num_nodes} node(s) = {expected}; every process would "
            f"train alone. Set devices={int(launched) // max(num_nodes, 1)} (accelerator='cpu' on CPU) "
            f"and num_nodes to match torchrun's --nproc_per_node and --nnodes."
        )
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None and int(local) != num_processes:
        raise SetupError(
            f"torchrun started LOCAL_WORLD_SIZE={local} processes per node but the Trainer uses "
            f"devices={num_processes}; set devices={local}"
        )


def refuse_unworkable_callbacks(trainer: Any, strategy_name: str) -> None:
    """Refuse, before a fit sets anything up, a ``ModelPruning`` without ``parameters_to_prune`` that would find
    no layers (they are built in ``configure_model``, after the callbacks' set-up: the first epoch's end failed
    with ``torch.cat(): expected a non-empty list of Tensors``), and Lightning's ``WeightAveraging`` callbacks
    (``EMAWeightAveraging`` and the like): at set-up they copy the LightningModule to the device before the
    strategy has built and sharded its embedding tables (still on the meta device, nothing to copy), and stopped
    the fit with torch's "Cannot copy out of meta tensor" traceback."""
    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return  # the callbacks copy or prune the model only to fit
    for callback in trainer.callbacks:
        if isinstance(callback, ModelPruning) and not callback._parameters_to_prune:
            module = trainer.lightning_module
            names = callback._parameter_names
            if not ModelPruning.sanitize_parameters_to_prune(module, (), parameter_names=names):
                raise ConfigError(
                    f"ModelPruning finds no {' or '.join(names)} parameters to prune in {type(module).__name__}: it "
                    "looks for them when the fit sets up, before configure_model builds the model's layers, and "
                    "would fail at the end of the first epoch; remove the callback from trainer.callbacks"
                )
        if isinstance(callback, WeightAveraging):
            raise ConfigError(
                f"{type(callback).__name__} cannot average a model trained with {strategy_name}: it copies the "
                "LightningModule before the strategy builds and shards its embedding tables; remove the callback "
                "from trainer.callbacks"
            )
