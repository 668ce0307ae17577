"""Shared slot spaces: tables planned as one cache, checked against the same policy on one merged table."""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np
import pytest
import torch

from tests.oracle.reference import min_rows, random_trace
from tests.oracle.test_policies import batches_of
from torchrec_lookahead.errors import CheckpointError, ConfigError, InvalidIdError
from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig

ROWS = {"a": 300, "b": 40, "c": 120}


def _traces(seed: int, steps: int) -> Dict[str, List[np.ndarray]]:
    return {
        "a": random_trace(seed, steps, 30, ROWS["a"]),
        "b": random_trace(seed + 1, steps, 12, ROWS["b"], alpha=0.8),
        "c": random_trace(seed + 2, steps, 20, ROWS["c"], alpha=1.3),
    }


def _replay_shared(
    traces: Dict[str, List[np.ndarray]], plans: list, members: Tuple[str, ...], cap: int, depth: int
) -> None:
    """Apply the members' plans to one simulated cache: every member's write-backs, then every member's loads."""
    cache: Dict[int, Tuple[str, int]] = {}
    for t, plan in enumerate(plans):
        for name in members:
            tp = plan.tables[name]
            needed = set(np.concatenate(traces[name][t : t + depth + 1]).tolist())
            for i, s in zip(tp.evict_ids.tolist(), tp.evict_slots.tolist()):
                assert cache.get(s) == (name, i), (
                    f"step {t}: {name} evicts {i} from slot {s} = {cache.get(s)}"
                )
                assert i not in needed
                del cache[s]
        for name in members:
            tp = plan.tables[name]
            for i, s in zip(tp.fetch_ids.tolist(), tp.fetch_slots.tolist()):
                assert 0 <= s < cap and s not in cache, f"step {t}: {name} fetches {i} into slot {s}"
                assert (name, i) not in cache.values()
                cache[s] = (name, i)
        assert len(cache) <= cap
        for name in members:
            got = plan.tables[name].slots.tolist()
            assert [cache[s] for s in got] == [(name, i) for i in traces[name][t].tolist()]


def _merged(traces: Dict[str, List[np.ndarray]], members: Tuple[str, ...]) -> List[np.ndarray]:
    offsets = np.cumsum([0] + [ROWS[m] for m in members])
    steps = len(traces[members[0]])
    return [np.concatenate([traces[m][t] + offsets[i] for i, m in enumerate(members)]) for t in range(steps)]


@pytest.mark.parametrize("policy", ["belady", "lru", "ttl"])
@pytest.mark.parametrize("horizon,depth", [(6, 1), (20, 2), (0, 0)])
def test_shared_space_equals_one_merged_table(policy: str, horizon: int, depth: int) -> None:
    if policy == "ttl" and horizon < depth + 1:
        pytest.skip("ttl needs horizon >= prefetch_depth + 1")
    traces = _traces(3, 40)
    members = ("c", "a")
    cap = {"a": min_rows(traces["a"], depth), "b": ROWS["b"], "c": 30}
    cap["a"] = max(cap["a"], min_rows(_merged(traces, members), depth) - cap["c"])
    if policy == "ttl":  # no replacement decision: the capacity only bounds what the stream needs
        cap["a"] = ROWS["a"]
    sizes = dict(ROWS)
    cfg = OracleConfig(
        capacity=cap,
        horizon=horizon,
        prefetch_depth=depth,
        policy=policy,
        num_embeddings=sizes,
        slot_spaces={"s": members},
    )
    oracle = LookaheadOracle(cfg)
    plans = list(oracle.plan_stream(batches_of(traces)))
    pool = cap["a"] + cap["c"]
    _replay_shared(traces, plans, members, pool, depth)
    merged = {"m": _merged(traces, members)}
    ref = list(
        LookaheadOracle(
            OracleConfig(
                capacity={"m": pool},
                horizon=horizon,
                prefetch_depth=depth,
                policy=policy,
                num_embeddings={"m": sum(ROWS[m] for m in members)},
            )
        ).plan_stream(batches_of(merged))
    )
    offsets = {"c": 0, "a": ROWS["c"]}
    for got, want in zip(plans, ref):
        w = want.tables["m"]
        ev = sorted(
            (int(i) + offsets[m], int(s))
            for m in members
            for i, s in zip(got.tables[m].evict_ids, got.tables[m].evict_slots)
        )
        fe = sorted(
            (int(i) + offsets[m], int(s))
            for m in members
            for i, s in zip(got.tables[m].fetch_ids, got.tables[m].fetch_slots)
        )
        assert ev == sorted(zip(w.evict_ids.tolist(), w.evict_slots.tolist()))
        assert fe == sorted(zip(w.fetch_ids.tolist(), w.fetch_slots.tolist()))
        assert torch.cat([got.tables[m].slots for m in members]).tolist() == w.slots.tolist()
    # the table outside the space is planned alone, as without spaces
    alone = list(
        LookaheadOracle(
            OracleConfig(capacity={"b": cap["b"]}, horizon=horizon, prefetch_depth=depth, policy=policy)
        ).plan_stream(batches_of({"b": traces["b"]}))
    )
    assert [p.tables["b"].fetch_ids.tolist() for p in plans] == [
        p.tables["b"].fetch_ids.tolist() for p in alone
    ]
    stats = oracle.stats()
    assert sum(stats[m]["fetches"] for m in members) == sum(p.tables["m"].fetch_ids.numel() for p in ref)
    assert all(stats[m]["lookups"] == sum(x.size for x in traces[m]) for m in members)


def test_shared_space_fetches_no_more_than_the_split() -> None:
    traces = _traces(5, 80)
    members = ("a", "b", "c")
    cap = {m: max(min_rows(traces[m], 1), ROWS[m] // 5) for m in members}
    fetched = {}
    for spaces in (None, {"s": members}):
        oracle = LookaheadOracle(
            OracleConfig(capacity=cap, horizon=80, prefetch_depth=1, num_embeddings=ROWS, slot_spaces=spaces)
        )
        list(oracle.plan_stream(batches_of(traces)))
        fetched[spaces is None] = sum(s["fetches"] for s in oracle.stats().values())
    assert fetched[False] < fetched[True]


@pytest.mark.parametrize("stop", [7, 23])
def test_shared_space_resumes_exactly(stop: int) -> None:
    traces = _traces(9, 40)
    cap = {"a": 40, "b": 20, "c": 30}
    cfg = OracleConfig(
        capacity=cap, horizon=8, prefetch_depth=1, num_embeddings=ROWS, slot_spaces={"s": ("a", "b", "c")}
    )
    batches = batches_of(traces)
    whole = list(LookaheadOracle(cfg).plan_stream(batches))
    first = LookaheadOracle(cfg)
    gen = first.plan_stream(batches)
    head = [next(gen) for _ in range(stop)]
    state = first.state_dict()
    again = LookaheadOracle(cfg)
    again.load_state_dict(state)
    tail = list(again.plan_stream(batches[state["next_step"] :]))
    for a, b in zip(head + tail, whole):
        for t in cap:
            assert torch.equal(a.tables[t].fetch_slots, b.tables[t].fetch_slots)
            assert torch.equal(a.tables[t].slots, b.tables[t].slots)
    full = LookaheadOracle(cfg)
    list(full.plan_stream(batches))
    assert again.stats() == full.stats()
    per_table = LookaheadOracle(OracleConfig(capacity=cap, horizon=8, prefetch_depth=1, num_embeddings=ROWS))
    with pytest.raises(CheckpointError, match="tables"):
        per_table.load_state_dict(state)


def test_shared_space_rank_annotations_are_the_members() -> None:
    traces = _traces(11, 12)
    cap = {"a": 60, "b": 30, "c": 40}
    kw = dict(horizon=4, prefetch_depth=1, num_embeddings=ROWS, num_ranks=2)
    split = list(LookaheadOracle(OracleConfig(capacity=cap, **kw)).plan_stream(batches_of(traces)))
    pooled = list(
        LookaheadOracle(OracleConfig(capacity=cap, slot_spaces={"s": ("a", "c")}, **kw)).plan_stream(
            batches_of(traces)
        )
    )
    for p, q in zip(split, pooled):
        for t in cap:
            r, s = p.tables[t].ranks, q.tables[t].ranks
            assert r is not None and s is not None
            assert torch.equal(r.unique_ids, s.unique_ids) and torch.equal(r.reader_mask, s.reader_mask)
            assert torch.equal(r.single_rank, s.single_rank)


def test_slot_space_errors() -> None:
    with pytest.raises(ConfigError, match="no capacity"):
        OracleConfig(capacity={"a": 4}, slot_spaces={"s": ["a", "z"]})
    with pytest.raises(ConfigError, match="slot spaces"):
        OracleConfig(capacity={"a": 4, "b": 4}, slot_spaces={"s": ["a"], "r": ["a", "b"]})
    with pytest.raises(ConfigError, match="num_embeddings"):
        LookaheadOracle(OracleConfig(capacity={"a": 4, "b": 4}, slot_spaces={"s": ["a", "b"]}))
    oracle = LookaheadOracle(
        OracleConfig(
            capacity={"a": 4, "b": 4}, num_embeddings={"a": 10, "b": 10}, slot_spaces={"s": ["a", "b"]}
        )
    )
    with pytest.raises(InvalidIdError, match="table 'b': id 10"):
        oracle.feed({"a": torch.tensor([9]), "b": torch.tensor([10])})


def test_a_shared_space_too_small_names_its_tables() -> None:
    from torchrec_lookahead.errors import CapacityError

    cfg = OracleConfig(
        capacity={"a": 2, "b": 2}, num_embeddings={"a": 10, "b": 10}, slot_spaces={"s": ["a", "b"]}, horizon=2
    )
    with pytest.raises(
        CapacityError,
        match=r"shared by tables \['a', 'b'\] \(the sum of their capacities, 4 rows\): batch 0 needs 5 cache rows "
        r"but it holds 4; raise",
    ):
        list(LookaheadOracle(cfg).plan_stream([{"a": torch.tensor([1, 2, 3]), "b": torch.tensor([4, 5])}]))


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_a_space_read_on_several_threads_plans_the_same(num_ranks: int) -> None:
    """The members' ids are read in groups on the planner threads: plans, counters and state do not move."""
    traces = _traces(5, 30)
    members = ("a", "b", "c")
    runs = []
    for threads in (1, 2, 3):
        oracle = LookaheadOracle(
            OracleConfig(
                capacity={"a": 60, "b": 20, "c": 40},
                horizon=8,
                prefetch_depth=1,
                num_embeddings=ROWS,
                slot_spaces={"s": members},
                plan_threads=threads,
                num_ranks=num_ranks,
            )
        )
        plans = list(oracle.plan_stream(batches_of(traces)))
        runs.append((plans, oracle.stats(), oracle.state_dict()))
    (want, stats, state), rest = runs[0], runs[1:]
    for plans, got_stats, got_state in rest:
        assert got_stats == stats
        for p, w in zip(plans, want, strict=True):
            for m in members:
                a, b = p.tables[m], w.tables[m]
                for field in ("evict_ids", "evict_slots", "fetch_ids", "fetch_slots", "slots"):
                    assert torch.equal(getattr(a, field), getattr(b, field)), (m, field)
                if num_ranks > 1:
                    assert a.ranks is not None and b.ranks is not None
                    assert torch.equal(a.ranks.reader_mask, b.ranks.reader_mask)
        assert torch.equal(got_state["tables"]["s"]["id_of_slot"], state["tables"]["s"]["id_of_slot"])


def test_a_space_under_the_window_policy_splits_its_fetches_by_member() -> None:
    """The window policy lists a window's fetches set by set, the members interleaved: each member's plan holds
    its own ids (a replay of the shared cache checks every slot)."""
    traces = _traces(7, 24)
    members = ("c", "a")
    cap = {"a": 200, "c": 100, "b": ROWS["b"]}
    common = dict(horizon=4, prefetch_depth=1, policy="window", window=2, ways=4)
    plans = list(
        LookaheadOracle(
            OracleConfig(capacity=cap, num_embeddings=ROWS, slot_spaces={"s": members}, **common)
        ).plan_stream(batches_of(traces))
    )
    assert any(p.tables["a"].fetch_ids.numel() and p.tables["c"].fetch_ids.numel() for p in plans)
    _replay_shared(traces, plans, members, cap["a"] + cap["c"], 1)
