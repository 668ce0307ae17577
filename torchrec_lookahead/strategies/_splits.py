"""Splitting a group's dense replica across the group's ranks with torch's tensor parallelism.

Every rank of a group reads its own batch of ``B`` rows. A split linear layer runs over the group's batch of
``g * B`` rows (``g`` = group size) and hands each rank back its own rows::

    colwise then rowwise (co-partitioned pair, no gather between them):
        x (B, in)  --all-gather rows-->  (gB, in)  --W1[cols of rank r]-->  (gB, out1/g)  --act-->
                   --W2[rows of rank r]-->  partial (gB, out2)  --reduce-scatter rows-->  (B, out2)
    colwise alone:  all-gather rows, own output columns, all-to-all back to own rows with every column
    rowwise alone:  all-to-all to own input columns of every row, partial products, reduce-scatter rows

These are torch's ``ColwiseParallel`` / ``RowwiseParallel`` with the batch dimension as the sharded input
and output dimension (``Shard(0)``) on the group's mesh dimension; they run on gloo and CPU. Gradients of
split parameters are the sum over the group's batch; they are divided by ``g`` so that they equal the mean
DDP gives the replicated layers (each rank's loss is a mean over its own batch).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import partial
from typing import Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from torchrec_lookahead.errors import ConfigError, UnevenBatchError
from torchrec_lookahead.strategies._compression import CompressedColwiseParallel

__all__ = [
    "LayerPlacement",
    "SplitLayer",
    "dense_linears",
    "resolve_placement",
    "split_plan",
    "apply_splits",
    "scale_split_gradients",
    "check_equal_rows",
]


class LayerPlacement(str, enum.Enum):
    """Where a dense linear layer's weight lives inside a group."""

    COLWISE = "colwise"
    ROWWISE = "rowwise"
    REPLICATE = "replicate"


@dataclass(frozen=True)
class SplitLayer:
    """One linear layer's placement and how it connects to its neighbours.

    Attributes:
        path: module path inside the model.
        placement: the layer's placement.
        paired: a colwise layer whose output feeds the next layer, rowwise (no gather between them), or that
            rowwise layer.
    """

    path: str
    placement: LayerPlacement
    paired: bool = False


def dense_linears(model: nn.Module, skip: Tuple[type, ...] = ()) -> Dict[str, nn.Linear]:
    """The model's ``nn.Linear`` layers in module order, outside modules of the ``skip`` types.

    Example:
        >>> m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> list(dense_linears(m))
        ['0', '2']
    """
    skipped = [n for n, m in model.named_modules() if skip and isinstance(m, skip)]
    out: Dict[str, nn.Linear] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and not any(name == s or name.startswith(s + ".") for s in skipped):
            out[name] = mod
    return out


def _common_sequential(model: nn.Module, a: str, b: str) -> bool:
    pa, pb = a.split("."), b.split(".")
    common: List[str] = []
    for x, y in zip(pa, pb):
        if x != y:
            break
        common.append(x)
    parent = model.get_submodule(".".join(common)) if common else model
    return isinstance(parent, nn.Sequential)


def consecutive_pairs(model: nn.Module, linears: Mapping[str, nn.Linear]) -> List[Tuple[str, str]]:
    """Pairs of consecutive linear layers inside one ``nn.Sequential`` whose widths chain (``a.out == b.in``):
    the pairs that can be co-partitioned. Only elementwise modules (activations) may sit between them, which
    holds for TorchRec's ``MLP`` / ``Perceptron`` stacks.

    Example:
        >>> m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> consecutive_pairs(m, dense_linears(m))
        [('0', '2')]
    """
    names = list(linears)
    out = []
    for a, b in zip(names, names[1:]):
        if linears[a].out_features == linears[b].in_features and _common_sequential(model, a, b):
            out.append((a, b))
    return out


def resolve_placement(
    model: nn.Module,
    placement: Mapping[str, str],
    group_size: int,
    linears: Optional[Mapping[str, nn.Linear]] = None,
    copartition: bool = True,
) -> List[SplitLayer]:
    """Check a placement against the model and mark co-partitioned pairs.

    Args:
        model: the unsharded model (module paths are relative to it).
        placement: module path -> ``colwise`` / ``rowwise`` / ``replicate``; layers not named are replicated.
        group_size: ranks per group; split widths must be divisible by it.
        linears: the candidate layers (default: every ``nn.Linear`` of ``model``).
        copartition: run a colwise layer followed by a rowwise one as a pair (off: each gathers on its own).

    Returns:
        The split layers (replicated ones left out), in module order.

    Raises:
        ConfigError: a path that names no module or a module that is not a dense linear layer, an unknown
            placement, or a width the group size does not divide.

    Example:
        >>> m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> [(s.path, s.placement.value, s.paired) for s in resolve_placement(m, {"0": "colwise", "2": "rowwise"}, 2)]
        [('0', 'colwise', True), ('2', 'rowwise', True)]
    """
    linears = dict(linears if linears is not None else dense_linears(model))
    valid = [p.value for p in LayerPlacement]
    chosen: Dict[str, LayerPlacement] = {}
    for path, value in placement.items():
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            raise ConfigError(
                f"placement names module {path!r}, which the model does not have; the dense linear layers are "
                f"{list(linears)}"
            ) from None
        if path not in linears:
            raise ConfigError(
                f"placement names {path!r}, a {type(mod).__name__}; only dense nn.Linear layers can be placed: "
                f"{list(linears)}"
            )
        try:
            chosen[path] = LayerPlacement(value.value if isinstance(value, enum.Enum) else value)
        except ValueError:
            raise ConfigError(f"placement of {path!r} must be one of {valid} but got {value!r}") from None
    for path, p in chosen.items():
        lin = linears[path]
        width = lin.out_features if p is LayerPlacement.COLWISE else lin.in_features
        if p is not LayerPlacement.REPLICATE and width % group_size:
            kind = "output" if p is LayerPlacement.COLWISE else "input"
            raise ConfigError(
                f"placement {p.value} of {path!r} splits its {width} {kind} features over group_size="
                f"{group_size} ranks, which does not divide them; replicate the layer or choose a width that is "
                f"a multiple of {group_size}"
            )
    pairs = {
        (a, b)
        for a, b in (consecutive_pairs(model, linears) if copartition else [])
        if chosen.get(a) is LayerPlacement.COLWISE and chosen.get(b) is LayerPlacement.ROWWISE
    }
    paired = {x for pair in pairs for x in pair}
    return [
        SplitLayer(path, p, path in paired) for path, p in chosen.items() if p is not LayerPlacement.REPLICATE
    ]


def split_plan(layers: List[SplitLayer], compression: str = "none") -> Dict[str, ParallelStyle]:
    """torch tensor-parallel styles for the split layers (batch rows sharded over the group); with
    ``compression`` ``"bf16"`` or ``"int8"`` the column splits gather their rows compressed."""
    plan: Dict[str, ParallelStyle] = {}
    for s in layers:
        if s.placement is LayerPlacement.COLWISE:
            out = Shard(-1) if s.paired else Shard(0)
            if compression == "none":
                plan[s.path] = ColwiseParallel(input_layouts=Shard(0), output_layouts=out)
            else:
                plan[s.path] = CompressedColwiseParallel(out, int8=compression == "int8")
        else:
            inp = Shard(-1) if s.paired else Shard(0)
            plan[s.path] = RowwiseParallel(input_layouts=inp, output_layouts=Shard(0))
    return plan


def apply_splits(
    model: nn.Module, mesh: DeviceMesh, layers: List[SplitLayer], compression: str = "none"
) -> List[str]:
    """Split ``layers`` of ``model`` over the 1-D ``mesh`` (the group) in place (``compression``: see
    :func:`split_plan`).

    Returns:
        The names of the parameters that became DTensors (for DDP to ignore). Their gradients are sums over the
        group's rows: see :func:`scale_split_gradients`.
    """
    if not layers:
        return []
    parallelize_module(model, mesh, split_plan(layers, compression))  # type: ignore[arg-type]
    check_equal_rows(model, mesh, layers)
    return [
        f"{s.path}.{pname}" for s in layers for pname, _ in model.get_submodule(s.path).named_parameters()
    ]


def scale_split_gradients(model: nn.Module, group_size: int) -> List[nn.Parameter]:
    """Divide the gradients of ``model``'s DTensor parameters by ``group_size`` (a hook on the incoming
    gradient, before accumulation, so right under gradient accumulation too), so that they equal the mean DDP
    gives the replicated layers.

    Call it once the parameters are final: ``module.to()`` replaces DTensor parameters (TorchRec's DDP wrapper
    calls it), and the hooks of the replaced ones are lost.

    Returns:
        The parameters hooked.
    """
    scale = 1.0 / group_size
    hooked: List[nn.Parameter] = [p for p in model.parameters() if isinstance(p, DTensor)]
    for p in hooked:
        p.register_hook(lambda grad, s=scale: grad * s)
    return hooked


def _rows(inputs: Tuple[object, ...]) -> int:
    x = inputs[0]
    if isinstance(x, DTensor):
        x = x.to_local()
    assert isinstance(x, torch.Tensor)
    return int(x.shape[0])


def check_equal_rows(model: nn.Module, mesh: DeviceMesh, layers: List[SplitLayer]) -> None:
    """Before each split that gathers the group's rows (a column split, or a row split that is not the second
    of a pair), all-gather every rank's row count over the group (one int64 per rank) and raise
    :class:`~torchrec_lookahead.errors.UnevenBatchError` on every rank if they differ: the gather itself
    would abort the process (gloo) or mix rows up (an even split of an uneven batch). The check runs at every
    forward (training, validation, test), ahead of torch's input preparation.
    """
    group = mesh.get_group()
    size = mesh.size()

    def hook(path: str, mod: nn.Module, inputs: Tuple[object, ...]) -> None:
        rows = torch.tensor([_rows(inputs)], dtype=torch.int64)
        every = rows.new_empty(size)
        dist.all_gather_into_tensor(every, rows, group=group)
        if bool((every != every[0]).any()):
            raise UnevenBatchError(
                f"layer {path!r} is split across the group but the group's ranks read batches of "
                f"{every.tolist()} rows; split layers need the same batch size on every rank of a group: drop "
                "the last uneven batch (drop_last), give every rank the same number of rows, or replicate every "
                "layer (placement='replicate')"
            )

    for s in layers:
        if s.placement is LayerPlacement.COLWISE or not s.paired:
            model.get_submodule(s.path).register_forward_pre_hook(partial(hook, s.path), prepend=True)
