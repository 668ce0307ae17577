"""benchmarks/gpu.py runs its code paths on the CPU (``--device cpu``) and reports both resident anchors; the
TorchRec UVM-caching anchor (benchmarks/_uvm.py): its byte accounting, TorchRec's plan for it (planned for a CUDA
topology, which needs no GPU), its loop on the CPU (no cache there: the code path), and on a GPU (``cuda``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, Iterator, Tuple

import pytest
import torch
import torch.distributed as dist

from benchmarks import _uvm
from torchrec_lookahead.models import DLRMModule

from ..cli.test_cli import clean_env
from ..conftest import REPO, free_port

DEVICE = torch.device(os.environ.get("TRL_TEST_DEVICE", "cuda"))
TINY = str(REPO / "configs" / "dlrm_tiny.yaml")


def run_gpu_script(tmp_path: Path, *args: str) -> Dict[str, Any]:
    """``benchmarks/gpu.py *args --json OUT`` in its own interpreter (the script silences logging and warnings
    process-wide, as a benchmark should); the JSON it wrote."""
    out = tmp_path / "gpu.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", *args, "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=clean_env(),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_gpu_benchmark_on_cpu(tmp_path: Path) -> None:
    saved = run_gpu_script(
        tmp_path, "--device", "cpu", "--quick", "--steps", "3", "--warmup", "1", "--rounds", "1"
    )
    assert saved["complete"] is True
    assert saved["cached_over_resident"] == pytest.approx(saved["cached_step_ms"] / saved["resident_step_ms"])
    for kind in ("resident", "resident_bg", "cached", "fae", "host"):
        assert saved[f"{kind}_step_ms"] > 0
        assert saved["runs"][kind]["step_ms"] == saved[f"{kind}_step_ms"]
    assert saved["fae_over_resident"] == pytest.approx(saved["fae_step_ms"] / saved["resident_step_ms"])
    assert saved["cached_over_resident_background_loading"] == pytest.approx(
        saved["cached_step_ms"] / saved["resident_bg_step_ms"]
    )
    # the UVM anchor needs CUDA: recorded as skipped, with its CPU-checkable plan
    for kind in _uvm.UVM_KINDS:
        assert "needs CUDA" in saved["runs"][kind]["skipped"]
        assert f"{kind}_step_ms" not in saved and f"cached_over_{kind}" not in saved
    assert "skipped" in saved["link"]
    kernels = saved["uvm_plan"]["kernels"]
    assert {t for t, k in kernels["lru"].items() if k["compute_kernel"] == "fused_uvm_caching"} == set(
        saved["capacity"]
    )
    # the lookahead cache's traffic over the timed steps, with its optimizer state (row-wise Adagrad: D + 1)
    cached = saved["runs"]["cached"]
    assert cached["timed_steps"] == 4 and cached["rows_h2d_per_step"] > 0
    assert cached["bytes_h2d_per_step"] == cached["rows_h2d_per_step"] * (16 + 1) * 4
    assert 0.0 <= cached["hit_rate"] <= 1.0 and 0.0 <= cached["lookup_hit_rate"] <= 1.0
    assert cached["floor_ms"] is None  # no host <-> device link on the CPU
    # beside the step time, the lookahead loader's threads: the training thread's waits, each thread's CPU
    threads = cached["loader"]
    for key in ("batch wait ms/step", "stager wait ms/step", "reader cpu ms/batch", "planner cpu ms/batch"):
        assert threads[key] >= 0, threads
    assert threads["planner cpu ms/batch"] > 0, threads
    # each run's last timed step profiled (torch.profiler), its top operators by self CPU time (no CUDA here)
    for kind in ("resident", "resident_bg", "cached", "fae"):
        profile = saved["runs"][kind]["profile"]
        assert profile["self_cpu_ms"] > 0 and 0 < len(profile["by_cpu"]) <= 15, profile
        top = profile["by_cpu"]
        assert [r["self_cpu_ms"] for r in top] == sorted((r["self_cpu_ms"] for r in top), reverse=True)
        assert "by_cuda" not in profile and all(r["calls"] >= 1 for r in top)
    assert "profile" not in saved["runs"]["host"]
    # at equal total HBM (uvm_lru's cache, index and every row's row-wise state): a larger cache, at most the rows
    hbm = saved["fractions"]["fraction"]["capacity_equal_hbm"]
    assert hbm.keys() == saved["capacity"].keys()
    assert all(saved["capacity"][t] < c for t, c in hbm.items())
    assert (
        saved["runs"]["cached_hbm"]["step_ms"] > 0 and saved["runs"]["cached_hbm"]["rows_h2d_per_step"] >= 0
    )


@pytest.mark.slow
def test_gpu_dry_run_plans_the_uvm_anchor_at_each_fraction(tmp_path: Path) -> None:
    saved = run_gpu_script(
        tmp_path, "--device", "cpu", "--dry-run", "--quick", "--steps", "2", "--warmup", "1", "--fraction", "0.01",
        "0.05",
    )  # fmt: skip
    assert set(saved["fractions"]) == {"fraction", "fraction_5pct"}
    for key, fraction in (("uvm_plan", "fraction"), ("uvm_plan_5pct", "fraction_5pct")):
        plan = saved[key]
        capacity = saved["fractions"][fraction]["capacity"]
        assert {t: v["cache_rows_ours"] for t, v in plan["tables"].items()} == capacity
        assert plan["hbm_cache_bytes_ours"] == sum(capacity.values()) * plan["row_bytes_ours"]
        # FBGEMM's cache holds at least our bytes, at most one set of 32 rows more
        fbgemm = plan["fbgemm_cache_slots"] * plan["row_bytes_fbgemm"]
        assert (
            plan["hbm_cache_bytes_ours"]
            <= fbgemm
            < plan["hbm_cache_bytes_ours"] + 32 * plan["row_bytes_fbgemm"]
        )
        for algorithm in ("lru", "lfu"):
            uvm = {
                t: k
                for t, k in plan["kernels"][algorithm].items()
                if k["compute_kernel"] == "fused_uvm_caching"
            }
            assert set(uvm) == set(capacity)
            assert all(k["cache_algorithm"] == algorithm.upper() for k in uvm.values())
            assert all(k["load_factor"] == plan["tables"][t]["load_factor"] for t, k in uvm.items())
    assert saved["uvm_plan_5pct"]["fbgemm_cache_slots"] > saved["uvm_plan"]["fbgemm_cache_slots"]


def test_planner_split_spends_the_fixed_splits_bytes_on_the_same_tables() -> None:
    from benchmarks import gpu
    from benchmarks._common import build, capacities, oracle_floors, table_rows

    dm = build(overrides=["--data.init_args.num_train_batches=12"]).datamodule
    fixed, _ = capacities(dm, 0.05, 5000)
    floors = oracle_floors(dm, list(fixed))
    cap, info = gpu.planned_capacities(dm, fixed, floors, 16, "rowwise_adagrad", 8)
    rows = table_rows(dm)
    assert info["budget_bytes"] == sum(fixed.values()) * 68 and 0 < info["bytes"] <= info["budget_bytes"]
    assert info["sample_batches"] == 8
    # every table of the fixed split is cached by the plan or resident, never both
    assert set(cap) | set(info["resident"]) == set(fixed) and not set(cap) & set(info["resident"])
    assert all(0 < cap[t] < rows[t] for t in cap)
    # the planned capacities hold every batch of the run (bumped where the sample was short)
    assert all(cap[t] >= floors[t] for t in cap)
    assert capacities(dm, 0.05, 5000, floors=floors) == capacities(dm, 0.05, 5000)


@pytest.mark.slow
def test_gpu_dry_run_with_the_planner_split(tmp_path: Path) -> None:
    saved = run_gpu_script(
        tmp_path, "--device", "cpu", "--dry-run", "--quick", "--steps", "4", "--warmup", "1", "--fraction", "0.05",
        "0.01", "--split", "planner", "--plan-sample", "5",
    )  # fmt: skip
    assert saved["split"] == "planner"
    assert saved["capacity"] == saved["fractions"]["fraction"]["capacity"]
    for key, fraction in (("uvm_plan", "fraction"), ("uvm_plan_1pct", "fraction_1pct")):
        entry = saved["fractions"][fraction]
        fixed, planned = entry["fraction_capacity"], entry["planner"]
        assert planned["sample_batches"] == 5
        assert planned["budget_bytes"] == sum(fixed.values()) * 68 >= planned["bytes"]
        assert set(entry["capacity"]) | set(planned["resident"]) == set(fixed)
        # the UVM anchor keeps the fixed split's bytes: one shared cache, only the total counts
        assert {t: v["cache_rows_ours"] for t, v in saved[key]["tables"].items()} == fixed
        assert saved[key]["hbm_cache_bytes_ours"] == planned["budget_bytes"]


def test_byte_equal_load_factors_give_fbgemm_the_bytes_of_our_cache() -> None:
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import DEFAULT_ASSOC

    assert _uvm.ASSOC == DEFAULT_ASSOC  # the installed FBGEMM's ways per set
    rows = {"a": 1_000_000, "b": 50_000, "c": 700}
    capacity = {"a": 10_000, "b": 2_500, "c": 690}
    # row-wise Adagrad at D = 16: our rows carry 16 weights + 1 state (68 B), FBGEMM's 16 weights (64 B)
    assert (_uvm.our_row_bytes(16, "rowwise_adagrad"), _uvm.fbgemm_row_bytes(16)) == (68, 64)
    lf = _uvm.byte_equal_load_factors(capacity, rows, 16, "rowwise_adagrad")
    assert lf["a"] == pytest.approx(10_000 * 68 / (1_000_000 * 64))
    assert lf["b"] == pytest.approx(2_500 * 68 / (50_000 * 64))
    assert lf["c"] == _uvm.MAX_LOAD_FACTOR  # 690 x 68 > 700 x 64: capped below 1, as TorchRec's planner wants
    # TorchRec's one cache per TBE: the load factors' row-weighted mean x the rows, rounded up to sets of 32
    slots = _uvm.fbgemm_cache_slots(lf, rows)
    expected = sum(lf[t] * rows[t] for t in rows)
    assert slots % 32 == 0 and expected <= slots < expected + 32
    # SGD keeps no state: equal rows; Adam keeps two D-wide states: three times the rows
    assert _uvm.byte_equal_load_factors({"a": 1000}, rows, 16, "sgd")["a"] == pytest.approx(0.001)
    assert _uvm.byte_equal_load_factors({"a": 1000}, rows, 16, "adam")["a"] == pytest.approx(0.003)
    hbm = _uvm.fbgemm_hbm_bytes(lf, rows, 16, "rowwise_adagrad", "lfu")
    table_rows = sum(rows.values())
    assert hbm["cache_weights"] == slots * 64 and hbm["optimizer_state"] == table_rows * 4
    assert hbm["lxu_state"] == (table_rows + 1) * 8 and hbm["locking_counter"] == 0
    assert (
        _uvm.fbgemm_hbm_bytes(lf, rows, 16, "adam", "lru")["optimizer_state"] == 0
    )  # D-wide: in host memory


def test_traffic_figures_per_step() -> None:
    first = {
        "unique_misses": 1000,
        "occupied_slots": 512,
        "unique_indices": 4000,
        "conflict_unique_misses": 3,
    }
    last = {"unique_misses": 1600, "occupied_slots": 544, "unique_indices": 6000, "conflict_unique_misses": 5}
    uvm = _uvm.uvm_traffic(first, last, 4, 64)
    assert (uvm["rows_h2d"], uvm["rows_d2h"], uvm["bytes_h2d"]) == (600, 568, 600 * 64)
    ours = _uvm.our_traffic(
        {"rows_fetched": 300, "rows_written_back": 280, "lookups": 9000, "hits": 8700}, 4, 68
    )
    bandwidth = {"h2d_gb_s": 50.0, "d2h_gb_s": 25.0}
    f_uvm, f_ours = _uvm.per_step([uvm], 500.0, bandwidth), _uvm.per_step([ours, ours], 500.0, bandwidth)
    assert f_uvm["rows_h2d_per_step"] == 150 and f_uvm["hit_rate"] == pytest.approx(0.7)
    assert f_uvm["unique_indices_per_step"] == 500 and f_uvm["conflict_unique_misses_per_step"] == 0.5
    assert f_ours["timed_steps"] == 8 and f_ours["rows_h2d_per_step"] == 75
    assert f_ours["lookup_hit_rate"] == pytest.approx(8700 / 9000)
    # the floor: the slower direction of the full-duplex link
    assert f_ours["floor_ms"] == pytest.approx(max(75 * 68 / 50e9, 70 * 68 / 25e9) * 1e3)
    missing = _uvm.uvm_traffic({"unique_misses": None}, {"unique_misses": None}, 4, 64)
    assert _uvm.per_step([missing], 500.0, bandwidth)["rows_h2d_per_step"] is None


def tiny_module() -> Tuple[DLRMModule, Any]:
    sizes = {"f0": 5000, "f1": 40, "f2": 800}
    lm = DLRMModule(sizes, num_dense_features=2, embedding_dim=8, dense_arch_layer_sizes=[8])
    return lm, SimpleNamespace(num_embeddings_per_feature=sizes)


def test_torchrec_plans_fused_uvm_caching_for_the_cached_tables_without_a_gpu() -> None:
    lm, dm = tiny_module()
    capacity = {"t_f0": 250, "t_f2": 40}
    plan = _uvm.anchor_plan(lm, dm, capacity)
    lf = _uvm.byte_equal_load_factors(capacity, {"t_f0": 5000, "t_f2": 800}, 8, "rowwise_adagrad")
    assert {t: v["load_factor"] for t, v in plan["tables"].items()} == lf
    for algorithm, prefetch in (("lru", True), ("lfu", False)):
        kernels = plan["kernels"][algorithm]
        assert kernels["t_f1"]["compute_kernel"] == "fused" and kernels["t_f1"]["load_factor"] is None
        for t in capacity:
            assert kernels[t]["compute_kernel"] == "fused_uvm_caching"
            assert kernels[t]["sharding_type"] == "table_wise"
            assert kernels[t]["cache_algorithm"] == algorithm.upper()
            assert kernels[t]["load_factor"] == lf[t]
            assert kernels[t]["prefetch_pipeline"] is prefetch


@pytest.fixture
def process_group() -> Iterator[None]:
    """A gloo group of one for the test, unless the process has a group already (kept then)."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def uvm_cli() -> Any:
    from benchmarks._common import build

    return build(TINY, ["--data.init_args.num_train_batches=12"])


def tiny_capacity() -> Dict[str, int]:
    from benchmarks._common import capacities

    return capacities(uvm_cli().datamodule, 0.3, 60)[0]


@pytest.mark.slow
def test_uvm_loop_runs_on_the_cpu_without_a_cache(process_group: None) -> None:
    # TorchRec puts FUSED_UVM_CACHING tables on the host, uncached, on the CPU: the code path, no figures
    capacity = tiny_capacity()
    for algorithm in ("lru", "lfu"):
        res = _uvm.uvm_run(uvm_cli(), capacity, algorithm, steps=3, warmup=1, device=torch.device("cpu"))
        assert len(res["times"]) == 3 and res["step_ms"] > 0
        assert res["pipeline"] == "TrainPipelineSparseDist" and res["prefetch_ahead"] is False
        assert res["fbgemm_cache_slots"] == 0 and res["traffic"]["rows_h2d"] is None
        assert res["fbgemm_cache_slots_planned"] > 0
        assert res["uvm_cache_stats_on"]  # the sharder's fused params reached FBGEMM's TBEs


def fake_tbe(stats: Any = None, misses: Any = None, occupied: int = 0, slots: int = 64) -> Any:
    """What :func:`benchmarks._uvm_traffic.cache_snapshot` reads of a CUDA TBE with a cache."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import RecordCacheMetrics

    state = torch.full((slots // 32, 32), -1, dtype=torch.int64)
    state.view(-1)[:occupied] = 7
    return SimpleNamespace(
        lxu_cache_weights=torch.zeros(slots, 16),
        lxu_cache_state=state,
        gather_uvm_cache_stats=stats is not None,
        get_uvm_cache_stats=lambda: torch.tensor(stats if stats is not None else [0]),
        record_cache_metrics=RecordCacheMetrics(False, False),
        cache_miss_counter=torch.tensor([0, misses or 0]),
    )


def test_cache_snapshot_reads_lru_statistics_and_lfu_miss_counter() -> None:
    lru = fake_tbe(stats=[3, 900, 400, 120, 5, 9], occupied=40)
    snap = _uvm.cache_snapshot([lru, fake_tbe(stats=[3, 100, 50, 10, 0, 0], occupied=8)])
    assert snap["source"] == "uvm_cache_stats" and snap["slots"] == 128 and snap["occupied_slots"] == 48
    assert (snap["unique_misses"], snap["conflict_unique_misses"], snap["unique_indices"]) == (130, 5, 450)
    assert (snap["requested_indices"], snap["prefetches"]) == (1000, 6)
    lfu = fake_tbe(stats=[0, 0, 0, 0, 0, 7], misses=77, occupied=64)
    _uvm.count_misses([lfu])  # LFU's fill counts no misses: FBGEMM's unique-miss counter instead
    assert lfu.record_cache_metrics.record_cache_miss_counter
    snap = _uvm.cache_snapshot([lfu])
    assert snap["source"] == "cache_miss_counter" and snap["unique_misses"] == 77
    assert snap["unique_indices"] is None and snap["occupied_slots"] == 64
    # an FBGEMM without the statistics: counted as unavailable, not as zero
    bare = _uvm.cache_snapshot([fake_tbe(occupied=3)])
    assert bare["unique_misses"] is None and bare["source"] is None and bare["occupied_slots"] == 3


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")
def test_uvm_anchor_pipeline_on_the_device(process_group: None, record_property: Any) -> None:
    capacity = tiny_capacity()
    distinct = _uvm.distinct_rows(uvm_cli().datamodule, sorted(capacity), 12)[3:]  # the timed batches
    for algorithm in ("lru", "lfu"):
        res = _uvm.uvm_run(uvm_cli(), capacity, algorithm, steps=6, warmup=2, device=DEVICE)
        assert len(res["times"]) == 6 and res["step_ms"] > 0
        if DEVICE.type != "cuda":  # TRL_TEST_DEVICE=cpu: the code path only
            continue
        traffic = res["traffic"]
        figures = _uvm.per_step([traffic], sum(distinct) / len(distinct), None)
        for key in ("fbgemm_cache_slots", "fbgemm_cache_slots_planned", "stats_source"):
            record_property(f"{algorithm}_{key}", res[key])
        for key in ("rows_h2d", "rows_d2h", "unique_indices", "conflict_unique_misses"):
            record_property(f"{algorithm}_{key}", traffic[key])
        expected = "PrefetchTrainPipelineSparseDist" if algorithm == "lru" else "TrainPipelineSparseDist"
        assert res["pipeline"] == expected and res["prefetch_ahead"] is (algorithm == "lru")
        assert abs(res["fbgemm_cache_slots"] - res["fbgemm_cache_slots_planned"]) <= _uvm.ASSOC
        assert res["hbm_cache_bytes"] == res["fbgemm_cache_slots"] * traffic["row_bytes"]
        assert traffic["rows_h2d"] is not None and traffic["rows_h2d"] > 0
        assert traffic["rows_d2h"] is not None and 0 <= traffic["rows_d2h"] <= traffic["rows_h2d"]
        assert figures["hit_rate"] is not None and 0.0 <= figures["hit_rate"] <= 1.0
        if algorithm == "lru":  # FBGEMM's own count of the distinct rows looked up
            assert traffic["unique_indices"] >= traffic["rows_h2d"]
