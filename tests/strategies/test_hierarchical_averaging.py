"""Averaging rounds across groups on two gloo ranks (two groups of one) against the formulas written out by
hand: EASGD and mean, blocking and in the background (a snapshot's round applied one round later, local steps
taken meanwhile kept)."""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchrec_lookahead.strategies._averaging import Averaging, ReplicaAverager

from ..conftest import free_port, start_method

pytestmark = [pytest.mark.distributed, pytest.mark.beside_launches]

ALPHA = 0.25


def _local_step(rank: int, step: int) -> torch.Tensor:
    return torch.tensor([1.0, -2.0]) * (rank + 1) * (step + 1)


def _worker(rank: int, port: int, q) -> None:  # type: ignore[no-untyped-def]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out: Dict[str, List[List[float]]] = {}
    try:
        for method in ("easgd", "mean"):
            for background in (False, True):
                w = torch.tensor([float(rank), 10.0 * rank])
                avg = ReplicaAverager([w], dist.group.WORLD, 2, Averaging(method), ALPHA, 2, background)
                seen = [w.tolist()]
                for step in range(6):
                    w.add_(_local_step(rank, step))
                    avg.after_step()
                    seen.append(w.tolist())
                avg.finish()
                seen.append(w.tolist())
                assert avg.rounds == 3
                out[f"{method}/{background}"] = seen
        q.put((rank, out))
    finally:
        dist.destroy_process_group()


def _reference(method: str, background: bool) -> List[List[List[float]]]:
    """Both ranks' trajectories, computed in one process."""
    w = [torch.tensor([0.5, 5.0]) for _ in range(2)]  # the averager starts every group from the mean
    c = w[0].clone()
    seen = [[x.tolist() for x in w]]
    pending = None

    def apply(snap: List[torch.Tensor]) -> None:
        nonlocal c
        mean = (snap[0] + snap[1]) / 2
        for r in range(2):
            w[r] += (mean - snap[r]) if method == "mean" else -ALPHA * (snap[r] - c)
        if method == "easgd":
            c = c + ALPHA * (mean - c)

    for step in range(6):
        for r in range(2):
            w[r] = w[r] + _local_step(r, step)
        if (step + 1) % 2 == 0:
            if pending is not None:
                apply(pending)
            pending = [x.clone() for x in w]
            if not background:
                apply(pending)
                pending = None
        seen.append([x.tolist() for x in w])
    if pending is not None:
        apply(pending)
    seen.append([x.tolist() for x in w])
    return seen


def test_rounds_follow_the_formulas_blocking_and_in_the_background() -> None:
    q = mp.get_context(start_method()).Queue()
    procs = mp.start_processes(
        _worker, args=(free_port(), q), nprocs=2, join=False, start_method=start_method()
    )
    results = dict(q.get(timeout=120) for _ in range(2))
    procs.join()
    for key in results[0]:
        method, background = key.split("/")
        ref = _reference(method, background == "True")
        for rank in range(2):
            got = torch.tensor(results[rank][key])
            want = torch.tensor([s[rank] for s in ref])
            assert torch.allclose(got, want, atol=1e-5), (key, rank, got, want)
    # background rounds really lag: they differ from blocking ones
    assert results[0]["easgd/True"] != results[0]["easgd/False"]
