"""Device bytes of the cached job against its budget, and host RSS against the bytes of the host stores.

Device side: after training, the bytes actually allocated for the embedding part of the model are summed
from the live tensors (the storages behind every cached table's cache rows and optimizer state, and every
buffer and parameter of TorchRec's resident tables, each storage once) and compared with

* the budget the tables were sized for. ``configs/dlrm_lookahead.yaml`` (the cached default job) gives its
  capacities by hand, so its budget is what those capacities ask for: cache rows x (dim + optimizer state
  widths) x 4 bytes summed, plus the resident tables' rows x the same row bytes (JSON
  ``cache_bytes_over_budget``, must be <= 1.00);
* a budget handed to the lookahead planner (``LookaheadPlanner(device_budget_bytes=...)``, ``--budget-frac``
  of the all-resident bytes, default 10 %), which chooses resident tables and capacities on sampled batches;
  the same job is trained with its plan (JSON ``planner_cache_bytes_over_budget``).

Host side: VmRSS from ``/proc/self/status`` before and after the cached fit, and the peak (VmHWM), against
the stores' bytes (``nbytes``; JSON ``host_rss_over_store_bytes`` = RSS growth during the fit / store bytes).
``--scale`` repeats the host measurement with larger tables (in a fresh process: ``--scale 0.1``).

    python benchmarks/memory.py [--quick] [--json PATH] [--budget-frac 0.1] [--scale S]
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import (  # noqa: E402
    REPO,
    build,
    capacities,
    clean_env,
    machine,
    parser,
    proc_status,
    quiet,
    table,
    table_rows,
    train,
    write_json,
)
from torchrec_lookahead.strategies import TorchRecStrategy  # noqa: E402

LOOKAHEAD = os.path.join(REPO, "configs", "dlrm_lookahead.yaml")
MIB = float(1 << 20)


def config_capacity(config: str) -> Dict[str, int]:
    """The cache capacities a config's lookahead sharder names."""
    import yaml

    with open(config) as f:
        cfg = yaml.safe_load(f)
    for sharder in cfg["trainer"]["strategy"]["init_args"]["sharders"]:
        if sharder["class_path"].endswith("LookaheadEmbeddingBagCollectionSharder"):
            return {k: int(v) for k, v in sharder["init_args"]["capacity"].items()}
    raise ValueError(f"{config} has no LookaheadEmbeddingBagCollectionSharder")


def row_bytes(dim: int, optimizer: Any) -> int:
    return 4 * (dim + sum(optimizer.state_widths(dim).values()))


def device_bytes(strategy: TorchRecStrategy) -> Dict[str, int]:
    """Bytes of the storages behind the embedding tables on the device, cached and resident, each once:
    the cache rows and their optimizer state, TorchRec's resident table weights and their fused optimizer
    state."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    seen: Dict[int, int] = {}
    out = {"cached": 0, "resident": 0}

    def add(kind: str, t: Any) -> None:
        if isinstance(t, ShardedTensor):
            for shard in t.local_shards():
                add(kind, shard.tensor)
            return
        if not isinstance(t, torch.Tensor):
            return
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen[st.data_ptr()] = st.nbytes()
            out[kind] += st.nbytes()

    def add_resident(module: Any) -> None:
        for _, t in [*module.named_parameters(), *module.named_buffers()]:
            add("resident", t)
        fused = getattr(module, "fused_optimizer", None)
        if fused is not None:
            for state in fused.state.values():
                for v in state.values():
                    add("resident", v)

    dmp = strategy.dmp
    assert dmp is not None
    mods = strategy.cached_modules()
    for m in mods:
        for name in m.cache.capacity:
            add("cached", m.cache.cache_weights(name))
            for v in m.cache.cache_states(name).values():
                add("cached", v)
        if m.resident is not None:
            add_resident(m.resident)
    if not mods:  # all resident: the whole sparse arch
        for mod in dmp.modules():
            if type(mod).__name__ == "ShardedEmbeddingBagCollection":
                add_resident(mod)
    return out


def measure(
    config: str, capacity: Optional[Dict[str, int]], steps: int, overrides: List[str]
) -> Dict[str, Any]:
    """Train ``config``'s model cached with ``capacity`` and measure device bytes, stores and RSS."""
    cli = build(config, overrides)
    rss0 = proc_status("VmRSS")
    res = train(cli, capacity, steps, warmup=2)
    rss1 = proc_status("VmRSS")
    strategy = res["strategy"]
    mods = strategy.cached_modules()
    stores = {n: s for m in mods for n, s in m.cache.stores.items()}
    opt = mods[0].cache.optimizer_config
    rows = table_rows(cli.datamodule.datamodule if hasattr(cli.datamodule, "datamodule") else cli.datamodule)
    dim = mods[0].cache.table_configs()[0].embedding_dim
    rb = row_bytes(dim, opt)
    cap = {n: c for m in mods for n, c in m.cache.capacity.items()}
    nominal_cache = sum(c * rb for c in cap.values())
    nominal_resident = sum(n * rb for t, n in rows.items() if t not in cap)
    dev = device_bytes(strategy)
    store_bytes = sum(int(s.nbytes) for s in stores.values())
    return {
        "row_bytes": rb,
        "capacity": cap,
        "cache_rows": sum(cap.values()),
        "cached_table_rows": sum(rows[t] for t in cap),
        "nominal_cache_bytes": nominal_cache,
        "nominal_resident_bytes": nominal_resident,
        "nominal_bytes": nominal_cache + nominal_resident,
        "device_cache_bytes": dev["cached"],
        "device_resident_bytes": dev["resident"],
        "device_bytes": dev["cached"] + dev["resident"],
        "all_resident_bytes": sum(rows.values()) * rb,
        "store_bytes": store_bytes,
        "rss_before": rss0,
        "rss_after": rss1,
        "rss_peak": proc_status("VmHWM"),
        "samples_per_s": res["samples_per_s"],
    }


def planner_capacity(config: str, budget: int, batches: int) -> Any:
    """The lookahead planner's plan of ``config``'s tables for ``budget`` bytes, on sampled batches."""
    from torchrec_lookahead.distributed.planner import LookaheadPlanner
    from torchrec_lookahead.modules import CacheOptimizerConfig

    cli = build(config)
    dm = cli.datamodule.datamodule if hasattr(cli.datamodule, "datamodule") else cli.datamodule
    dm.setup("fit")
    model = cli.model
    f2t = {f: f"t_{f}" for f in dm.num_embeddings_per_feature}
    planner = LookaheadPlanner(
        device_budget_bytes=budget, horizon=64, prefetch_depth=1, policy="belady", num_sample_batches=batches
    )
    return planner.plan(
        model.tables,
        CacheOptimizerConfig("exact_row_wise_adagrad"),
        dm.train_dataloader(),
        feature_to_table=f2t,
    )


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--config", default=LOOKAHEAD, help="a cached job (LookaheadEmbeddingBagCollectionSharder)"
    )
    p.add_argument("--budget-frac", type=float, default=0.10, help="planner budget / all-resident bytes")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--scale", type=float, default=None, help="only the host measurement, tables x scale")
    p.add_argument("--no-planner", action="store_true")
    args = p.parse_args()
    quiet()
    steps = args.steps or (20 if args.quick else 100)
    figures: Dict[str, Any] = {}
    if args.scale is not None:
        # host measurement at another scale: 5 % of every table above 5,000 rows (as cache_overhead.py)
        ov = [f"--data.init_args.datamodule.init_args.scale={args.scale}"]
        probe = build(args.config, ov)
        dm = probe.datamodule.datamodule
        cap, bumped = capacities(dm, 0.05, 5000, batches=steps + 100)
        del probe
        r = measure(args.config, cap, steps, ov)
        figures = {f"scale_{args.scale}": r}
        print(
            f"scale {args.scale}: stores {r['store_bytes'] / MIB:,.1f} MiB, RSS {r['rss_before'] / MIB:,.0f} -> "
            f"{r['rss_after'] / MIB:,.0f} MiB (peak {r['rss_peak'] / MIB:,.0f}); growth / store bytes = "
            f"{(r['rss_after'] - r['rss_before']) / r['store_bytes']:.3f}"
        )
        write_json(args.json, figures)
        return

    cap = config_capacity(args.config)
    r = measure(args.config, cap, steps, [])
    figures["cache_bytes_over_budget"] = r["device_bytes"] / r["nominal_bytes"]
    figures["host_rss_over_store_bytes"] = (r["rss_after"] - r["rss_before"]) / r["store_bytes"]
    figures["default_job"] = r
    rows_out = [
        {
            "job": os.path.relpath(args.config, REPO),
            "budget MiB": r["nominal_bytes"] / MIB,
            "device MiB": r["device_bytes"] / MIB,
            "cache MiB": r["device_cache_bytes"] / MIB,
            "resident MiB": r["device_resident_bytes"] / MIB,
            "device / budget": figures["cache_bytes_over_budget"],
            "cache rows": r["cache_rows"],
        }
    ]
    if not args.no_planner:
        try:
            budget = int(args.budget_frac * r["all_resident_bytes"])
            plan = planner_capacity(args.config, budget, 20 if args.quick else 50)
            print(plan)
            rp = measure(args.config, dict(plan.capacity), steps, [])
            figures["planner_cache_bytes_over_budget"] = rp["device_bytes"] / budget
            figures["planner"] = {**rp, "budget": budget, "planned_device_bytes": plan.device_bytes}
            rows_out.append(
                {
                    "job": f"planner, {100 * args.budget_frac:g} % budget",
                    "budget MiB": budget / MIB,
                    "device MiB": rp["device_bytes"] / MIB,
                    "cache MiB": rp["device_cache_bytes"] / MIB,
                    "resident MiB": rp["device_resident_bytes"] / MIB,
                    "device / budget": figures["planner_cache_bytes_over_budget"],
                    "cache rows": rp["cache_rows"],
                }
            )
        except ImportError as e:  # the planner is optional here
            print(f"skipping the planner-sized job: {e}")
    print()
    print(table(rows_out))
    print(
        f"\nhost: stores {r['store_bytes'] / MIB:,.1f} MiB; RSS before the cached fit {r['rss_before'] / MIB:,.0f} "
        f"MiB, after {r['rss_after'] / MIB:,.0f} MiB, peak {r['rss_peak'] / MIB:,.0f} MiB; RSS growth / store "
        f"bytes = {figures['host_rss_over_store_bytes']:.3f}  on {machine()['cpu']}"
    )
    if not args.quick:
        # the same host measurement at 10x the table sizes, in a fresh process
        out = subprocess.run(
            [sys.executable, __file__, "--scale", "0.1", "--steps", str(steps), "--json", "/dev/stdout"],
            capture_output=True,
            text=True,
            check=False,
            # a fresh process group: Lightning set MASTER_PORT etc. for this process's (still open) one
            env=clean_env(),
        )
        print(out.stdout.split("{", 1)[0].strip())
        try:
            import json

            figures["scale_0.1"] = json.loads("{" + out.stdout.split("{", 1)[1])["scale_0.1"]
        except (IndexError, ValueError, KeyError):
            print(out.stderr[-2000:])
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
