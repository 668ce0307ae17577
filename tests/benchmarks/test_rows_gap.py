"""benchmarks/rows_gap.py on a small stream: its simulated caches against each other and against the oracle."""

import os

import numpy as np
import pytest

from benchmarks import rows_gap


def test_caches_order_and_the_oracle_is_belady_when_it_sees_the_whole_stream():
    # 13 batches, horizon 64: the oracle sees the whole stream, so it fetches what offline MIN fetches
    r = rows_gap.main(["--scale", "0.01", "--fraction", "0.05", "--steps", "10", "--warmup", "1"])
    c = {k: v["fetched_per_step"] for k, v in r["caches"].items()}
    assert c["ours_per_table"] == c["min_table"] and c["ours_shared"] == c["min_shared"]
    # the product's default (pooled) cache plans the shared cache exactly
    assert c["ours"] == c["ours_shared"]
    assert c["compulsory"] <= c["min_shared"] <= c["min_table"] <= c["lru_table"]
    assert c["min_shared"] <= c["lru_shared"] and c["compulsory"] <= c["setassoc_shared"]
    assert c["min_shared_fbgemm_slots"] <= c["min_shared"]
    by_table = r["caches"]["ours"]["fetched_per_step_by_table"]
    assert set(by_table) == set(r["capacity"]) and np.isclose(sum(by_table.values()), c["ours"])
    # the planner splits the same bytes (every row has the same width here): never more rows in all
    assert sum(r["planned_capacity"].values()) <= sum(r["capacity"].values())


def test_lru_and_min_on_a_hand_stream():
    us = [np.array([0, 1, 2]), np.array([3, 0]), np.array([1, 4]), np.array([0])]
    lru, _ = rows_gap.fully_assoc(us, 5, 3, "lru")
    opt, _ = rows_gap.fully_assoc(us, 5, 3, "min", rows_gap.next_uses(us, 5))
    # step 1 evicts one of 1 and 2: MIN the never reused 2, LRU either (a tie); step 2 MIN evicts the dead 3
    assert opt.tolist() == [3, 1, 1, 0] and lru.sum() >= opt.sum()
    fetched, evicted, conflicts = rows_gap.set_assoc(us, 5, 64, ways=32)  # 64 ways for 5 ids: no eviction
    assert fetched.tolist() == [3, 1, 1, 0] and evicted.sum() == 0 and conflicts.sum() == 0


@pytest.mark.skipif(
    not os.path.isfile(rows_gap.TAOBAO_CSV), reason="the Taobao sample (../shared/data) is absent"
)
def test_the_taobao_sample_in_time_order(tmp_path):
    rows, batches = rows_gap.taobao_stream(rows_gap.TAOBAO_CSV, 512)
    assert set(rows) == {"t_user", "t_item", "t_category"} and len(batches) == 84_475 // 512
    assert all(b[t].size == 512 and b[t].max() < rows[t] for b in batches[:3] for t in rows)
    r = rows_gap.main(
        ["--taobao", "--fraction", "0.001", "--steps", "60", "--skip", "ours_planned", "min_table"]
    )
    assert r["window"] == [6, 66]
    c = {k: v["fetched_per_step"] for k, v in r["caches"].items()}
    assert c["ours"] == c["ours_shared"] and c["compulsory"] <= c["min_shared"] <= c["ours"]
    assert c["ours"] < c["setassoc_shared"]  # a cache that plans fetches fewer rows than one that guesses


def test_a_missing_taobao_file_is_named(tmp_path):
    with pytest.raises(SystemExit, match="no Taobao file"):
        rows_gap.main(["--taobao", str(tmp_path / "none.csv")])
