"""The exact exchange's two halves (``exchange_index`` ahead, ``exchange`` in the backward) against a naive
reference, with every rank of the exchange simulated in one process."""

from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch
from torchrec import KeyedJaggedTensor

from torchrec_lookahead.distributed import exact_sync
from torchrec_lookahead.distributed.exact_sync import (
    ExchangeIndex,
    ExchangeSpec,
    KernelLayout,
    exchange,
    exchange_index,
)
from torchrec_lookahead.distributed.lrpp import LRPPPlan, LRPPTablePlan
from torchrec_lookahead.errors import DataError, SetupError


class _Case:
    """A random kernel layout, global slot batch, shared / delayed / pinned slots and per-rank gradients."""

    def __init__(
        self, seed: int, world: int, unpooled: bool, mean: bool, weighted: bool, pinned: bool
    ) -> None:
        rng = np.random.default_rng(seed)
        ntab = int(rng.integers(1, 4))
        cap = [int(rng.integers(4, 30)) for _ in range(ntab)]
        nf = int(rng.integers(1, 5))
        ftab = [int(rng.integers(0, ntab)) for _ in range(nf)]
        dim = int(rng.choice([2, 4]))
        dims = [dim] * nf if unpooled else [int(rng.choice([2, 4, 6])) for _ in range(nf)]
        self.features = [f"f{i}" for i in range(nf)]
        self.layout = KernelLayout(
            self.features,
            ftab,
            [f"t{i}" for i in range(ntab)],
            cap,
            dims,
            mean=mean and not unpooled,
            weighted=weighted and not unpooled,
            unpooled=unpooled,
        )
        self.world, self.local = world, int(rng.integers(1, 5))
        bags = self.local * world
        self.bags = bags
        # the batch may hold features of other kernels, in any order
        keys = ["other", *self.features[::-1]] if rng.random() < 0.5 else list(self.features)
        lengths = rng.integers(0, 4, size=len(keys) * bags)
        values = []
        for i, k in enumerate(keys):
            rows = cap[ftab[self.features.index(k)]] if k in self.features else 5
            values.append(rng.integers(0, rows, size=int(lengths[i * bags : (i + 1) * bags].sum())))
        v = torch.from_numpy(np.concatenate(values).astype(np.int64))
        self.kjt = KeyedJaggedTensor(
            keys=keys,
            values=v,
            lengths=torch.from_numpy(lengths.astype(np.int64)),
            weights=torch.rand(v.numel(), generator=torch.Generator().manual_seed(seed))
            if self.layout.weighted
            else None,
        )
        # pinned slots as (first slot, rows): a table of a shared slot space has its pinned rows after others'
        self.pinned = (
            [(int(rng.integers(0, 2)), int(rng.integers(0, 3))) for _ in range(ntab)] if pinned else None
        )
        # per feature, per global bag: its ids (table-local slots) and scales
        self.ids: Dict[Tuple[int, int], List[Tuple[int, float]]] = {}
        kjt_dict = self.kjt.to_dict()
        readers: List[Dict[int, set]] = [{} for _ in range(ntab)]
        for f, name in enumerate(self.features):
            jt = kjt_dict[name]
            off = jt.offsets().tolist()
            vals = jt.values().tolist()
            w = jt.weights().tolist() if self.layout.weighted else None
            for b in range(bags):
                scale = 1.0 / max(off[b + 1] - off[b], 1) if self.layout.mean else 1.0
                self.ids[(f, b)] = [
                    (vals[i], w[i] if w is not None else scale) for i in range(off[b], off[b + 1])
                ]
                for slot, _ in self.ids[(f, b)]:
                    readers[ftab[f]].setdefault(slot, set()).add(self.rank_of(b))
        # shared: read by several ranks (as the LRPP tracker marks them); delayed: some of those
        self.shared, self.delayed = [], []
        for t in range(ntab):
            shared = np.array(sorted(x for x, r in readers[t].items() if len(r) > 1), dtype=np.int64)
            self.shared.append(torch.from_numpy(shared))
            self.delayed.append(torch.from_numpy(shared[rng.random(shared.size) < 0.4]))
        g = torch.Generator().manual_seed(seed + 1)
        if unpooled:  # one gradient row per id, per rank its own ids (feature by feature, bag by bag)
            self.grads = [
                torch.randn(
                    sum(len(self.ids[(f, b)]) for f in range(nf) for b in self._bags(q)), dim, generator=g
                )
                for q in range(world)
            ]
        else:
            self.grads = [torch.randn(self.local, sum(dims), generator=g) for _ in range(world)]

    def _bags(self, q: int) -> range:
        return range(q * self.local, (q + 1) * self.local)

    def rank_of(self, b: int) -> int:
        return b // self.local


def _simulate(case: _Case, delayed_sync: bool) -> List[Tuple[ExchangeIndex, Any, Any, int]]:
    """Every rank's index and exchange, each rank's all-gathers answered with the other ranks' sends."""
    W = case.world
    spec = ExchangeSpec(case.layout, delayed_sync)
    indices = [exchange_index(spec, case.kjt, r, W, case.shared, case.delayed, case.pinned) for r in range(W)]
    sends = [[], []]  # per all-gather (critical, delayed): every rank's packed floats
    for r, index in enumerate(indices):
        flat = case.grads[r].reshape(-1)
        sends[0].append(flat[index.now.send])
        if index.late is not None:
            sends[1].append(flat[index.late.send])
    calls: List[int] = []

    def all_gather(
        recv: List[torch.Tensor], buf: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> Any:
        which = len(calls) % 2 if indices[0].late is not None else 0
        calls.append(which)
        for q, out in enumerate(recv):
            out.zero_()
            out[: sends[which][q].numel()] = sends[which][q]

        class _Done:
            def wait(self, timeout: Optional[Any] = None) -> None:
                pass

        return _Done()

    out = []
    original = exact_sync.dist.all_gather
    exact_sync.dist.all_gather = all_gather
    try:
        for r, index in enumerate(indices):
            now, later, sent = exchange(index, case.grads[r], None, None)
            out.append((index, now, None if later is None else later.batch(), sent))
    finally:
        exact_sync.dist.all_gather = original
    return out


def _reference(case: _Case, rank: int, delayed_sync: bool) -> Dict[str, Any]:
    """The exchange batches of ``rank`` from their definition: the global bags feature by feature in rank
    order, each keeping the ids of rows this rank holds (read by it, or pinned), split into rows updated now and
    delayed rows; every kept id's bag (or the id itself) carrying its true gradient."""
    lay = case.layout
    pinned = case.pinned or [(0, 0)] * len(lay.tables)
    pinned_slots = [set(range(first, first + n)) for first, n in pinned]
    read = {
        (lay.feature_table[f], s)
        for (f, b), ids in case.ids.items()
        for s, _ in ids
        if case.rank_of(b) == rank
    }
    held = read | {(t, s) for t in range(len(lay.tables)) for s in pinned_slots[t]}
    late = {
        (t, int(s))
        for t in range(len(lay.tables))
        for s in case.delayed[t]
        if delayed_sync and int(s) not in pinned_slots[t]
    }
    cols = lay.columns
    grad_of: Dict[Tuple[int, int], torch.Tensor] = {}  # (feature, bag) -> pooled gradient columns
    id_grad: Dict[Tuple[int, int, int], torch.Tensor] = {}  # (feature, bag, position) -> id gradient
    for q in range(case.world):
        pos = 0
        for f in range(len(lay.features)):
            for b in case._bags(q):
                if lay.unpooled:
                    for i in range(len(case.ids[(f, b)])):
                        id_grad[(f, b, i)] = case.grads[q][pos]
                        pos += 1
                else:
                    grad_of[(f, b)] = case.grads[q][b - q * case.local, cols[f] : cols[f] + lay.dims[f]]
    out = {}
    for part, wanted in (
        ("now", lambda k: k in held and k not in late),
        ("late", lambda k: k in held and k in late),
    ):
        indices, lengths, scales, rows = [], [], [], []
        for f in range(len(lay.features)):
            for b in range(case.bags):
                kept = [
                    (i, s, w)
                    for i, (s, w) in enumerate(case.ids[(f, b)])
                    if wanted((lay.feature_table[f], s))
                ]
                lengths.append(len(kept))
                for i, s, w in kept:
                    indices.append(s)
                    scales.append(w)
                    if lay.unpooled:
                        rows.append(id_grad[(f, b, i)])
        out[part] = {"indices": indices, "lengths": lengths, "scales": scales, "rows": rows}
    return out


def _check_batch(case: _Case, batch: Any, ref: Dict[str, Any], rank: int) -> None:
    lay = case.layout
    assert batch.indices.dtype == torch.int64 and batch.offsets.dtype == torch.int64
    assert batch.indices.tolist() == ref["indices"]
    assert torch.diff(batch.offsets).tolist() == ref["lengths"]
    if lay.weighted or lay.mean:
        assert batch.weights is not None and batch.weights.dtype == torch.float32
        assert batch.weights.tolist() == torch.tensor(ref["scales"], dtype=torch.float32).tolist()
    else:
        assert batch.weights is None
    if lay.unpooled:
        expected = torch.stack(ref["rows"]) if ref["rows"] else batch.grad.new_zeros(0, lay.dims[0])
        assert torch.equal(batch.grad, expected)
        return
    assert tuple(batch.grad.shape) == (case.bags, lay.width)
    cols = lay.columns
    for f in range(len(lay.features)):
        for b in range(case.bags):
            n = ref["lengths"][f * case.bags + b]
            got = batch.grad[b, cols[f] : cols[f] + lay.dims[f]]
            if case.rank_of(b) == rank:  # this rank's own gradient, whole
                true = case.grads[rank][b - rank * case.local, cols[f] : cols[f] + lay.dims[f]]
                assert torch.equal(got, true)
            elif n:  # a bag of another rank holding a kept id: its true gradient arrived
                q = case.rank_of(b)
                true = case.grads[q][b - q * case.local, cols[f] : cols[f] + lay.dims[f]]
                assert torch.equal(got, true), (f, b)


@pytest.mark.parametrize(
    "world, unpooled, mean, weighted, pinned, delayed_sync",
    [
        (w, u, m, wt, p, d)
        for w, u, m, wt, p, d in itertools.product(
            [2, 3], [False, True], [False, True], [False, True], [False, True], [False, True]
        )
        if not (u and (m or wt))
    ],
)
def test_exchange_from_its_index_equals_the_naive_exchange(
    world, unpooled, mean, weighted, pinned, delayed_sync
):
    for seed in range(6):
        case = _Case(seed * 7 + world, world, unpooled, mean, weighted, pinned)
        for rank, (index, now, late, sent) in enumerate(_simulate(case, delayed_sync)):
            ref = _reference(case, rank, delayed_sync)
            _check_batch(case, now, ref["now"], rank)
            if late is None:
                assert not ref["late"]["indices"] and index.late_rows == 0
            else:
                _check_batch(case, late, ref["late"], rank)
            late_sent = 0 if index.late is None else index.late.sizes[rank]
            assert sent == index.now.sizes[rank] + late_sent


def test_a_gradient_that_does_not_match_the_index_is_refused():
    case = _Case(1, 2, False, False, False, False)
    index = exchange_index(ExchangeSpec(case.layout, False), case.kjt, 0, 2, case.shared, case.delayed)
    with pytest.raises(SetupError, match="output gradient has shape"):
        exchange(index, torch.zeros(case.local + 1, case.layout.width), None, None)
    with pytest.raises(DataError, match="missing from the step's global batch"):
        other = KeyedJaggedTensor(
            ["zz"], torch.zeros(0, dtype=torch.int64), lengths=torch.zeros(2, dtype=torch.int64)
        )
        exchange_index(ExchangeSpec(case.layout, False), other, 0, 2, case.shared, case.delayed)


def test_an_lrpp_plan_carries_the_exchange_index_of_each_kernel_it_covers():
    case = _Case(5, 2, False, False, False, False)
    tables = {
        t: LRPPTablePlan(
            evict_writer=torch.zeros(0, dtype=torch.int64),
            refresh_slots=torch.zeros(0, dtype=torch.int64),
            refresh_source=torch.zeros(0, dtype=torch.int64),
            shared_slots=case.shared[i],
            writer=torch.zeros(case.layout.capacity[i], dtype=torch.int8),
            rows_read=0,
            delayed_slots=case.delayed[i],
        )
        for i, t in enumerate(case.layout.tables)
    }
    covered = ExchangeSpec(case.layout, True)
    elsewhere = ExchangeSpec(
        KernelLayout(["g"], [0], ["not_planned"], [4], [2], mean=False, weighted=False), True
    )
    plan = LRPPPlan(3, tables, case.kjt).with_exchanges([covered, elsewhere], 1, 2)
    assert list(plan.exchange) == [tuple(case.layout.tables)]
    index = plan.exchange[tuple(case.layout.tables)]
    direct = exchange_index(covered, case.kjt, 1, 2, case.shared, case.delayed, [(0, 0)] * len(case.shared))
    assert index.spec == covered and index.rank == 1 and index.world_size == 2
    for name in ("indices", "offsets", "send"):
        assert torch.equal(getattr(index.now, name), getattr(direct.now, name))
    # without the global batch there is nothing to index
    assert LRPPPlan(3, tables).with_exchanges([covered], 1, 2).exchange == {}
