"""Every benchmark script starts and reports consistent figures: each runs its smallest path (tiny tables, a few
steps) in its own interpreter, as from the command line, with ``--json`` to a temporary file, and the test checks
the JSON's keys and the relations between its figures (ratios that are quotients of reported times, counts that
must add up, bounds every cache obeys). Speed is not asserted.

The scripts run two at a time (one per core) from a module fixture that starts the selected ones at the first
test, so the whole set costs about the time of its slowest half; each has its own timeout. A script that is not
smoke-tested here must be run by another test of this folder (``test_every_benchmark_is_run_by_a_test``)."""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import pytest

from ..cli.test_cli import clean_env
from ..conftest import REPO

TINY = "configs/dlrm_tiny.yaml"
TINY_LOOKAHEAD = "configs/dlrm_tiny_lookahead.yaml"  # three tables cached, batch 64, 12 batches


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def positive(x: Any) -> bool:
    return finite(x) and x > 0


def close(a: float, b: float, rel: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


# --- checks, one per script: the JSON it wrote -----------------------------------------------------------------


def check_baseline(f: Dict[str, Any]) -> None:
    assert f["runs"] == 1 and f["steps_per_run"] == 3 and f["config"] == TINY
    assert positive(f["step_ms"]) and positive(f["samples_per_s"])
    # one run: its samples/s is its batch (64) over its median step
    assert close(f["samples_per_s"] * f["step_ms"] / 1e3, 64)


def check_cache_overhead(f: Dict[str, Any]) -> None:
    assert f["pairs"] == 1 and f["steps_per_run"] == 3 and f["batch_size"] == 64
    for k in ("resident", "resident_background_loading", "cached"):
        assert positive(f[f"{k}_step_ms"]) and positive(f[f"{k}_train_thread_cpu_ms"])
        assert finite(f[f"{k}_other_threads_cpu_ms"]) and f[f"{k}_other_threads_cpu_ms"] >= 0
        runq = f[f"{k}_train_thread_runq_ms"]  # Linux reports it
        assert (runq is None) is (not sys.platform.startswith("linux")) and (runq is None or runq >= 0)
    assert close(f["step_time_ratio"], f["cached_step_ms"] / f["resident_step_ms"])
    assert close(
        f["step_time_ratio_background_loading"],
        f["cached_step_ms"] / f["resident_background_loading_step_ms"],
    )
    assert len(f["pair_ratios"]) == len(f["pair_ratios_background_loading"]) == 1
    assert all(positive(x) for x in f["pair_ratios"] + f["pair_ratios_background_loading"])
    assert close(f["cached_samples_per_s"] * f["cached_step_ms"] / 1e3, 64)
    for k in (
        "cached_batch_wait_ms_per_step",
        "resident_background_loading_batch_wait_ms_per_step",
        "reader_cpu_ms_per_batch",
        "planner_cpu_ms_per_batch",
        "stager_cpu_ms_per_batch",
    ):
        assert finite(f[k]) and f[k] >= 0
    assert positive(f["cached_training_thread_ms"])
    k = f["kaggle"]  # the default job's config at Kaggle sizes x 0.01 here, timed once the caches are full
    assert k["warmup_steps"] == 20 and k["steps"] == 3 and k["occupancy_at_warmup_end"] == 1.0
    assert positive(k["training_thread_ms"]) and positive(k["cached_step_ms"])
    assert k["rows_written_back_per_step"] > 0  # every timed step evicts
    r = k["replay"]
    assert r["steps"] == 3 and r["occupancy"] == 1.0 and 0 < r["apply_min_ms"] <= r["apply_median_ms"]
    # the cached tables (more than 100 rows) at half their rows, unless the oracle's minimum raised them
    cap, rows = f["capacity"], f["cached_table_rows"]
    assert set(cap) == set(rows) == {t for t, n in tiny_rows().items() if n > 100}
    assert all(0 < cap[t] <= rows[t] for t in cap)
    assert all(f["bumped_from"][t] < cap[t] for t in f["bumped_from"])
    c = f["last_cached_run_counters"]
    assert c["steps"] > 0 and 0 <= c["hits"] <= c["lookups"] and 0 < c["rows_fetched"] <= c["lookups"]


def check_cache_traffic(f: Dict[str, Any]) -> None:
    d = f["datasets"]["synthetic criteo-shaped"]
    assert list(f["datasets"]) == ["synthetic criteo-shaped"]  # --no-real
    assert d["steps"] == 12 and d["tables"] == 26 and d["rows"] == f["synthetic"]["rows"]
    r = d["results"]
    none, floor = r["none"]["fetch_per_step"], r["compulsory"]["fetch_per_step"]
    assert 0 < floor <= none
    caps = []
    for frac in ("1pct", "5pct", "10pct"):
        res = r[frac]
        caps.append(res["capacity_rows"])
        assert 0 <= res["bumped_partial_tables"] <= res["bumped_tables"] <= d["tables"]
        for policy in ("belady", "lru", "window"):
            x = res[policy]
            assert "error" not in x, (frac, policy, x)
            # every cache fetches each distinct row once, and at most the distinct ids of every batch
            assert floor - 1e-9 <= x["fetch_per_step"] <= none + 1e-9, (frac, policy, x)
            assert 0 <= x["writeback_per_step"] <= x["fetch_per_step"] + 1e-9
    assert caps == sorted(caps)
    assert (
        floor <= r["ttl"]["fetch_per_step"] <= none
        and 0 < r["ttl"]["peak_rows"] <= r["compulsory"]["peak_rows"]
    )
    assert sorted(int(h) for h in f["ttl_vs_horizon"]) == [5, 10]  # the horizons below the 12 steps
    s5 = r["5pct"]
    assert close(f["belady_over_lru_5pct"], s5["belady"]["fetch_per_step"] / s5["lru"]["fetch_per_step"])
    assert finite(f["belady_over_lru_5pct_above_compulsory"])


def check_oracle_throughput(f: Dict[str, Any]) -> None:
    assert f["steps"] == 12 and f["batch"] == 512 and f["horizon"] == 8 and f["tables"] == 26
    assert f["plan_threads"] == 2
    threaded = {f"{p}, 2 threads" for p in ("belady", "ttl", "lru")}
    untimed = {"belady, no num_embeddings", "belady, pooled", "belady, pooled, 2 threads"}  # wall clock only
    assert set(f["policies"]) == {"belady", "ttl", "lru"} | untimed | threaded
    samples = f["steps"] * f["batch"]
    for name, p in f["policies"].items():
        assert positive(p["seconds"]) and close(p["samples_per_s"], samples / p["seconds"])
        assert name in untimed or positive(p["cpu_ms_per_batch"])
    assert f["samples_per_s"] == f["policies"]["belady"]["samples_per_s"]
    assert positive(f["floor_samples_per_s"]) and positive(f["unsized_over_sized"])
    assert positive(f["pooled_over_per_table"])
    assert f["pooled_samples_per_s"] == f["policies"]["belady, pooled, 2 threads"]["samples_per_s"]
    assert 0 < f["ttl_peak_rows_60_steps"] <= f["rows"]


def check_sync_volume(f: Dict[str, Any]) -> None:
    assert f["config"]["steps"] == 3 and f["config"]["global_batch"] == 512
    assert set(f["rows_per_step"]) == {"2", "4"}
    for w, m in f["rows_per_step"].items():
        # every touched row is shared (LRPP) or read by one rank (skipped); shared rows are critical or delayed
        assert close(m["replicated"], m["lrpp"] + m["skipped"]), m
        assert close(m["lrpp"], m["critical"] + m["delayed"]), m
        assert 0 < m["critical"] <= m["lrpp"] < m["replicated"], m
        assert close(f["lrpp_over_replicated"][w], m["lrpp"] / m["replicated"])
        assert close(f["critical_over_replicated"][w], m["critical"] / m["replicated"])
        # a row read by two ranks occurs twice in the global batch
        assert m["lrpp"] <= f["non_singleton_per_step"] + 1e-9
    assert f["lrpp_over_replicated"]["2"] <= f["lrpp_over_replicated"]["4"]  # more ranks share more rows
    assert 0 < f["non_singleton_over_replicated"] < 1
    # --gloo: the three all_reduce buffers, the LRPP ones no larger than the replicated one
    g = f["gloo_rows"]
    assert g["critical"] <= g["lrpp"] <= g["replicated"] and close(g["lrpp"], f["rows_per_step"]["2"]["lrpp"])
    assert all(positive(f[f"gloo_ms_{k}"]) for k in ("replicated", "lrpp", "critical"))


def check_sharded_store(f: Dict[str, Any]) -> None:
    assert f["rows"] == 20_000 and f["batch"] == 1024
    for op in ("gather", "scatter"):
        local, sharded = f[f"local_{op}_rows_per_s"], f[f"sharded_{op}_rows_per_s"]
        assert positive(local) and positive(sharded)
        assert close(f[f"{op}_slowdown"], local / sharded)


def check_exact_sync(f: Dict[str, Any]) -> None:
    assert f["config"]["global_batch"] == 256 and f["config"]["steps"] == 2
    (w,) = f["results"]
    s = f["results"][w]
    assert w == "2" and s["world"] == 2 and s["local_batch"] == 128 and s["timed_steps"] == 2
    c = s["check"]
    assert c["exact_on_vs_off_max_abs"] == 0.0  # delayed synchronisation changes nothing, bit for bit
    assert 0 <= c["partial_vs_exact_max_abs"] < 1e-4 and len(c["rows_updated_exact"]) == 2
    assert finite(c["partial_torch_vs_exact_max_abs"]) and c["partial_torch_vs_exact_max_abs"] >= 0
    assert all(n > 0 for n in c["rows_updated_exact"]), c  # each checked step updates rows
    ms, m = s["ms"], s["mean"]
    assert all(positive(v) for v in ms.values()), ms
    assert close(s["ratio_exact_off_over_partial"], ms["exact_off"] / ms["partial"])
    assert close(s["ratio_exact_on_over_partial"], ms["exact_on"] / ms["partial"])
    assert close(s["ratio_cpu_exact_off_over_partial"], ms["exact_off_cpu"] / ms["partial_cpu"])
    assert positive(s["ratio_per_step_median"])
    assert close(m["payload_off"], m["payload_critical"] + m["payload_delayed"])
    assert 0 < m["rows_delayed"] <= m["rows_shared"]
    assert close(s["wire_ratio_exact_off_over_partial"], m["wire_exact_off"] / m["wire_partial"])


def check_memory(f: Dict[str, Any]) -> None:
    for key, job in (
        ("cache_bytes_over_budget", "default_job"),
        ("planner_cache_bytes_over_budget", "planner"),
    ):
        # the device bytes fit the budget they were sized for (the documented contract)
        assert 0 < f[key] <= 1.0, (key, f[key])
        r = f[job]
        assert close(r["device_bytes"], r["device_cache_bytes"] + r["device_resident_bytes"])
        assert r["cache_rows"] > 0 and r["store_bytes"] > 0 and r["rss_peak"] >= r["rss_after"] > 0
    r = f["default_job"]
    assert close(f["cache_bytes_over_budget"], r["device_bytes"] / r["nominal_bytes"])
    assert r["cache_rows"] == 140 + 120 + 110  # configs/dlrm_tiny_lookahead.yaml's capacities
    assert close(f["host_rss_over_store_bytes"], (r["rss_after"] - r["rss_before"]) / r["store_bytes"])
    p = f["planner"]
    assert close(f["planner_cache_bytes_over_budget"], p["device_bytes"] / p["budget"])
    assert 0 < p["planned_device_bytes"] <= p["budget"]


def _check_scale_run(f: Dict[str, Any], store: str) -> None:
    assert f["steps"] == 3 and f["warmup"] == 1 and f["batch_size"] == 256
    cap = f["capacity"]
    assert f["cached_tables"] == len(cap) > 0 and f["cache_rows"] == sum(cap.values())
    assert 0 < f["cache_rows"] <= f["cached_rows"] <= f["rows"]
    assert all(f["bumped"][t] < cap[t] for t in f["bumped"])
    assert f["store_type"] == store and positive(f["store_gib"])
    assert close(f["samples_per_s"] * f["step_ms"] / 1e3, f["batch_size"])
    assert len(f["first_steps_s"]) == f["warmup"] and all(positive(x) for x in f["first_steps_s"])
    assert f["peak_rss_gib"] >= f["rss_gib"] > 0 and positive(f["setup_s"]) and positive(f["fit_s"])
    # the disk tier computes the rows a step fetches for the first time (never written) and reads the rows written
    # back and fetched again; in RAM neither
    assert (f["rows_computed_per_step"] > 0) == (store == "DiskStore")
    for key in ("rows_read_from_disk_per_step", "rows_written_to_disk_per_step"):
        assert f[key] >= 0 and (store == "DiskStore" or f[key] == 0), key


def check_scale(f: Dict[str, Any]) -> None:
    """The Terabyte-shaped tables (scaled down) on disk stores, then the Kaggle-shaped job in RAM."""
    tb, kg = f["terabyte"], f["kaggle_ram"]
    _check_scale_run(tb, "DiskStore")
    _check_scale_run(kg, "TensorStore")
    assert tb["rows"] > kg["rows"]  # Terabyte's tables are larger than Kaggle's at any one scale
    assert close(f["terabyte_over_kaggle_ram_samples_per_s"], tb["samples_per_s"] / kg["samples_per_s"])
    assert f["samples_per_s"] == tb["samples_per_s"] and f["host_budget_gib"] == 0.002


RUNS = ("sync", "flat_easgd", "flat_mean", "ht_2x2", "ht_2x2_mean", "ht_2x2_split")


def check_hierarchical(f: Dict[str, Any]) -> None:
    assert f["steps"] == 7 and f["batch_per_rank"] == 32 and f["seeds"] == [0]
    q = f["quality"]
    assert set(q) == set(RUNS) and all(len(v) == 1 for v in q.values())
    for (run,) in q.values():
        assert 0 <= run["val_auc"] <= 1 and positive(run["val_logloss"]) and positive(run["examples_per_s"])
    assert close(f["ht_over_sync_val_logloss"], q["ht_2x2"][0]["val_logloss"] / q["sync"][0]["val_logloss"])
    assert close(
        f["ht_over_flat_val_logloss"], q["ht_2x2"][0]["val_logloss"] / q["flat_easgd"][0]["val_logloss"]
    )
    assert f["ht_over_sync_val_logloss_per_seed"] == [f["ht_over_sync_val_logloss"]]
    for key in ("model", "wide"):
        rows = f[f"traffic_{key}"]
        assert rows[0]["variant"] == "sync data parallel" and rows[0]["over_sync"] == 1.0
        assert all(close(r["over_sync"], r["critical_bytes"] / rows[0]["critical_bytes"]) for r in rows)
        # HT's in-group traffic is below the all-reduce over every rank, and compression only lowers it
        assert (
            0
            < f[f"ht_over_sync_critical_bytes_{key}"]
            <= f[f"ht_uncompressed_over_sync_critical_bytes_{key}"]
            < 1
        )


def check_cdlrm_gap(f: Dict[str, Any]) -> None:
    assert f["ranks"] == 2 and f["global_batch"] == 64 and f["max_steps"] == -1
    assert [(r["mode"], r["lambda"], r["steps"]) for r in f["runs"]] == [("exact", 2, 12), ("cdlrm", 2, 12)]
    for mode in ("exact", "cdlrm"):
        assert 0 <= f[f"val_auc_{mode}"]["2"] <= 1 and positive(f[f"val_logloss_{mode}"]["2"])
        assert positive(f[f"step_ms_{mode}"]["2"]) and positive(f[f"sync_rows_per_step_{mode}"]["2"])
    assert close(f["val_auc_gap"]["2"], f["val_auc_cdlrm"]["2"] - f["val_auc_exact"]["2"])
    assert close(f["val_logloss_gap"]["2"], f["val_logloss_cdlrm"]["2"] - f["val_logloss_exact"]["2"])
    assert 0 <= f["train_loss_gap_mean"]["2"] <= f["train_loss_gap_max"]["2"]
    assert f["exact_runs_max_loss_diff"] == 0.0  # one lambda: nothing to compare
    exact, cdlrm = f["runs"]
    assert exact["train_loss"][0] == cdlrm["train_loss"][0]  # the same model, seed and first batch


def tiny_rows() -> Dict[str, int]:
    import yaml

    cfg = yaml.safe_load((REPO / TINY).read_text())
    return {f"t_cat_{i}": n for i, n in enumerate(cfg["data"]["init_args"]["num_embeddings"])}


def check_disk_tier(f: Dict[str, Any]) -> None:
    runs = {r["run"]: r for r in f["runs"]}
    disk = ("disk_25", "disk_10", "disk_25_lookahead", "disk_10_lookahead")
    # the ram and LRU disk runs alternate in rounds; the rest run once
    later = {f"{k}_r{n}" for k in ("ram", "disk_25", "disk_10") for n in range(1, f["rounds"])}
    assert set(runs) == {"ram", "mmap", *disk, *later} and f["steps"] == 2 and f["rounds"] == 2
    batch = {round(r["samples_per_s"] * r["step_ms"] / 1e3) for r in runs.values()}
    assert len(batch) == 1 and batch.pop() > 0  # every run trains the same batches

    def speed(name: str, n: int) -> float:
        return runs[name if n == 0 else f"{name}_r{n}"]["samples_per_s"]

    ram = statistics.median(speed("ram", n) for n in range(2))
    assert close(f["ram_samples_per_s"], ram)
    for key, name in (("disk", "disk_25"), ("disk10", "disk_10")):  # per round: over that round's ram run
        per_round = [speed(name, n) / speed("ram", n) for n in range(2)]
        assert all(close(a, b) for a, b in zip(f[f"{key}_over_ram_rounds"], per_round, strict=True))
        assert close(f[f"{key}_over_ram_samples_per_s"], statistics.median(per_round))
    assert close(f["mmap_over_ram_samples_per_s"], runs["mmap"]["samples_per_s"] / ram)
    for pct in (25, 10):  # the percentage of the table bytes, raised for tables below one host window
        r = runs[f"disk_{pct}"]
        share = pct / 100 * f["cached_store_bytes"]
        assert r["host_budget_mib"] * 2**20 >= share * 0.99, r
        if not r["host_budget_raised"]:
            assert close(r["host_budget_mib"] * 2**20, share, rel=0.01), r
    for name in disk:
        r = runs[name]
        # the first fetch of a row computes it (never written); rows written back are read when fetched again
        assert positive(r["initialised_per_step"]), r
        assert r["rows_read_per_step"] >= 0 and r["units_read_per_step"] >= 0, r
        assert finite(r["host_hits_per_step"]) and r["host_hits_per_step"] >= 0, r
        # every row read is a first read or a re-read
        assert close(r["first_reads_per_step"] + r["rereads_per_step"], r["rows_read_per_step"]), r
        assert r["rereads_per_step"] >= 0 and finite(r["late_rows_read_per_step"]), r
        assert 0 <= r["late_rereads_per_step"] <= r["late_rows_read_per_step"] + 1e-9, r
        # a prefetch's rows are read from disk (counted in rows_read), then kept or discarded
        kept, dropped = r["rows_prefetched_per_step"], r["prefetch_discarded_per_step"]
        assert 0 <= kept and 0 <= dropped and kept + dropped <= r["rows_read_per_step"] + 1e-9, r
        if not name.endswith("_lookahead"):  # the LRU host policy reads only what a gather misses
            assert kept == dropped == 0, r
    for name in ("ram", "mmap"):  # no disk store: no disk figures
        r = runs[name]
        assert r["host_budget_mib"] is None and r["host_hits_per_step"] is None, r
    assert all(positive(r["peak_rss_gib"]) for r in runs.values())
    for pct in ("25", "10"):  # the two host policies at the same memory, and their ratio
        lru, ahead = runs[f"disk_{pct}"], runs[f"disk_{pct}_lookahead"]
        assert lru["host_budget_mib"] == ahead["host_budget_mib"]
        assert f["rows_read_per_step"]["lru"][pct] == lru["rows_read_per_step"]
        assert f["rows_read_per_step"]["lookahead"][pct] == ahead["rows_read_per_step"]
        assert close(
            f["lookahead_over_lru_rows_read"][pct],
            ahead["rows_read_per_step"] / max(lru["rows_read_per_step"], 1e-9),
        )
    for key in ("rereads", "late_rows_read", "late_rereads"):
        fig, ratio = f[f"{key}_per_step"], f[f"lookahead_over_lru_{key}"] if key == "rereads" else None
        for pct in ("25", "10"):
            assert fig["lru"][pct] == runs[f"disk_{pct}"][f"{key}_per_step"]
            assert fig["lookahead"][pct] == runs[f"disk_{pct}_lookahead"][f"{key}_per_step"]
            if ratio is not None:
                assert close(ratio[pct], fig["lookahead"][pct] / max(fig["lru"][pct], 1e-9))
    assert runs["ram"]["rows_read_per_step"] is None and runs["mmap"]["rows_read_per_step"] is None
    assert positive(f["random_reads_per_s"]["1_in_flight"]) and positive(
        f["random_reads_per_s"]["8_in_flight"]
    )


def check_checkpoint(f: Dict[str, Any]) -> None:
    assert f["checkpoints"] == 3 and f["interval"] == 10
    for kind in ("ram", "disk"):
        run = f["runs"][kind]
        assert close(f["incremental_bytes_over_full"][kind], run["incremental_bytes"] / run["full_bytes"])
        assert close(f["stall_s_over_full"][kind], run["incremental_stall_s"] / run["full_s"])
        assert close(f["sync_stall_s_over_full"][kind], run["incremental_s"] / run["full_s"])
        assert run["incremental_stall_s"] <= run["incremental_s"]
        assert f["full_stall_s"][kind] == run["full_stall_s"] <= run["full_s"]  # a full one taken behind
        assert 0 < f["incremental_bytes_over_full"][kind] < 0.2  # --quick: a full one holds >= 10x the rows
        assert f["full_rows_over_written_rows"][kind] >= 10
        # the rows written back and their ids, a page of header: the bytes do not depend on the machine
        assert 1.0 < f["incremental_bytes_over_written"][kind] <= 1.5
        assert positive(run["incremental_s"]) and positive(run["full_s"]) and len(run["checkpoints"]) == 3


@dataclass
class Smoke:
    args: List[str]
    check: Callable[[Dict[str, Any]], None]
    timeout: int = 240  # seconds; on a busy 2-core machine a run takes up to three times its CPU time


#: script -> its smallest path. Ordered by cost (the slowest first), so that two at a time finish together.
SMOKE: Dict[str, Smoke] = {
    "hierarchical": Smoke(["--quick", "--steps", "7", "--batch", "32", "--seeds", "0"], check_hierarchical),
    "cdlrm_gap": Smoke(
        ["--config", TINY_LOOKAHEAD, "--lambdas", "2", "--max-steps", "-1", "--capacity-scale", "1"],
        check_cdlrm_gap,
    ),
    "exact_sync": Smoke(["--quick", "--steps", "2", "--warmup", "1", "--batch", "256"], check_exact_sync),
    "cache_overhead": Smoke(
        ["--quick", "--config", TINY, "--min-cached-rows", "100", "--fraction", "0.5"]
        + ["--pairs", "1", "--steps", "3", "--warmup", "1"]
        + ["--kaggle-steps", "3", "--kaggle-warmup", "20", "--kaggle-scale", "0.01"],
        check_cache_overhead,
    ),
    "scale": Smoke(
        ["--quick", "--scale", "0.0005", "--steps", "3", "--warmup", "1", "--batch-size", "256"]
        + ["--min-cached-rows", "1000", "--terabyte", "--store", "disk", "--embedding-dim", "8"]
        + ["--host-budget-gib", "0.002"],
        check_scale,
    ),
    "disk_tier": Smoke(
        ["--scale", "0.001", "--steps", "2", "--warmup", "1", "--rounds", "2"], check_disk_tier
    ),
    "memory": Smoke(
        ["--quick", "--config", TINY_LOOKAHEAD, "--steps", "3", "--budget-frac", "0.6"], check_memory
    ),
    "baseline": Smoke(["--quick", "--config", TINY, "--runs", "1", "--steps", "3"], check_baseline),
    "checkpoint": Smoke(["--quick"], check_checkpoint),
    "sharded_store": Smoke(
        ["--quick", "--rows", "20000", "--batch", "1024", "--trials", "2"], check_sharded_store
    ),
    "sync_volume": Smoke(
        ["--quick", "--gloo", "--gap-ms", "1", "--scale", "0.01", "--batch", "512", "--steps", "3"]
        + ["--warmup", "1", "--ranks", "2", "4"],
        check_sync_volume,
    ),
    "oracle_throughput": Smoke(
        [
            "--quick",
            "--scale",
            "0.001",
            "--batch",
            "512",
            "--steps",
            "12",
            "--horizon",
            "8",
            "--plan-threads",
            "2",
        ],
        check_oracle_throughput,
    ),
    "cache_traffic": Smoke(
        ["--quick", "--no-real", "--scale", "0.001", "--batch", "256", "--steps", "12", "--horizon", "8"],
        check_cache_traffic,
    ),
}

#: scripts run two at a time: each is mostly one busy thread
WORKERS = 2


def _run(name: str, out: Path) -> Dict[str, Any]:
    smoke = SMOKE[name]
    path = out / f"{name}.json"
    env = {**clean_env(), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}  # one core each
    try:
        done = subprocess.run(
            [sys.executable, f"benchmarks/{name}.py", *smoke.args, "--json", str(path)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=smoke.timeout,
            env=env,
        )
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-3000:] if isinstance(e.stderr, bytes) else (e.stderr or "")[-3000:]
        return {"error": f"no result within {smoke.timeout} s: {tail!r}"}
    if done.returncode != 0:
        return {"error": f"exit status {done.returncode}\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}"}
    return {"figures": json.loads(path.read_text())}


@pytest.fixture(scope="module")
def smoke_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict]:
    """The selected scripts' runs, started together (``WORKERS`` at a time) at the first test that asks."""
    selected = {
        item.callspec.params["name"]
        for item in request.session.items
        # the session's items include doctests, which have no module attribute
        if getattr(item, "module", None) is request.module
        and hasattr(item, "callspec")
        and "name" in item.callspec.params
    }
    out = tmp_path_factory.mktemp("smoke")
    pool = ThreadPoolExecutor(max_workers=WORKERS)
    runs: Dict[str, Future] = {n: pool.submit(_run, n, out) for n in SMOKE if n in selected}
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SMOKE))
def test_benchmark_smoke(name: str, smoke_runs: Dict[str, Future]) -> None:
    result = smoke_runs[name].result()
    assert "error" not in result, f"benchmarks/{name}.py: {result.get('error')}"
    figures = result["figures"]
    assert figures.get("machine"), "the JSON names the machine it was measured on"
    SMOKE[name].check(figures)


def test_every_benchmark_is_run_by_a_test() -> None:
    scripts = {p.stem for p in (REPO / "benchmarks").glob("*.py") if not p.stem.startswith("_")}
    here = Path(__file__).resolve()
    others = "\n".join(p.read_text() for p in here.parent.glob("test_*.py") if p != here)
    elsewhere = {
        s
        for s in scripts
        if re.search(rf"benchmarks(/|\.| import ){s}\b|from benchmarks import .*\b{s}\b", others)
    }
    missing = sorted(scripts - set(SMOKE) - elsewhere)
    assert not missing, f"benchmark scripts that no test runs: {missing} (add a smoke path to SMOKE)"
    assert set(SMOKE) <= scripts, f"SMOKE names scripts that do not exist: {sorted(set(SMOKE) - scripts)}"


def test_smoke_checks_fail_on_inconsistent_figures() -> None:
    # the checks catch a ratio that is not the quotient of the figures it is computed from
    good = {"runs": 1, "steps_per_run": 3, "config": TINY, "step_ms": 100.0, "samples_per_s": 640.0}
    check_baseline(good)
    with pytest.raises(AssertionError):
        check_baseline({**good, "samples_per_s": 650.0})
    with pytest.raises(AssertionError):
        check_baseline({**good, "step_ms": float("nan")})
