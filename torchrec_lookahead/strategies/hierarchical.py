"""``strategy="hierarchical"``: Hierarchical Training (HT, KDD'21) under Lightning and TorchRec.

The ranks form groups of ``group_size`` consecutive ranks (default: the ranks of one node). Everything
:class:`~torchrec_lookahead.strategies.TorchRecStrategy` does stays: the embedding tables are sharded over
*all* ranks by ``DistributedModelParallel`` (and the lookahead cache where configured), so their updates are
synchronous and exact (HT's shared sparse servers). What changes is the dense part:

* **one dense replica per group**: inside a group each rank reads its own batch; the linear layers the
  placement splits run over the group's gathered batch (torch tensor parallelism on a 2-D ``DeviceMesh``,
  groups x in-group), the rest are replicated with DDP over the group's process group;
* **across groups** the replicas are averaged every ``sync_every`` steps (EASGD with a center variable, or
  the plain mean), optionally in the background on a process group of their own;
* **compression** of the in-group traffic: bf16 gradients, int8 forward activations with per-row scales.

One group (``group_size`` = world size) is synchronous DMP training; several groups trade exactness for fewer
dense replicas, which HT found is what costs quality.

Example:
    >>> s = HierarchicalStrategy(group_size=2, sync_every=4, averaging="easgd", elastic_alpha=0.3)
    >>> s.strategy_name, s.sync_every
    ('hierarchical', 4)
    >>> HierarchicalStrategy(sync_every=0)
    Traceback (most recent call last):
    ...
    torchrec_lookahead.errors.ConfigError: Expected sync_every to be a positive integer but got 0
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.model_parallel import DataParallelWrapper
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.optimizers import in_backward_optimizer_filter
from typing_extensions import override

from torchrec_lookahead._checks import check_dataclass
from torchrec_lookahead.data import trainer_datamodules
from torchrec_lookahead.data.wrapper import WrappedDataModule
from torchrec_lookahead.errors import ConfigError, SetupError
from torchrec_lookahead.optim import _enum
from torchrec_lookahead.strategies._averaging import Averaging, ReplicaAverager
from torchrec_lookahead.strategies._compression import bf16_allreduce_hook
from torchrec_lookahead.strategies._ddp import DenseDataParallelWrapper
from torchrec_lookahead.strategies._splits import (
    LayerPlacement,
    SplitLayer,
    apply_splits,
    dense_linears,
    resolve_placement,
    scale_split_gradients,
)
from torchrec_lookahead.strategies._tagger import CostModel, Tagging, tag
from torchrec_lookahead.strategies.torchrec import TorchRecStrategy

__all__ = ["HierarchicalStrategy", "Averaging", "Compression", "LayerPlacement"]

_STATE_DIR = "hierarchical"


class Compression(str, enum.Enum):
    """Compression of the in-group traffic."""

    NONE = "none"
    BF16 = "bf16"
    INT8 = "int8"


# Backends known to carry bf16 and int8 tensors in the collectives compression uses.
_COMPRESSING_BACKENDS = ("gloo", "nccl")


def _positive_int(value: Any, arg: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"Expected {arg} to be a positive integer but got {value!r}")
    return value


class _GroupDataParallelWrapper(DenseDataParallelWrapper):
    """TorchRec's data-parallel wrapper inside one group: splits the placed layers over the group's mesh, then
    wraps the rest of the dense part in DDP over the group's process group (DDP cannot hold the DTensor
    parameters; it ignores them, and their gradients come out of the tensor-parallel collectives)."""

    def __init__(
        self,
        mesh: DeviceMesh,
        layers: Callable[[nn.Module], List[SplitLayer]],
        compression: Compression = Compression.NONE,
    ) -> None:
        super().__init__()
        self._mesh = mesh
        self._layers = layers
        self._compression = compression
        self.split_parameters: List[str] = []
        self.hooked: List[nn.Parameter] = []

    @override
    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        if isinstance(dmp._dmp_wrapped_module, nn.parallel.DistributedDataParallel):
            return
        module = dmp._dmp_wrapped_module
        sharded = set(DistributedModelParallel._sharded_parameter_names(module))
        self.split_parameters = apply_splits(
            module, self._mesh, self._layers(module), self._compression.value
        )
        group = self._mesh.get_group()
        self._ddp_wrap(
            dmp, ShardingEnv.from_process_group(group), device, sharded | set(self.split_parameters)
        )
        ddp = dmp._dmp_wrapped_module
        # After DDP: its module.to() replaces DTensor parameters (and would drop hooks set before).
        self.hooked = scale_split_gradients(ddp, self._mesh.size())
        if (
            self._compression is not Compression.NONE
            and isinstance(ddp, nn.parallel.DistributedDataParallel)
            and group.size() > 1
        ):
            # Registered here on every device: Lightning registers DDP hooks on CUDA only. A group of one rank
            # sends nothing: its gradients are not rounded to bf16 for a transfer that does not happen.
            ddp.register_comm_hook(group, bf16_allreduce_hook)


class HierarchicalStrategy(TorchRecStrategy):
    """Groups of ranks, each holding one dense replica; replicas averaged across groups.

    Args:
        group_size: ranks per group (consecutive ranks); default: the ranks of one node, so in-group traffic
            stays on the host and only averaging crosses hosts. Must divide the world size.
        sync_every: optimizer steps between averaging rounds (>= 1).
        averaging: ``"easgd"`` (elastic averaging with a center variable, HT's choice; the default) or
            ``"mean"`` (plain periodic model averaging, ShadowSync's MA, the baseline torch ships). EASGD's
            center receives no gradient and halves the replicas' progress while the model drifts (a smaller
            effective dense learning rate, see :mod:`~torchrec_lookahead.strategies._averaging`); on the default
            job that gave 0.990 of synchronous training's validation log-loss over three seeds, the mean 1.007
            (docs/benchmarks.md).
        elastic_alpha: EASGD's moving rate, in (0, 1].
        background: run each round's all-reduce on a snapshot on a process group of its own and apply it at the
            next round (ShadowSync), instead of blocking the step.
        compression: in-group traffic compression, ``"none"``, ``"bf16"`` (gradients) or ``"int8"`` (bf16
            gradients and int8 forward activations with per-row scales).
        placement: ``"auto"`` (the tagger decides), ``"replicate"`` (every layer replicated: data parallel
            inside the group), or a mapping from a dense linear layer's module path (inside the sharded model)
            to ``"colwise"`` / ``"rowwise"`` / ``"replicate"``; layers not named are placed by the tagger.
        cost_model: rates the tagger weighs (batch size, bandwidths, memory), a ``CostModel`` or a dict of its
            fields; the group layout fills in.
        average_at_end: when a fit ends, a blocking round sets every group's replica (and the EASGD center) to
            the groups' mean, so the fit leaves one model, as synchronous training does (the replicas differ by
            their local steps since the last round; their mean is the better model). Off: each group keeps its
            own replica.
        **kwargs: passed to :class:`~torchrec_lookahead.strategies.TorchRecStrategy`.

    Raises:
        ConfigError: an argument outside its valid values (at construction), a group size that does not divide
            the world size or compression on a backend that cannot carry it (when the Trainer is built), a
            placement that names a missing module, a module that is not a linear layer, or a width the group
            size does not divide (at set-up, before training).
    """

    strategy_name = "hierarchical"

    def __init__(
        self,
        group_size: Optional[int] = None,
        sync_every: int = 1,
        averaging: Union[str, Averaging] = "easgd",
        elastic_alpha: float = 0.5,
        background: bool = False,
        compression: Union[str, Compression] = "none",
        placement: Union[str, Mapping[str, str]] = "auto",
        cost_model: Optional[CostModel] = None,
        average_at_end: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.group_size_arg = None if group_size is None else _positive_int(group_size, "group_size")
        self.sync_every = _positive_int(sync_every, "sync_every")
        self.averaging: Averaging = _enum(Averaging, averaging, "averaging")
        if isinstance(elastic_alpha, bool) or not isinstance(elastic_alpha, (int, float)):
            raise ConfigError(f"Expected elastic_alpha to be a number in (0, 1] but got {elastic_alpha!r}")
        if not 0.0 < float(elastic_alpha) <= 1.0:
            raise ConfigError(f"Expected elastic_alpha in (0, 1] but got {elastic_alpha}")
        self.elastic_alpha = float(elastic_alpha)
        if not isinstance(background, bool):
            raise ConfigError(f"Expected background to be True or False but got {background!r}")
        self.background = background
        if not isinstance(average_at_end, bool):
            raise ConfigError(f"Expected average_at_end to be True or False but got {average_at_end!r}")
        self.average_at_end = average_at_end
        self.compression: Compression = _enum(Compression, compression, "compression")
        if isinstance(placement, str):
            if placement not in ("auto", "replicate"):
                raise ConfigError(
                    f"Expected placement to be 'auto', 'replicate' or a mapping from module path to one of "
                    f"{[p.value for p in LayerPlacement]} but got {placement!r}"
                )
            self.placement: Union[str, Dict[str, LayerPlacement]] = placement
        elif isinstance(placement, Mapping):
            self.placement = {
                str(k): _enum(LayerPlacement, v, f"placement of {k!r}") for k, v in placement.items()
            }
        else:
            raise ConfigError(
                f"Expected placement to be 'auto', 'replicate' or a mapping but got {placement!r}"
            )
        # a dict is built into the model as a config file's {batch_size: ..., ...} is
        self.cost_model = None if cost_model is None else check_dataclass("cost_model", cost_model, CostModel)
        self.mesh: Optional[DeviceMesh] = None
        self.averager: Optional[ReplicaAverager] = None
        self.tagging: Optional[Tagging] = None
        self._wrapper: Optional[_GroupDataParallelWrapper] = None
        self._average_group: Optional[dist.ProcessGroup] = None

    def hierarchical_kwargs(self) -> Dict[str, Any]:
        """The arguments this class adds to :class:`TorchRecStrategy`'s, as given (for a copy of the strategy).

        Example:
            >>> HierarchicalStrategy(sync_every=3).hierarchical_kwargs()["sync_every"]
            3
        """
        return {
            "group_size": self.group_size_arg,
            "sync_every": self.sync_every,
            "averaging": self.averaging,
            "elastic_alpha": self.elastic_alpha,
            "background": self.background,
            "compression": self.compression,
            "placement": self.placement,
            "cost_model": self.cost_model,
            "average_at_end": self.average_at_end,
        }

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:  # type: ignore[override]
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Hierarchical training: dense replicas per group, averaged across",
        )

    # ----------------------------------------------------------------------------------------------- layout
    @property
    def group_size(self) -> int:
        """Ranks per group."""
        return self.group_size_arg or self.num_processes

    @property
    def num_groups(self) -> int:
        return max(1, (self.num_nodes * self.num_processes) // self.group_size)

    def _check_environment(self) -> None:
        world = self.num_nodes * self.num_processes
        if world % self.group_size:
            divisors = [d for d in range(1, world + 1) if world % d == 0]
            raise ConfigError(
                f"group_size={self.group_size} does not divide the world size {world} "
                f"({self.num_processes} device(s) x {self.num_nodes} node(s)); use one of {divisors}"
            )
        backend = self._get_process_group_backend()
        if self.compression is not Compression.NONE and backend not in _COMPRESSING_BACKENDS:
            raise ConfigError(
                f"compression={self.compression.value!r} needs a backend that carries bf16 and int8 tensors "
                f"({list(_COMPRESSING_BACKENDS)}) but the process group backend is {backend!r}; use "
                "compression='none' or one of those backends"
            )

    @override
    def _configure_launcher(self) -> None:
        self._check_environment()
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        self._check_environment()
        super().setup_environment()

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        g, p = self.group_size, self.world_size // self.group_size
        self.mesh = init_device_mesh(self.root_device.type, (p, g), mesh_dim_names=("across", "within"))
        if p > 1:
            # A process group of its own per in-group index, for the averaging rounds (every rank creates every
            # group, in the same order).
            for i in range(g):
                ranks = [k * g + i for k in range(p)]
                pg = dist.new_group(ranks=ranks, backend="gloo" if self.root_device.type == "cpu" else None)
                if self.global_rank in ranks:
                    self._average_group = pg

    # ------------------------------------------------------------------------------------------- placement
    def _cost_model(self) -> CostModel:
        cm = self.cost_model or CostModel(batch_size=self._batch_size())
        return CostModel(
            **{
                **cm.__dict__,
                "group_size": self.group_size,
                "num_groups": self.num_groups,
                "sync_every": self.sync_every,
                "background": self.background,
                "activation_bytes": 1 if self.compression is Compression.INT8 else 4,
                "gradient_bytes": 2 if self.compression is not Compression.NONE else 4,
            }
        )

    def _batch_size(self) -> int:
        """Rows each rank reads per step, for the cost model: the DataModule's (or, through wrappers such as the
        lookahead and hot/cold ones, the first wrapped DataModule's that tells it), else the cost model's 1024."""
        lm = self.lightning_module
        dm, _ = trainer_datamodules(lm._trainer if lm is not None else None)
        while dm is not None:
            size = _batch_size_of(dm)
            if size is not None:
                return size
            dm = dm.datamodule if isinstance(dm, WrappedDataModule) else None
        return CostModel.batch_size

    def split_layers(self, model: nn.Module) -> List[SplitLayer]:
        """Tag ``model``'s dense linear layers (collective-free, identical on every rank) and check the
        result."""
        linears = dense_linears(model, skip=(EmbeddingBagCollection,))
        if self.placement == "replicate":
            fixed: Dict[str, LayerPlacement] = {p: LayerPlacement.REPLICATE for p in linears}
        else:
            fixed = dict(self.placement) if isinstance(self.placement, dict) else {}
        # The user's placement is checked first, so a bad path fails with its own message.
        resolve_placement(model, {k: v.value for k, v in fixed.items()}, self.group_size, linears)
        self.tagging = tag(model, linears, self._cost_model(), fixed=fixed)
        rank_zero_info(f"Hierarchical placement (group_size={self.group_size}):\n{self.tagging.table()}")
        chosen = {k: v.value for k, v in self.tagging.placement.items()}
        return resolve_placement(model, chosen, self.group_size, linears)

    @override
    def data_parallel_wrapper(self) -> Optional[DataParallelWrapper]:
        if self.mesh is None:
            raise SetupError("The hierarchical strategy's device mesh does not exist yet; shard after set-up")
        self._wrapper = _GroupDataParallelWrapper(self.mesh["within"], self.split_layers, self.compression)
        return self._wrapper

    # ------------------------------------------------------------------------------------------- averaging
    def dense_parameters(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """This rank's dense tensors: its local shards of split layers, and the replicated layers (the embedding
        tables are left out: they are sharded and exact)."""
        if self.dmp is None:
            return [], []
        dense = [p for _, p in in_backward_optimizer_filter(self.dmp.named_parameters())]
        split = [p.to_local() for p in dense if isinstance(p, DTensor)]
        return split, [p for p in dense if not isinstance(p, DTensor)]

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self._check_split_gradients_scaled()
        split, replicated = self.dense_parameters()
        assert self.mesh is not None
        self.averager = ReplicaAverager(
            split,
            self._average_group,
            self.num_groups,
            self.averaging,
            self.elastic_alpha,
            self.sync_every,
            background=self.background,
            shared=replicated,
            in_group=self.mesh["within"].get_group() if self.group_size > 1 else None,
        )

    def _check_split_gradients_scaled(self) -> None:
        hooked = {id(p) for p in (self._wrapper.hooked if self._wrapper is not None else [])}
        lm = self.lightning_module
        current = [p for p in (lm.parameters() if lm is not None else []) if isinstance(p, DTensor)]
        if any(id(p) not in hooked for p in current):
            raise SetupError(
                "A split layer's parameters were replaced after they were split (a module.to() or a parameter "
                "re-registration after DistributedModelParallel); their gradients would not be averaged over "
                "the group. Move the model before the strategy shards it."
            )

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.averager is not None:
            self.averager.after_step()
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
            every = int(getattr(trainer, "log_every_n_steps", 50) or 1)  # set by Lightning's logger connector
            if trainer is not None and trainer.loggers and self.averager.steps % every == 0:
                metrics = self.metrics()  # a collective with several groups: every rank, same steps
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=trainer.global_step)
        return out

    def metrics(self) -> Dict[str, float]:
        """What the averaging did so far (logged to the Trainer's loggers every ``log_every_n_steps``):

        * ``hierarchical/rounds``, ``hierarchical/steps_since_round``;
        * ``hierarchical/distance_to_center/group<k>``: each group's replica's L2 distance to the center (EASGD;
          of the part this rank holds, gathered from the same part in every group);
        * ``hierarchical/group_bytes_per_step``: bytes each rank sends inside its group per step (the tagger's
          cost model at the configured batch size);
        * ``hierarchical/cross_bytes_per_step``: bytes each rank sent to other groups per step (counted);
        * ``hierarchical/comm_wait_s``: time spent waiting for averaging rounds (cumulative).

        With several groups this is a collective over the averaging process group: call it on every rank.
        """
        avg = self.averager
        if avg is None:
            return {}
        out = {
            "hierarchical/rounds": float(avg.rounds),
            "hierarchical/steps_since_round": float(avg.steps - avg.rounds * avg.sync_every),
            "hierarchical/cross_bytes_per_step": avg.bytes_sent / max(avg.steps, 1),
            "hierarchical/comm_wait_s": avg.wait_s,
        }
        if self.tagging is not None:
            out["hierarchical/group_bytes_per_step"] = sum(c.group_bytes for c in self.tagging.costs.values())
        if avg.center is not None:
            dist_local = torch.tensor([avg.distance_to_center()])
            every = [torch.zeros(1) for _ in range(self.num_groups)]
            if self._average_group is not None:
                dist.all_gather(every, dist_local, group=self._average_group)
            else:
                every = [dist_local]
            for k, d in enumerate(every):
                out[f"hierarchical/distance_to_center/group{k}"] = float(d)
        return out

    @override
    def on_train_end(self) -> None:
        if self.averager is not None:
            if self.average_at_end:
                self.averager.average_now()
            else:
                self.averager.finish()
        super().on_train_end()

    # ------------------------------------------------------------------------------------------ checkpoints
    def _dense_optimizer_state(self) -> Dict[str, torch.Tensor]:
        """The live tensors of the dense layers' optimizer state on this rank (this group's own)."""
        out: Dict[str, torch.Tensor] = {}
        if self.dmp is None:
            return out
        dense = list(in_backward_optimizer_filter(self.dmp.named_parameters()))
        for opt in self.optimizers:
            state = getattr(opt, "state", {})
            for i, (_, p) in enumerate(dense):
                for key, v in state.get(p, {}).items():
                    if isinstance(v, torch.Tensor):
                        out[f"{i}.{key}"] = v.to_local() if isinstance(v, DTensor) else v
        return out

    def layout(self) -> str:
        """What the per-rank state's shapes depend on: the groups and every dense layer's placement.

        Example:
            >>> HierarchicalStrategy(group_size=2).layout()
            'group_size=2 placement='
        """
        placed = self.tagging.placement.items() if self.tagging is not None else []
        return f"group_size={self.group_size} placement=" + ",".join(f"{k}:{v.value}" for k, v in placed)

    def _local_state(self) -> Dict[str, Any]:
        assert self.averager is not None
        state = {
            "layout": self.layout(),
            "replica": self.averager._flat(),
            "optimizer": self._dense_optimizer_state(),
        }
        state.update(self.averager.state_dict())
        if state["center"] is None:
            state.pop("center")
        return {f"rank{self.global_rank}": state}

    @override
    def save_checkpoint(
        self, checkpoint: Dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        if self.averager is not None:
            self.averager.finish()  # a round in flight lands before the weights are written
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def _save_own_state(self, path: Path) -> None:
        if self.averager is not None:
            # Every rank's own part of its group's replica, of its dense optimizer state and of the center: the
            # groups' replicas differ, and DCP keeps one copy of a tensor that has the same name on every rank.
            dcp.save(self._local_state(), checkpoint_id=path / _STATE_DIR)
            self.barrier("hierarchical_ckpt_saved")

    def _same_layout(self, path: Path) -> bool:
        """Whether the checkpoint's per-rank state was written under this run's groups and placement. If not,
        its flat replica and dense optimizer state do not fit this run's layers: every group goes on from the
        checkpoint's shared weights and optimizer state (group 0's replica, what synchronous training would
        load), with the averaging counters kept and the center restarted there."""
        key = f"rank{self.global_rank}"
        saved: Dict[str, Any] = {key: {"layout": "", "steps": 0, "rounds": 0}}
        dcp.load(saved, checkpoint_id=path)
        if saved[key]["layout"] == self.layout():
            return True
        rank_zero_warn(
            f"checkpoint {path.parent} was written by hierarchical training with {saved[key]['layout']!r}; this run "
            f"has {self.layout()!r}: every group resumes from group 0's replica and dense optimizer state"
        )
        assert self.averager is not None
        self.averager.load_state_dict(saved[key])
        if self.averager.center is not None:
            self.averager.center.copy_(self.averager._flat())
        return False

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        meta = super().load_checkpoint(checkpoint_path, weights_only)
        path = Path(self.broadcast(str(checkpoint_path))) / _STATE_DIR
        if self.averager is not None and path.is_dir() and self._same_layout(path):
            target = self._local_state()
            dcp.load(target, checkpoint_id=path)  # the optimizer's state tensors are loaded in place
            state = target[f"rank{self.global_rank}"]
            self.averager._assign(state["replica"])
            self.averager.load_state_dict(state)
        return meta


def _batch_size_of(dm: Any) -> Optional[int]:
    """The rows per batch ``dm`` states: a ``batch_size`` attribute, hyperparameter or config field (the synthetic
    Criteo DataModule keeps it in its config); ``None`` when it states none (a hot/cold DataModule left to its
    wrapped one's).

    Example:
        >>> from torchrec_lookahead.data import CriteoSyntheticDataModule
        >>> _batch_size_of(CriteoSyntheticDataModule(batch_size=512)), _batch_size_of(object())
        (512, None)
    """
    for get in (
        lambda: dm.batch_size,
        lambda: dm.hparams["batch_size"],
        lambda: dm.config.batch_size,
    ):
        try:
            size = get()
        except (AttributeError, KeyError, TypeError):
            continue
        if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
            return size
    return None


if HierarchicalStrategy.strategy_name not in StrategyRegistry:
    HierarchicalStrategy.register_strategies(StrategyRegistry)
