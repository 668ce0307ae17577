"""One move per slot space, and write-backs landed by the stager: the orderings that a deferred move must keep.

A deterministic fake stager stands in for the planning loader's: it gathers the rows of plan ``t`` at the earliest
point the no-stale-read rule allows (once plan ``t - 1`` is applied, prefetch depth 0), landing the write-backs
the training thread left to it first, exactly as ``LookaheadLoader._stage`` does.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from torchrec_lookahead.modules import CachedEmbeddingBagCollection, CacheOptimizerConfig, StagedRows
from torchrec_lookahead.modules._moves import WriteBacks
from torchrec_lookahead.oracle.types import BatchPlan, TablePlan

E = torch.empty(0, dtype=torch.long)


def _t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.long) if xs else E


def _cache() -> CachedEmbeddingBagCollection:
    """Tables a and b (dim 4) in one pooled slot space of 4 rows (slots 0..3), SGD."""
    tables = [
        EmbeddingBagConfig(name=n, embedding_dim=4, num_embeddings=100, feature_names=[f"f{n}"]) for n in "ab"
    ]
    return CachedEmbeddingBagCollection(
        tables, {"a": 2, "b": 2}, CacheOptimizerConfig("exact_sgd", learning_rate=0.5), seed=3
    )


# (a ids read, b ids read), and per table (evict ids, evict slots, fetch ids, fetch slots, slots read)
Step = Tuple[List[int], List[int], Dict[str, Tuple[List[int], List[int], List[int], List[int], List[int]]]]
STEPS: List[Step] = [
    # t = 0: a's 5 and 6 in slots 0 and 1, b's 7 in slot 2
    ([5, 6], [7], {"a": ([], [], [5, 6], [0, 1], [0, 1]), "b": ([], [], [7], [2], [2])}),
    # t = 1: a's 5 leaves slot 0 and b's 9 takes it; a's 6 (slot 1) and b's 7 (slot 2), its neighbours, are updated
    ([6], [7, 9], {"a": ([5], [0], [], [], [1]), "b": ([], [], [9], [0], [2, 0])}),
    # t = 2: a's 5, evicted at t = 1, comes back (slot 3); b's 7, updated by the backward of t = 1, leaves slot 2
    ([5, 6], [9], {"a": ([], [], [5], [3], [3, 1]), "b": ([7], [2], [], [], [0])}),
    # t = 3: b's 7 comes back into slot 2, a's 6 leaves slot 1
    ([5], [7, 9], {"a": ([6], [1], [], [], [3]), "b": ([], [], [7], [2], [2, 0])}),
]


def _plan(t: int) -> Tuple[BatchPlan, KeyedJaggedTensor]:
    a, b, parts = STEPS[t]
    plan = BatchPlan(t, {n: TablePlan(*(_t(*x) for x in p)) for n, p in parts.items()})
    kjt = KeyedJaggedTensor.from_lengths_sync(["fa", "fb"], _t(*a, *b), _t(len(a), len(b)))
    return plan, kjt


def _train(cache: CachedEmbeddingBagCollection, plan: BatchPlan, kjt: KeyedJaggedTensor) -> None:
    out = cache(cache.remap(kjt, plan)).values()
    (out * torch.arange(1, out.numel() + 1, dtype=out.dtype).view_as(out)).sum().backward()


def _tables(cache: CachedEmbeddingBagCollection) -> Dict[str, torch.Tensor]:
    cache.flush()
    return {n: s.full_weights().clone() for n, s in cache.stores.items()}


def _reference() -> Tuple[Dict[str, torch.Tensor], Dict[str, Dict[str, int]]]:
    """Every plan checked and applied on the training thread, rows gathered there, written back at once."""
    cache = _cache()
    for t in range(len(STEPS)):
        plan, kjt = _plan(t)
        cache.apply_plan(plan)
        _train(cache, plan, kjt)
    return _tables(cache), cache.stats()


class _FakeStager:
    """Gathers plan ``t``'s rows once plan ``t - 1`` is applied (prefetch depth 0), deterministically."""

    def __init__(self, cache: CachedEmbeddingBagCollection) -> None:
        self.cache = cache
        self.rows: Dict[int, StagedRows] = {}

    def after_applied(self, t: int) -> None:
        if t + 1 < len(STEPS):
            self.rows[t + 1] = self.cache.stage(_plan(t + 1)[0])  # lands the queued write-backs first


def test_rows_evicted_then_fetched_again_read_their_last_update_with_deferred_write_backs() -> None:
    expected, expected_stats = _reference()
    cache = _cache()
    stager = _FakeStager(cache)
    stager.rows[0] = cache.stage(_plan(0)[0])
    store_a = cache.stores["a"]
    for t in range(len(STEPS)):
        plan, kjt = _plan(t)
        prepared = cache.prepare_plan(plan)  # the planner thread's work
        before: Optional[torch.Tensor] = None
        if t == 1:  # a's 5 leaves slot 0: the row the cache holds, updated by the backward of t = 0
            before = cache.cache_weights("a")[0].clone()
        cache.apply_plan(plan, stager.rows.pop(t), trusted=True, prepared=prepared, defer_write_backs=True)
        if before is not None:
            # the store write is queued, not done: the store still holds 5's initial value
            assert len(cache._write_backs) == 1
            assert not torch.equal(store_a.gather(_t(5))[0][0], before)
        stager.after_applied(t)
        if before is not None:  # the stager landed it before gathering plan 2, which fetches 5 again
            assert len(cache._write_backs) == 0
            assert torch.equal(stager.rows[2].tables["a"].weights[0], before)
            assert torch.equal(store_a.gather(_t(5))[0][0], before)
        _train(cache, plan, kjt)
    got = _tables(cache)
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    assert cache.stats() == expected_stats


def test_an_eviction_beside_rows_the_last_backward_updated_takes_only_its_row() -> None:
    cache = _cache()
    for t in range(2):
        plan, kjt = _plan(t)
        cache.apply_plan(plan, trusted=True, prepared=cache.prepare_plan(plan), defer_write_backs=True)
        _train(cache, plan, kjt)
    # the backward of t = 1 updated slots 1 (a's 6), 2 (b's 7) and 0 (b's 9); plan 2 evicts b's 7 (slot 2)
    weights = cache.cache_weights("a").clone()  # the space's storage: every member's rows
    plan, _ = _plan(2)
    cache.apply_plan(plan, trusted=True, prepared=cache.prepare_plan(plan), defer_write_backs=True)
    after = cache.cache_weights("a")
    assert torch.equal(after[0], weights[0]) and torch.equal(after[1], weights[1])  # the neighbours stay
    cache.land_write_backs()
    assert torch.equal(cache.stores["b"].gather(_t(7))[0][0], weights[2])  # 7 left with its last update
    assert cache.slot_ids("a").tolist() == [-1, 6, -1, 5] and cache.slot_ids("b").tolist() == [9, -1, -1, -1]


def test_staged_rows_of_a_space_are_gathered_as_one_in_its_order() -> None:
    cache = _cache()
    staged = cache.stage(_plan(0)[0])
    assert list(staged.spaces) == ["a+b"]
    joined = staged.spaces["a+b"]
    assert joined.ids.tolist() == [5, 6, 7]
    assert torch.equal(joined.weights, torch.cat([staged.tables["a"].weights, staged.tables["b"].weights]))
    prepared = cache.prepare_plan(_plan(0)[0])
    assert [(s.tables, s.fetch_slots.tolist()) for s in prepared.spaces] == [(("a", "b"), [0, 1, 2])]


def test_write_backs_land_in_order_once() -> None:
    out: List[int] = []
    wb = WriteBacks()
    for i in range(3):
        wb.put(lambda i=i: out.append(i))
    wb.land()
    wb.land()
    assert out == [0, 1, 2] and len(wb) == 0
