"""Tables planned in parallel (``plan_threads > 1``) give the plans, stats, state and errors of the serial oracle."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np
import pytest
import torch

from tests.oracle.reference import min_rows, random_trace
from torchrec_lookahead.errors import CapacityError, ConfigError, InvalidIdError
from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig
from torchrec_lookahead.oracle.types import BatchPlan

FIELDS = ("evict_ids", "evict_slots", "fetch_ids", "fetch_slots", "slots")
RANK_FIELDS = ("unique_ids", "reader_mask", "single_rank", "shared_next", "shared_delayed")


def stream(seed: int, steps: int) -> Dict[str, List[np.ndarray]]:
    """Seven tables of assorted sizes and batch shapes: small ones that fit, large ones that evict."""
    rng = np.random.default_rng(seed)
    traces = {}
    for i in range(7):
        rows = int(rng.integers(20, 400))
        batch = int(rng.integers(5, 60))
        traces[f"t{i}"] = random_trace(seed * 10 + i, steps, batch, rows, alpha=float(rng.uniform(0.8, 1.3)))
    return traces


def batches_of(traces: Dict[str, List[np.ndarray]], with_lengths: bool) -> List[Dict[str, Any]]:
    steps = len(next(iter(traces.values())))
    out = []
    for t in range(steps):
        batch: Dict[str, Any] = {}
        for name, tr in traces.items():
            ids = torch.from_numpy(tr[t])
            batch[name] = (ids, torch.ones(ids.numel(), dtype=torch.int64)) if with_lengths else ids
        out.append(batch)
    return out


def config(
    traces: Dict[str, List[np.ndarray]], policy: str, threads: int, sized: bool, ranks: int
) -> OracleConfig:
    depth = 1
    cap = {}
    rows = {}
    for i, (name, tr) in enumerate(traces.items()):
        rows[name] = int(max(int(b.max()) for b in tr)) + 1
        need = min_rows(tr, depth)
        # every third table fits whole (direct mapping), the others keep a little slack over the minimum
        cap[name] = rows[name] if i % 3 == 0 else need + i
        if policy == "window":
            cap[name] = max(cap[name], 2 * need + 40)
        if policy == "ttl":  # ttl keeps what the horizon needs: give it every row
            cap[name] = rows[name]
    return OracleConfig(
        capacity=cap,
        num_embeddings=rows if sized else None,
        horizon=6,
        prefetch_depth=depth,
        policy=policy,
        window=3,
        ways=2,
        num_ranks=ranks,
        plan_threads=threads,
    )


def assert_same_plans(one: List[BatchPlan], two: List[BatchPlan]) -> None:
    assert [p.step for p in one] == [p.step for p in two]
    for p, q in zip(one, two):
        assert list(p.tables) == list(q.tables)
        for name in p.tables:
            a, b = p.tables[name], q.tables[name]
            for field in FIELDS:
                assert torch.equal(getattr(a, field), getattr(b, field)), (p.step, name, field)
            assert (a.ranks is None) == (b.ranks is None)
            if a.ranks is not None and b.ranks is not None:
                for field in RANK_FIELDS:
                    assert torch.equal(getattr(a.ranks, field), getattr(b.ranks, field))


def assert_same_state(one: Any, two: Any) -> None:
    if isinstance(one, dict):
        assert set(one) == set(two)
        for key in one:
            assert_same_state(one[key], two[key])
    elif isinstance(one, torch.Tensor):
        assert torch.equal(one, two)
    else:
        assert one == two


@pytest.mark.parametrize("policy", ["belady", "lru", "ttl", "window"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_parallel_plans_equal_serial_plans(policy: str, seed: int) -> None:
    traces = stream(seed, 40)
    sized, ranks = seed != 1, 1 + seed % 2
    batches = batches_of(traces, with_lengths=ranks > 1)
    serial = LookaheadOracle(config(traces, policy, 1, sized, ranks))
    plans = list(serial.plan_stream(batches))
    for threads in (2, 3, 8):
        parallel = LookaheadOracle(config(traces, policy, threads, sized, ranks))
        assert_same_plans(plans, list(parallel.plan_stream(batches)))
        assert parallel.stats() == serial.stats()
        assert_same_state(parallel.state_dict(), serial.state_dict())


@pytest.mark.parametrize("policy", ["belady", "ttl"])
def test_parallel_resume_equals_serial_run(policy: str) -> None:
    traces = stream(3, 30)
    batches = batches_of(traces, with_lengths=False)
    plans = list(LookaheadOracle(config(traces, policy, 1, True, 1)).plan_stream(batches))
    first = LookaheadOracle(config(traces, policy, 4, True, 1))
    head: List[BatchPlan] = []
    for batch in batches[:17]:
        head.extend(first.feed(batch))
    again = LookaheadOracle(config(traces, policy, 4, True, 1))
    again.load_state_dict(first.state_dict())
    assert_same_plans(plans, head + list(again.plan_stream(batches[again.next_step :])))


def _error(threads: int, batches: List[Dict[str, torch.Tensor]], cfg: Dict[str, Any]) -> Optional[Exception]:
    oracle = LookaheadOracle(OracleConfig(plan_threads=threads, **cfg))
    try:
        list(oracle.plan_stream(batches))
    except (CapacityError, InvalidIdError) as exc:
        return exc
    return None


def test_parallel_raises_the_error_serial_planning_meets_first() -> None:
    ok = torch.arange(4)
    cfg: Dict[str, Any] = dict(
        capacity={"a": 4, "b": 4, "c": 4}, num_embeddings={"a": 9, "b": 9, "c": 9}, horizon=2
    )
    # table c fails its capacity check when batch 1 is read, table b has an out-of-range id in batch 1:
    # the ids are checked before any table reads the batch, so the id error comes first
    batches = [
        {"a": ok, "b": ok, "c": ok},
        {"a": ok, "b": torch.tensor([1, 12]), "c": torch.arange(4, 9)},
    ]
    got = [_error(threads, batches, cfg) for threads in (1, 3)]
    assert all(isinstance(e, InvalidIdError) and "'b'" in str(e) for e in got)
    # two tables over capacity in the same batch: the first in table order is named
    batches = [{"a": ok, "b": torch.arange(4, 9), "c": torch.arange(3, 9)}]
    got = [_error(threads, batches, cfg) for threads in (1, 3)]
    assert all(isinstance(e, CapacityError) and "'b'" in str(e) for e in got)
    assert str(got[0]) == str(got[1])


@pytest.mark.parametrize("threads", [0, -1, True, 1.5, "2"])
def test_plan_threads_must_be_a_positive_integer(threads: Any) -> None:
    with pytest.raises(ConfigError, match="plan_threads"):
        OracleConfig(capacity={"a": 4}, plan_threads=threads)


def test_plan_threads_default() -> None:
    threads = OracleConfig(capacity={"a": 4}).plan_threads
    assert threads is not None and 1 <= threads <= 4
