"""Policies replayed on a simulated cache and compared with naive references."""

from __future__ import annotations

from typing import Dict, List

import numpy as np
import pytest
import torch

from tests.oracle.reference import min_rows, random_trace, ref_fixed, ref_ttl, ref_window, replay
from torchrec_lookahead.errors import CapacityError, ConfigError
from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig


def batches_of(traces: Dict[str, List[np.ndarray]]) -> List[Dict[str, torch.Tensor]]:
    steps = len(next(iter(traces.values())))
    return [{name: torch.from_numpy(tr[t]) for name, tr in traces.items()} for t in range(steps)]


def run(cfg: OracleConfig, traces: Dict[str, List[np.ndarray]]) -> list:
    return list(LookaheadOracle(cfg).plan_stream(batches_of(traces)))


CASES = [
    # seed, steps, batch, rows, horizon, depth, slack (capacity = min + slack)
    (0, 40, 30, 120, 10, 1, 0),
    (1, 40, 30, 120, 10, 2, 0),
    (2, 50, 20, 300, 25, 1, 15),
    (3, 30, 40, 80, 5, 0, 3),
    (4, 40, 25, 200, 40, 2, 40),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("policy", ["belady", "lru"])
def test_fixed_policies_match_reference(case: tuple, policy: str) -> None:
    seed, steps, batch, rows, horizon, depth, slack = case
    traces = {
        "a": random_trace(seed, steps, batch, rows),
        "b": random_trace(seed + 100, steps, batch // 2 + 1, rows // 3 + 5, alpha=0.9),
    }
    cap = {name: min_rows(tr, depth) + slack for name, tr in traces.items()}
    cfg = OracleConfig(capacity=cap, horizon=horizon, prefetch_depth=depth, policy=policy)
    got = replay(traces, run(cfg, traces), cfg)
    for name, tr in traces.items():
        assert got[name] == ref_fixed(tr, cap[name], horizon, depth, policy)


@pytest.mark.parametrize("case", CASES)
def test_belady_never_above_lru(case: tuple) -> None:
    seed, steps, batch, rows, horizon, depth, slack = case
    traces = {"a": random_trace(seed, steps, batch, rows)}
    cap = {"a": min_rows(traces["a"], depth) + slack}
    fetched = {}
    for policy in ("belady", "lru"):
        oracle = LookaheadOracle(
            OracleConfig(capacity=cap, horizon=horizon, prefetch_depth=depth, policy=policy)
        )
        list(oracle.plan_stream(batches_of(traces)))
        fetched[policy] = oracle.stats()["a"]["fetches"]
    assert fetched["belady"] <= fetched["lru"]


def test_ttl_figure6() -> None:
    traces = {"t": [np.array(b) for b in ([3, 9], [3, 4], [3, 6], [6, 1])]}
    cfg = OracleConfig(capacity={"t": 8}, horizon=2, policy="ttl")
    got = replay(traces, run(cfg, traces), cfg)["t"]
    assert [f for f, _ in got] == [{3, 9}, {4}, {6}, {1}]
    assert [e for _, e in got] == [set(), {9}, {4}, {3}]


@pytest.mark.parametrize("horizon,depth", [(1, 0), (3, 0), (3, 2), (10, 1)])
def test_ttl_matches_reference_and_reuses_slots(horizon: int, depth: int) -> None:
    traces = {"a": random_trace(7, 40, 30, 150), "b": random_trace(8, 40, 10, 40)}
    cfg = OracleConfig(capacity={"a": 2000, "b": 2000}, horizon=horizon, prefetch_depth=depth, policy="ttl")
    oracle = LookaheadOracle(cfg)
    plans = list(oracle.plan_stream(batches_of(traces)))
    got = replay(traces, plans, cfg)
    for name, tr in traces.items():
        assert got[name] == ref_ttl(tr, horizon)
        peak = oracle.stats()[name]["peak_rows"]
        used = max(int(s) for p in plans for s in p.tables[name].fetch_slots.tolist())
        assert used + 1 == peak  # freed slots are reused: slots never go beyond the peak


@pytest.mark.parametrize(
    "rows,cap,window,ways,depth,victims",
    [(400, 120, 3, 4, 1, None), (400, 150, 2, 2, 2, 40), (60, 64, 4, 8, 1, None), (1000, 300, 1, 8, 1, 60)],
)
def test_window_matches_reference(
    rows: int, cap: int, window: int, ways: int, depth: int, victims: object
) -> None:
    traces = {"a": random_trace(11, 30, 20, rows)}
    cfg = OracleConfig(
        capacity={"a": cap},
        num_embeddings={"a": rows},
        horizon=max(window, depth) + 1,
        prefetch_depth=depth,
        window=window,
        ways=ways,
        victim_rows=victims,  # type: ignore[arg-type]
        seed=5,
        policy="window",
    )
    plans = run(cfg, traces)
    replay(traces, plans, cfg)
    ref = ref_window(traces["a"], cfg, "a")
    for plan, (fetched, evicted) in zip(plans, ref):
        tp = plan.tables["a"]
        assert dict(zip(tp.fetch_ids.tolist(), tp.fetch_slots.tolist())) == fetched
        assert set(tp.evict_ids.tolist()) == evicted


@pytest.mark.parametrize("ways, victims", [(8, None), (4, 3), (4, 100)])
def test_a_window_capacity_below_two_sets_gives_the_least_that_works(ways: int, victims: object) -> None:
    """The refusal names the least capacity that leaves two sets, and ``victim_rows`` only where it was set
    (``LookaheadDataModule`` does not take it)."""
    kw = {"num_embeddings": {"a": 1000}, "horizon": 4, "policy": "window", "window": 2, "ways": ways}
    with pytest.raises(ConfigError, match="raise the capacity to at least") as info:
        OracleConfig(capacity={"a": 9}, victim_rows=victims, **kw)  # type: ignore[arg-type]
    least = int(str(info.value).split("at least ")[1].split(",")[0])
    assert ("victim_rows" in str(info.value).split("raise")[1]) == (victims is not None)
    OracleConfig(capacity={"a": least}, victim_rows=victims, **kw)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        OracleConfig(capacity={"a": least - 1}, victim_rows=victims, **kw)  # type: ignore[arg-type]


def test_window_set_conflicts_beyond_the_victim_rows_are_refused_with_what_a_user_can_set() -> None:
    cfg = OracleConfig(
        capacity={"a": 20}, num_embeddings={"a": 1000}, horizon=3, policy="window", window=2, ways=2
    )
    batches = [{"a": torch.arange(0, 1000, 50)}, {"a": torch.arange(0, 1000, 50) + 1}]  # every id in one set
    with pytest.raises(CapacityError, match="set conflicts") as info:
        list(LookaheadOracle(cfg).plan_stream(batches))
    msg = str(info.value)
    assert "raise capacity['a'] (an eighth of it are victim rows), raise ways, or lower window" in msg, msg
    assert "victim_rows" not in msg


@pytest.mark.parametrize("policy", ["belady", "lru", "ttl", "window"])
def test_deterministic(policy: str) -> None:
    traces = {"a": random_trace(3, 30, 30, 200), "b": random_trace(4, 30, 10, 50)}
    cfg = OracleConfig(
        capacity={"a": 150, "b": 45}, num_embeddings={"a": 200, "b": 50}, horizon=6, policy=policy, window=3
    )
    one, two = run(cfg, traces), run(cfg, traces)
    for p, q in zip(one, two):
        for name in traces:
            for field in ("evict_ids", "evict_slots", "fetch_ids", "fetch_slots", "slots"):
                assert torch.equal(getattr(p.tables[name], field), getattr(q.tables[name], field))


class FakeJagged:
    def __init__(self, values: torch.Tensor, lengths: torch.Tensor) -> None:
        self._v, self._l = values, lengths

    def values(self) -> torch.Tensor:
        return self._v

    def lengths(self) -> torch.Tensor:
        return self._l


class FakeKJT:
    """The two methods of a KeyedJaggedTensor the oracle uses."""

    def __init__(self, features: Dict[str, torch.Tensor]) -> None:
        self._f = features

    def keys(self) -> List[str]:
        return list(self._f)

    def to_dict(self) -> Dict[str, FakeJagged]:
        return {k: FakeJagged(v, torch.ones(v.numel(), dtype=torch.int64)) for k, v in self._f.items()}


def test_kjt_duck_type_and_shared_table() -> None:
    f1 = random_trace(1, 20, 15, 100)
    f2 = random_trace(2, 20, 10, 100)
    resident = random_trace(3, 20, 5, 10)
    cfg = OracleConfig(
        capacity={"t": 60},
        horizon=5,
        feature_to_table={"f1": "t", "f2": "t", "r": "res"},
        num_embeddings={"t": 100},
    )
    kjts = [
        FakeKJT({"f2": torch.from_numpy(b), "f1": torch.from_numpy(a), "r": torch.from_numpy(c)})
        for a, b, c in zip(f1, f2, resident)
    ]
    plans = list(LookaheadOracle(cfg).plan_stream(kjts))
    assert set(plans[0].tables) == {"t"}
    concat = {"t": [np.concatenate([b, a]) for a, b in zip(f1, f2)]}  # key order: f2 then f1
    replay(concat, plans, cfg)


def test_unknown_num_embeddings_grows() -> None:
    traces = {"a": [np.array([5, 10_000, 3]), np.array([70_000, 5]), np.array([3])]}
    cfg = OracleConfig(capacity={"a": 4}, horizon=2)
    replay(traces, run(cfg, traces), cfg)


@pytest.mark.parametrize("policy", ["belady", "lru"])
def test_tables_that_fit_are_direct_mapped(policy: str) -> None:
    traces = {"small": random_trace(5, 30, 40, 25), "big": random_trace(6, 30, 30, 300)}
    cap = {"small": 25, "big": min_rows(traces["big"], 1)}
    cfg = OracleConfig(capacity=cap, num_embeddings={"small": 25, "big": 300}, horizon=5, policy=policy)
    oracle = LookaheadOracle(cfg)
    plans = list(oracle.plan_stream(batches_of(traces)))
    got = replay(traces, plans, cfg)
    for name, tr in traces.items():
        assert got[name] == ref_fixed(tr, cap[name], 5, 1, policy)
    assert all(torch.equal(p.tables["small"].slots, torch.from_numpy(traces["small"][p.step])) for p in plans)


@pytest.mark.parametrize("case", CASES[:3])
def test_belady_victim_pool_matches_reference(case: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchrec_lookahead.oracle.belady import BeladyPlanner

    monkeypatch.setattr(BeladyPlanner, "pool_min_capacity", 0)  # use the pool at test sizes
    seed, steps, batch, rows, horizon, depth, slack = case
    traces = {"a": random_trace(seed, steps, batch, rows)}
    cap = {"a": min_rows(traces["a"], depth) + slack}
    cfg = OracleConfig(capacity=cap, horizon=horizon, prefetch_depth=depth)
    got = replay(traces, run(cfg, traces), cfg)
    assert got["a"] == ref_fixed(traces["a"], cap["a"], horizon, depth, "belady")


def _plans_equal(a: list, b: list) -> bool:
    fields = ("evict_ids", "evict_slots", "fetch_ids", "fetch_slots", "slots")
    return all(
        torch.equal(getattr(x.tables[n], f), getattr(y.tables[n], f))
        for x, y in zip(a, b, strict=True)
        for n in x.tables
        for f in fields
    )


@pytest.mark.parametrize("policy", ["belady", "lru"])
def test_plans_without_table_sizes_equal_plans_with_them(policy: str) -> None:
    # "small" fits its capacity (direct mapped either way); "big" reads an id beyond its capacity in batch 0
    big = random_trace(6, 30, 30, 300)
    big[0][0] = 299
    traces = {"small": random_trace(5, 30, 40, 25), "big": big}
    cap = {"small": 25, "big": min_rows(big, 1)}
    sized = OracleConfig(capacity=cap, num_embeddings={"small": 25, "big": 300}, horizon=5, policy=policy)
    unsized = OracleConfig(capacity=cap, horizon=5, policy=policy)
    assert _plans_equal(run(sized, traces), run(unsized, traces))


@pytest.mark.parametrize("policy", ["belady", "lru"])
@pytest.mark.parametrize("horizon", [1, 4])
def test_table_leaving_direct_mapping_matches_reference(policy: str, horizon: int) -> None:
    # ids stay below the capacity for 12 batches (planned slot = id), then the whole range appears
    low = random_trace(7, 12, 20, 40)
    high = random_trace(8, 28, 20, 400)
    trace = low + high
    cap = {"a": max(min_rows(trace, 1), 60)}
    cfg = OracleConfig(capacity=cap, horizon=horizon, policy=policy)
    oracle = LookaheadOracle(cfg)
    plans = list(oracle.plan_stream(batches_of({"a": trace})))
    assert all(
        torch.equal(p.tables["a"].slots, torch.from_numpy(trace[p.step])) for p in plans[: 12 - horizon]
    )
    assert replay({"a": trace}, plans, cfg)["a"] == ref_fixed(trace, cap["a"], horizon, 1, policy)
    sized = OracleConfig(capacity=cap, num_embeddings={"a": 400}, horizon=horizon, policy=policy)
    ref = LookaheadOracle(sized)
    list(ref.plan_stream(batches_of({"a": trace})))
    assert oracle.stats() == ref.stats()


@pytest.mark.parametrize("policy", ["belady", "lru"])
@pytest.mark.parametrize("stop", [3, 7, 9, 15])
def test_resume_across_leaving_direct_mapping(policy: str, stop: int) -> None:
    # the table leaves direct mapping when batch 10 is read (at plan 7 with horizon 3)
    trace = random_trace(7, 10, 20, 40) + random_trace(8, 20, 20, 400)
    cfg = OracleConfig(capacity={"a": max(min_rows(trace, 1), 60)}, horizon=3, policy=policy)
    batches = batches_of({"a": trace})
    full = list(LookaheadOracle(cfg).plan_stream(batches))
    first = LookaheadOracle(cfg)
    stream = first.plan_stream(batches)
    head = [next(stream) for _ in range(stop + 1)]
    resumed = LookaheadOracle(cfg)
    resumed.load_state_dict(first.state_dict())
    tail = list(resumed.plan_stream(batches[stop + 1 :]))
    assert _plans_equal(head + tail, full)
