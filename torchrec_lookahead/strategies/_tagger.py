"""The operator tagger: which dense linear layers a group splits, and how.

HT (KDD'21, section 3.2) tags operators in two passes; this is the same for the linear layers of a dense
model:

1. **Rules.** Consecutive layers where the first widens and the second narrows are co-partitioned (column
   split, then row split, with no gather between them); any other layer whose weights outweigh the
   activations it would move is split by column (or by row when only its input width divides); the rest are
   replicated. Each split weight is initialised on the rank that owns it (sliced from the same seeded
   initialisation).
2. **Greedy refinement** against a cost model per rank and step: time = FLOPs / ``flops_per_s`` + bytes
   sent inside the group / ``group_bytes_per_s`` + bytes sent across groups / ``cross_bytes_per_s``, subject
   to parameter bytes per rank <= ``memory_bytes``. Each round applies the one change (a layer or a pair to
   another placement, a pair both ways at once) that lowers the time most, until none does.

Everything is a function of the layers' shapes and the arguments: identical on every rank. Layers the user
placed are never changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

from torch import nn

from torchrec_lookahead.strategies._splits import LayerPlacement, consecutive_pairs

__all__ = ["CostModel", "LayerCost", "Tagging", "tag"]

_F32 = 4


@dataclass(frozen=True)
class CostModel:
    """Per-rank rates and sizes the tagger weighs against each other.

    Attributes:
        batch_size: rows each rank reads per step.
        group_size: ranks per group.
        num_groups: groups (cross-group averaging traffic is zero with one).
        sync_every: steps between averaging rounds.
        activation_bytes: bytes per activation element sent (4; 1 with int8 compression).
        gradient_bytes: bytes per gradient element sent (4; 2 with bf16 compression).
        flops_per_s: one rank's dense throughput.
        group_bytes_per_s: bandwidth inside a group (one host by default).
        cross_bytes_per_s: bandwidth across groups (between hosts).
        memory_bytes: parameter bytes allowed per rank (``None``: no limit).
        background: averaging rounds run in the background: their bytes are counted but cost no step time.
    """

    batch_size: int = 1024
    group_size: int = 2
    num_groups: int = 1
    sync_every: int = 1
    activation_bytes: int = _F32
    gradient_bytes: int = _F32
    flops_per_s: float = 1e11
    group_bytes_per_s: float = 1e10
    cross_bytes_per_s: float = 1e9
    memory_bytes: Optional[int] = None
    background: bool = False


@dataclass(frozen=True)
class LayerCost:
    """One layer's cost per rank and step under one placement."""

    flops: float
    group_bytes: float
    cross_bytes: float
    param_bytes: float

    def seconds(self, cm: CostModel) -> float:
        cross = 0.0 if cm.background else self.cross_bytes / cm.cross_bytes_per_s
        return self.flops / cm.flops_per_s + self.group_bytes / cm.group_bytes_per_s + cross


def layer_cost(lin: nn.Linear, placement: LayerPlacement, paired: bool, cm: CostModel) -> LayerCost:
    """Cost of one layer per rank and step (forward and backward).

    Replicated: the group's ring all-reduce of the weight gradient sends ``2 (g-1)/g`` of it. Split: every
    rank computes ``1/g`` of the group's ``g B`` rows x the full width (the same FLOPs), and moves activations:
    a column split all-gathers its input rows (forward) and reduce-scatters their gradient (backward); a row
    split reduce-scatters its output rows and all-gathers their gradient; an unpaired split adds the all-to-all
    that brings its output (or input) back to the rank's own rows. Inside a pair, the tensor between the two
    layers never moves. Across groups, each rank averages its own parameter bytes every ``sync_every`` steps.

    Example:
        >>> cm = CostModel(batch_size=8, group_size=2)
        >>> layer_cost(nn.Linear(4, 8), LayerPlacement.REPLICATE, False, cm).group_bytes
        160.0
    """
    g, b = cm.group_size, cm.batch_size
    n_in, n_out = lin.in_features, lin.out_features
    weights = n_in * n_out + (n_out if lin.bias is not None else 0)
    flops = 6.0 * b * n_in * n_out
    if placement is LayerPlacement.REPLICATE:
        params = float(weights * _F32)
        group = 2.0 * (g - 1) / g * weights * cm.gradient_bytes
    else:
        params = float(weights * _F32) / g
        act = cm.activation_bytes
        moved = 0.0
        if placement is LayerPlacement.COLWISE:
            moved += (
                (g - 1) * b * n_in * act
            )  # all-gather of the input rows / reduce-scatter of their gradient
            if not paired:
                moved += (g - 1) * b * n_out / g * act  # all-to-all back to the own rows
        else:
            moved += (
                (g - 1) * b * n_out * act
            )  # reduce-scatter of the output rows / all-gather of the gradient
            if not paired:
                moved += (g - 1) * b * n_in / g * act  # all-to-all to the own input columns
        group = 2.0 * moved
    cross = 0.0
    if cm.num_groups > 1:
        cross = 2.0 * (cm.num_groups - 1) / cm.num_groups * params / cm.sync_every
    return LayerCost(flops, group, cross, params)


@dataclass
class Tagging:
    """The tagger's result: a placement per layer and its cost."""

    placement: Dict[str, LayerPlacement]
    costs: Dict[str, LayerCost] = field(default_factory=dict)
    shapes: Dict[str, Tuple[int, int]] = field(default_factory=dict)

    def table(self) -> str:
        """The placement as a table (module, shape, placement, parameter bytes per rank, bytes sent per step),
        like TorchRec's planner prints its sharding plan."""
        rows = [("module", "shape", "placement", "param bytes/rank", "bytes sent/step")]
        for path, p in self.placement.items():
            c = self.costs[path]
            n_in, n_out = self.shapes[path]
            rows.append(
                (
                    path,
                    f"{n_out}x{n_in}",
                    p.value,
                    f"{c.param_bytes:,.0f}",
                    f"{c.group_bytes + c.cross_bytes:,.0f}",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = [" | ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
        lines.insert(1, "-+-".join("-" * w for w in widths))
        return "\n".join(lines)


def _costs(
    linears: Mapping[str, nn.Linear],
    placement: Mapping[str, LayerPlacement],
    pairs: List[Tuple[str, str]],
    cm: CostModel,
) -> Dict[str, LayerCost]:
    paired = {
        x
        for a, b in pairs
        if placement[a] is LayerPlacement.COLWISE and placement[b] is LayerPlacement.ROWWISE
        for x in (a, b)
    }
    return {p: layer_cost(linears[p], placement[p], p in paired, cm) for p in linears}


def _total(costs: Mapping[str, LayerCost], cm: CostModel) -> Optional[float]:
    if cm.memory_bytes is not None and sum(c.param_bytes for c in costs.values()) > cm.memory_bytes:
        return None
    return sum(c.seconds(cm) for c in costs.values())


def _options(lin: nn.Linear, g: int) -> List[LayerPlacement]:
    out = [LayerPlacement.REPLICATE]
    if lin.out_features % g == 0:
        out.append(LayerPlacement.COLWISE)
    if lin.in_features % g == 0:
        out.append(LayerPlacement.ROWWISE)
    return out


def rule_pass(
    linears: Mapping[str, nn.Linear],
    pairs: List[Tuple[str, str]],
    cm: CostModel,
    fixed: Mapping[str, LayerPlacement],
) -> Dict[str, LayerPlacement]:
    """HT's rules (see the module docstring) over the co-partitionable ``pairs``; ``fixed`` layers keep their
    placement."""
    g = cm.group_size
    out: Dict[str, LayerPlacement] = dict(fixed)
    if g > 1:
        for a, b in pairs:
            la, lb = linears[a], linears[b]
            widens, narrows = la.out_features > la.in_features, lb.out_features < lb.in_features
            if widens and narrows and la.out_features % g == 0 and a not in out and b not in out:
                out[a], out[b] = LayerPlacement.COLWISE, LayerPlacement.ROWWISE
    for path, lin in linears.items():
        if path in out:
            continue
        opts = _options(lin, g) if g > 1 else [LayerPlacement.REPLICATE]
        heavy = lin.in_features * lin.out_features > cm.batch_size * (lin.in_features + lin.out_features)
        out[path] = opts[1] if heavy and len(opts) > 1 else LayerPlacement.REPLICATE
    return {p: out[p] for p in linears}


def tag(
    model: nn.Module,
    linears: Mapping[str, nn.Linear],
    cm: CostModel,
    fixed: Optional[Mapping[str, LayerPlacement]] = None,
    refine: bool = True,
    copartition: bool = True,
) -> Tagging:
    """Place every layer of ``linears``: rules, then (``refine``) greedy refinement on the cost model.

    Args:
        model: the model the layer paths are relative to.
        linears: the candidate layers, in module order.
        cm: the cost model.
        fixed: user placements, kept as given.
        refine: run the greedy refinement (off: the rules alone, an ablation).
        copartition: allow co-partitioned pairs (off: every split layer pays its own gathers, an ablation).

    Example:
        >>> m = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
        >>> t = tag(m, {"0": m[0], "2": m[2]}, CostModel(batch_size=16, group_size=2))
        >>> {k: v.value for k, v in t.placement.items()}
        {'0': 'colwise', '2': 'rowwise'}
    """
    fixed = dict(fixed or {})
    pairs = consecutive_pairs(model, linears) if copartition else []
    placement = rule_pass(linears, pairs, cm, fixed)
    best = _total(_costs(linears, placement, pairs, cm), cm)
    g = cm.group_size
    while refine and g > 1:
        moves: List[Dict[str, LayerPlacement]] = []
        for path, lin in linears.items():
            if path not in fixed:
                moves += [{path: o} for o in _options(lin, g) if o is not placement[path]]
        for a, b in pairs:  # a pair moves together, in or out of co-partitioning
            if a in fixed or b in fixed:
                continue
            if (placement[a], placement[b]) != (LayerPlacement.REPLICATE,) * 2:
                moves.append({a: LayerPlacement.REPLICATE, b: LayerPlacement.REPLICATE})
            if linears[a].out_features % g == 0 and (placement[a], placement[b]) != (
                LayerPlacement.COLWISE,
                LayerPlacement.ROWWISE,
            ):
                moves.append({a: LayerPlacement.COLWISE, b: LayerPlacement.ROWWISE})
        chosen, chosen_cost = None, best
        for move in moves:
            cost = _total(_costs(linears, {**placement, **move}, pairs, cm), cm)
            if cost is not None and (chosen_cost is None or cost < chosen_cost * (1 - 1e-9)):
                chosen, chosen_cost = move, cost
        if chosen is None:
            break
        placement.update(chosen)
        best = chosen_cost
    costs = _costs(linears, placement, pairs, cm)
    shapes = {p: (lin.in_features, lin.out_features) for p, lin in linears.items()}
    return Tagging(placement, costs, shapes)
