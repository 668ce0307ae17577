"""Each split of a group's dense replica (colwise, rowwise, co-partitioned pair, replicate) against the unsplit
layer on two gloo ranks: every rank's own rows of the output, and the gradients DDP would give the unsplit
layer (the mean over ranks of each rank's own-batch gradient)."""

from __future__ import annotations

from typing import Dict

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from torchrec_lookahead.errors import ConfigError, UnevenBatchError
from torchrec_lookahead.strategies._splits import (
    apply_splits,
    consecutive_pairs,
    dense_linears,
    resolve_placement,
    scale_split_gradients,
)

from ..conftest import free_port, start_method

pytestmark = pytest.mark.beside_launches  # its ranks: torch.multiprocessing, not torchrun

# case -> placement; a suffix _bf16 or _int8 names the compression
CASES: Dict[str, Dict[str, str]] = {
    "colwise": {"0": "colwise"},
    "rowwise": {"2": "rowwise"},
    "pair": {"0": "colwise", "2": "rowwise"},
    "replicate": {"0": "replicate", "2": "replicate"},
    "pair_then_colwise": {"0": "colwise", "2": "rowwise", "4": "colwise"},
    "pair_bf16": {"0": "colwise", "2": "rowwise"},
    "pair_int8": {"0": "colwise", "2": "rowwise"},
    "colwise_int8": {"0": "colwise"},
}
# compressed traffic: bf16 gradients (8 bits of mantissa), int8 activations (1/254 of a row's largest value)
TOLERANCE = {"pair_bf16": 2e-2, "pair_int8": 5e-2, "colwise_int8": 5e-2}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 4))


def _worker(rank: int, world: int, port: int, q) -> None:  # type: ignore[no-untyped-def]
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        errs = {case: _errors(rank, world, mesh, case) for case in CASES}
        errs["bf16_hook"] = {"mean": _bf16_hook_error(rank, world)}
        errs["uneven"] = _uneven_batch(rank, world, mesh)
        q.put((rank, errs))
    finally:
        dist.destroy_process_group()


def _errors(rank: int, world: int, mesh, case: str) -> Dict[str, float]:  # type: ignore[no-untyped-def]
    model, ref = _model(), _model()
    layers = resolve_placement(model, CASES[case], world)
    apply_splits(model, mesh, layers, compression=case.rsplit("_", 1)[-1] if case in TOLERANCE else "none")
    scale_split_gradients(model, world)
    x = torch.randn(world * 5, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    xl = x.detach()[rank * 5 : (rank + 1) * 5].clone().requires_grad_(True)
    y = model(xl)
    y = y.full_tensor() if hasattr(y, "full_tensor") else y
    (y * torch.arange(1.0, 5.0)).sum().div(5).backward()  # a mean over the rank's own rows
    out = ref(x)
    # the reference: unsplit layer, each rank's own-rows loss, gradients averaged over ranks as in DDP
    losses = (out * torch.arange(1.0, 5.0)).view(world, 5, 4).sum((1, 2)).div(5)
    losses.sum().div(world).backward()
    err = {"y": (y - out[rank * 5 : (rank + 1) * 5]).abs().max().item()}
    err["dx"] = (xl.grad * (1.0 / world) - x.grad[rank * 5 : (rank + 1) * 5]).abs().max().item()
    for (n, p), (_, pr) in zip(model.named_parameters(), ref.named_parameters()):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        if not hasattr(p.grad, "full_tensor"):
            dist.all_reduce(g)  # replicated layers: DDP's all-reduce, done by hand here
            g = g / world
        err[n] = (g - pr.grad).abs().max().item()
    return err


def _uneven_batch(rank: int, world: int, mesh) -> Dict[str, str]:  # type: ignore[no-untyped-def]
    """A group whose ranks read 5 and 4 rows, through a column split and through a lone row split: the error
    each rank raised (every rank must raise, or the others would hang in the gather), then an even batch
    through the same layers still works."""
    out: Dict[str, str] = {}
    for case in ("pair", "rowwise"):
        model = _model()
        apply_splits(model, mesh, resolve_placement(model, CASES[case], world))
        try:
            model(torch.randn(5 - rank, 6))
            out[case] = "no error"
        except UnevenBatchError as e:
            out[case] = str(e)
        model(torch.randn(3, 6))
    return out


def _bf16_hook_error(rank: int, world: int) -> float:
    """The bf16 DDP hook's mean against the exact mean, relative."""
    from torchrec_lookahead.strategies._compression import bf16_allreduce_hook

    class _Bucket:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

        def buffer(self) -> torch.Tensor:
            return self.t

    x = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    exact = x.clone()
    dist.all_reduce(exact)
    got = bf16_allreduce_hook(dist.group.WORLD, _Bucket(x.clone())).wait()  # type: ignore[arg-type]
    return ((got - exact / world).abs().max() / exact.abs().max()).item()


@pytest.fixture(scope="module")
def split_errors() -> Dict[int, Dict[str, Dict[str, float]]]:
    """Every case on one pair of spawned gloo ranks: rank -> case -> largest error per tensor."""
    q = mp.get_context(start_method()).Queue()
    procs = mp.start_processes(
        _worker, args=(2, free_port(), q), nprocs=2, join=False, start_method=start_method()
    )
    results = dict(q.get(timeout=120) for _ in range(2))
    procs.join()
    return results


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(CASES))
def test_split_equals_the_unsplit_layer_forward_and_backward(case: str, split_errors) -> None:  # type: ignore[no-untyped-def]
    tol = TOLERANCE.get(case, 1e-6)
    for rank, errs in split_errors.items():
        err = errs[case]
        assert len(err) > 2 and max(err.values()) < tol, (rank, case, err)
        if case in TOLERANCE:  # the compression is really on the wire
            assert max(err.values()) > 1e-6, (rank, case, err)


@pytest.mark.distributed
def test_bf16_hook_averages_within_bf16_precision(split_errors) -> None:  # type: ignore[no-untyped-def]
    for errs in split_errors.values():
        assert 0 < errs["bf16_hook"]["mean"] < 1e-2


@pytest.mark.distributed
def test_uneven_batches_inside_a_group_raise_a_typed_error_on_every_rank(split_errors) -> None:  # type: ignore[no-untyped-def]
    for errs in split_errors.values():
        for case in ("pair", "rowwise"):
            assert "[5, 4] rows" in errs["uneven"][case], (case, errs["uneven"])


def test_placement_errors_name_the_valid_choices() -> None:
    m = _model()
    with pytest.raises(ConfigError, match="does not have"):
        resolve_placement(m, {"9": "colwise"}, 2)
    with pytest.raises(ConfigError, match="ReLU"):
        resolve_placement(m, {"1": "colwise"}, 2)
    with pytest.raises(ConfigError, match="colwise"):
        resolve_placement(m, {"0": "diagonal"}, 2)
    with pytest.raises(ConfigError, match="does not divide"):
        resolve_placement(m, {"0": "colwise"}, 3)


def test_pairs_need_chained_widths_inside_one_sequential() -> None:
    m = nn.Sequential(nn.Sequential(nn.Linear(4, 8)), nn.Linear(8, 3), nn.Linear(5, 2))
    assert consecutive_pairs(m, dense_linears(m)) == [("0.0", "1")]
