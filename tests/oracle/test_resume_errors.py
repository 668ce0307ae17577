"""Resume from state_dict, typed errors, rank annotations."""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import pytest
import torch

from tests.oracle.reference import random_trace
from torchrec_lookahead.errors import CapacityError, CheckpointError, ConfigError, DataError, InvalidIdError
from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig, min_capacity


def make_batches(steps: int = 40) -> List[Dict[str, torch.Tensor]]:
    a, b = random_trace(21, steps, 30, 200), random_trace(22, steps, 12, 60)
    return [{"a": torch.from_numpy(x), "b": torch.from_numpy(y)} for x, y in zip(a, b)]


def same(p: Any, q: Any) -> bool:
    return p.step == q.step and all(
        torch.equal(getattr(p.tables[n], f), getattr(q.tables[n], f))
        for n in p.tables
        for f in ("evict_ids", "evict_slots", "fetch_ids", "fetch_slots", "slots")
    )


@pytest.mark.parametrize("policy", ["belady", "lru", "ttl", "window"])
@pytest.mark.parametrize("stop", [0, 7, 19])
def test_resume_gives_identical_plans(policy: str, stop: int) -> None:
    batches = make_batches()
    cfg = OracleConfig(
        capacity={"a": 90, "b": 60},
        num_embeddings={"a": 200, "b": 60},
        horizon=8,
        prefetch_depth=2,
        policy=policy,
        window=4,
        ways=4,
    )
    full = list(LookaheadOracle(cfg).plan_stream(batches))
    first = LookaheadOracle(cfg)
    stream = first.plan_stream(batches)
    head = [next(stream) for _ in range(stop + 1)]
    state = first.state_dict()
    assert state["next_step"] == stop + 1
    resumed = LookaheadOracle(cfg)
    resumed.load_state_dict(state)
    tail = list(resumed.plan_stream(batches[state["next_step"] :]))
    assert len(head) + len(tail) == len(full)
    assert all(same(p, q) for p, q in zip(head + tail, full))


def test_load_state_of_other_config_is_refused() -> None:
    state = LookaheadOracle(OracleConfig(capacity={"a": 10})).state_dict()
    with pytest.raises(CheckpointError):
        LookaheadOracle(OracleConfig(capacity={"a": 10}, policy="lru")).load_state_dict(state)
    with pytest.raises(CheckpointError):
        LookaheadOracle(OracleConfig(capacity={"a": 11})).load_state_dict(state)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(capacity={"a": 0}), "capacity"),
        (dict(capacity={"a": -3}), "capacity"),
        (dict(capacity={"a": 10}, policy="fifo"), "belady"),
        (dict(capacity={"a": 10}, horizon=1, prefetch_depth=2), "prefetch_depth"),
        (dict(capacity={"a": 10}, horizon=1, prefetch_depth=1, policy="ttl"), "horizon"),
        (dict(capacity={"a": 10}, horizon=2, window=8, policy="window"), "window"),
        (dict(capacity={"a": 10}, ways=8, policy="window"), "ways"),
        (dict(capacity={"a": 10}, num_ranks=64), "num_ranks"),
        (dict(capacity={"a": 10}, num_embeddings={"a": 0}), "num_embeddings"),
        (dict(capacity=[("a", 1)]), "mapping"),
    ],
)
def test_config_errors(kwargs: Dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        OracleConfig(**kwargs)


def test_invalid_ids() -> None:
    cfg = OracleConfig(capacity={"a": 10}, num_embeddings={"a": 100}, horizon=2)
    with pytest.raises(InvalidIdError, match=r"'a'.*-1.*\[0, 100\)"):
        list(LookaheadOracle(cfg).plan_stream([{"a": torch.tensor([1, -1])}]))
    with pytest.raises(InvalidIdError, match=r"100.*\[0, 100\)"):
        list(LookaheadOracle(cfg).plan_stream([{"a": torch.tensor([1, 2])}, {"a": torch.tensor([100])}]))
    with pytest.raises(DataError):
        list(LookaheadOracle(cfg).plan_stream([{"a": torch.tensor([1.0])}]))


def test_capacity_error_raised_when_window_is_read() -> None:
    cfg = OracleConfig(capacity={"a": 5}, horizon=10, prefetch_depth=1)
    oracle = LookaheadOracle(cfg)
    assert oracle.feed({"a": torch.tensor([0, 1, 2])}) == []
    with pytest.raises(CapacityError, match=r"'a'.*batches 0\.\.1.*need 6.*capacity\['a'\] is 5.*at least 6"):
        oracle.feed({"a": torch.tensor([3, 4, 5])})


def test_ttl_capacity_error() -> None:
    cfg = OracleConfig(capacity={"a": 3}, horizon=3, policy="ttl")
    with pytest.raises(CapacityError, match="ttl"):
        list(
            LookaheadOracle(cfg).plan_stream(
                [{"a": torch.tensor([0, 1])}, {"a": torch.tensor([2, 3])}, {"a": torch.tensor([0, 1, 2, 3])}]
            )
        )


def test_unknown_tables_and_features() -> None:
    cfg = OracleConfig(capacity={"zz": 5})
    with pytest.raises(ConfigError, match=r"'zz'.*\['a'\]"):
        list(LookaheadOracle(cfg).plan_stream([{"a": torch.tensor([1])}]))
    cfg = OracleConfig(capacity={"t": 5}, feature_to_table={"f": "t"})
    with pytest.raises(ConfigError, match=r"'g'.*\['f'\]"):
        list(LookaheadOracle(cfg).plan_stream([{"f": torch.tensor([1]), "g": torch.tensor([2])}]))


def test_min_capacity() -> None:
    batches = [{"a": torch.tensor(b)} for b in ([1, 2], [2, 3, 4], [5], [5, 6])]
    cfg = OracleConfig(capacity={"a": 1})
    assert min_capacity(batches, 1, cfg) == {"a": 4}
    assert min_capacity(batches, 0, cfg) == {"a": 3}


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_rank_annotations_against_naive(num_ranks: int) -> None:
    rng = np.random.default_rng(0)
    steps, B = 12, 10
    batches = []
    for _ in range(steps):
        lens = rng.integers(0, 3, size=B)
        f1 = rng.integers(0, 30, size=int(lens.sum()))
        f2 = rng.integers(0, 30, size=B)
        batches.append({"f1": (torch.from_numpy(f1), torch.from_numpy(lens)), "f2": torch.from_numpy(f2)})
    cfg = OracleConfig(
        capacity={"t": 60}, horizon=3, num_ranks=num_ranks, feature_to_table={"f1": "t", "f2": "t"}
    )
    plans = list(LookaheadOracle(cfg).plan_stream(batches))
    bounds = np.cumsum([len(c) for c in np.array_split(np.arange(B), num_ranks)])
    for t, plan in enumerate(plans):
        readers: Dict[int, int] = {}
        f1, lens = batches[t]["f1"]
        sample = np.repeat(np.arange(B), lens.numpy())
        for ids, samp in ((f1.numpy(), sample), (batches[t]["f2"].numpy(), np.arange(B))):
            for i, s in zip(ids.tolist(), samp.tolist()):
                r = int(np.searchsorted(bounds, s, side="right"))
                readers[i] = readers.get(i, 0) | (1 << r)
        nxt = set()
        if t + 1 < steps:
            nxt = set(batches[t + 1]["f1"][0].tolist()) | set(batches[t + 1]["f2"].tolist())
        ann = plan.tables["t"].ranks
        assert ann is not None
        ids = sorted(readers)
        assert ann.unique_ids.tolist() == ids
        assert ann.reader_mask.tolist() == [readers[i] for i in ids]
        single = [bin(readers[i]).count("1") == 1 for i in ids]
        assert ann.single_rank.tolist() == single
        assert ann.shared_next.tolist() == [not s and i in nxt for s, i in zip(single, ids)]
        assert ann.shared_delayed.tolist() == [not s and i not in nxt for s, i in zip(single, ids)]


def test_no_annotation_for_one_rank() -> None:
    plans = list(LookaheadOracle(OracleConfig(capacity={"a": 4})).plan_stream([{"a": torch.tensor([1])}]))
    assert plans[0].tables["a"].ranks is None


def test_capacity_error_names_a_single_batch_or_the_window_in_words() -> None:
    oracle = LookaheadOracle(OracleConfig(capacity={"a": 2}, horizon=4, prefetch_depth=1))
    with pytest.raises(
        CapacityError, match=r"table 'a': batch 0 needs 3 cache rows but capacity\['a'\] is 2"
    ):
        oracle.feed({"a": torch.tensor([0, 1, 2])})
    oracle = LookaheadOracle(OracleConfig(capacity={"a": 4}, horizon=4, prefetch_depth=2))
    oracle.feed({"a": torch.tensor([0, 1])})
    oracle.feed({"a": torch.tensor([2, 3])})
    with pytest.raises(
        CapacityError, match=r"batches 0\.\.2 \(batch 2 and the prefetch_depth=2 batches before it"
    ):
        oracle.feed({"a": torch.tensor([4])})
