"""The planner thread's work on one batch (``StepPlanner``): with several ranks, the step's LRPP plan carries the
id part of every cache kernel's backward exchange."""

from __future__ import annotations

from concurrent.futures import Future

import torch
from torchrec import KeyedJaggedTensor
from torchrec.datasets.utils import Batch

from torchrec_lookahead.distributed.exact_sync import ExchangeSpec, KernelLayout, exchange_index
from torchrec_lookahead.distributed.lrpp import slice_samples
from torchrec_lookahead.runtime import CacheTarget
from torchrec_lookahead.runtime._planning import StepPlanner
from torchrec_lookahead.store import TensorStore


def _global_batches(n: int, samples: int) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 3, (2 * samples,), generator=g)
        values = torch.randint(0, 30, (int(lengths.sum()),), generator=g)
        out.append(KeyedJaggedTensor(["f", "g"], values, lengths=lengths))
    return out


def _planned(exchanges: tuple, rank: int) -> list:
    target = CacheTarget(
        {"t": 24, "u": 24},
        {"f": "t", "g": "u"},
        {"t": 30, "u": 30},
        {n: TensorStore(30, 4, {}, name=n, seed=0) for n in ("t", "u")},
        num_ranks=2,
        rank=rank,
        exchanges=exchanges,
    )
    planner = StepPlanner(target, {"capacity": {"t": 24, "u": 24}, "horizon": 2, "num_ranks": 2}, None)
    batches = _global_batches(6, 8)
    plans = [p for b in batches for p in planner.feed(b)] + planner.finish()
    out = []
    for plan, whole in zip(plans, batches):
        local = Batch(torch.zeros(4, 1), slice_samples(whole, rank * 4, (rank + 1) * 4), torch.zeros(4))
        out.append(planner.batch(planner.whole_plan(plan, whole), local, whole, Future()))
    return out


def test_the_planner_builds_each_kernels_exchange_index_with_the_lrpp_plan():
    spec = ExchangeSpec(KernelLayout(["f", "g"], [0, 1], ["t", "u"], [24, 24], [4, 4], False, False), True)
    for rank in (0, 1):
        for batch in _planned((spec,), rank):
            lrpp = batch.lrpp
            assert lrpp is not None and lrpp.features is not None and list(lrpp.exchange) == [("t", "u")]
            index = lrpp.exchange[("t", "u")]
            tables = [lrpp.tables[t] for t in ("t", "u")]
            direct = exchange_index(
                spec,
                lrpp.features,
                rank,
                2,
                [p.shared_slots for p in tables],
                [p.delayed_slots for p in tables],
            )
            assert index.rank == rank and index.spec == spec
            for name in ("send", "indices", "offsets"):
                assert torch.equal(getattr(index.now, name), getattr(direct.now, name))
            assert (index.late is None) == (direct.late is None)


def test_without_kernels_to_index_the_plan_carries_none():
    assert all(b.lrpp is not None and b.lrpp.exchange == {} for b in _planned((), 0))


class _UsesStore(TensorStore):
    """A store that ranks its rows by the ids each batch looks up (as a lookahead disk store): records them."""

    def __init__(self, name: str) -> None:
        super().__init__(30, 4, {}, name=name, seed=0)
        self.uses: list = []

    @property
    def uses_hints(self) -> bool:
        return True

    def plan_uses(self, step: int, ids: torch.Tensor) -> None:
        self.uses.append((step, sorted(set(ids.tolist()))))


def test_the_planner_tells_the_stores_that_rank_by_uses_which_ids_each_batch_looks_up():
    """As it reads each batch (the oracle's horizon before its plan), in step order, only the stores asking."""
    stores = {"t": _UsesStore("t"), "u": TensorStore(30, 4, {}, name="u", seed=0)}
    target = CacheTarget({"t": 24, "u": 24}, {"f": "t", "g": "u"}, {"t": 30, "u": 30}, stores)
    planner = StepPlanner(target, {"capacity": {"t": 24, "u": 24}, "horizon": 3}, None)
    batches = _global_batches(5, 8)
    for i, b in enumerate(batches):
        planner.feed(b)
        assert [s for s, _ in stores["t"].uses] == list(range(i + 1))  # before the batch's plan is ready
    planner.finish()
    assert stores["t"].uses == [(i, sorted(set(b["f"].values().tolist()))) for i, b in enumerate(batches)]
