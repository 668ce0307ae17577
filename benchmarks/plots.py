"""The headline comparisons as figures, drawn from the benchmarks' JSON under ``benchmarks/results/``.

Inputs (each a benchmark's ``--json`` output, or, where the run needs a machine or an hour this repository does
not have, the documented figures of ``docs/benchmarks.md`` transcribed in the script's JSON shape with a
``source`` key saying where each number comes from):

* ``cache_traffic.json`` (``cache_traffic.py``): rows fetched per step against cache rows, belady / LRU /
  window at 1, 5 and 10 %, ttl at its peak rows, the compulsory floor and no cache;
* ``fae_cache.json`` (``fae.py --skip-calibration --train-batches 0``): rows fetched per sample of the
  lookahead-only cache, lookahead-only with FAE's device rows, and FAE (pinned hot rows) against device rows;
* ``step_time.json`` (``cache_overhead.py``, ``gpu.py``, ``fae.py``): cached / resident step time per job and
  machine, with each run's ratio;
* ``fae_hot_share.json`` (``fae.py``, ``fae.py --recalibrate``): the hot set's expected and measured share of
  accesses and samples;
* ``sync_volume.json`` (``sync_volume.py``): rows synchronised per step by W ranks, replicated vs LRPP.

Outputs: ``docs/img/<name>.png`` (100 dpi).

    python benchmarks/plots.py [--results DIR] [--out DIR]

It draws with matplotlib: ``pip install matplotlib``, or the project's set-up (``scripts/setup_env.sh``), which
installs it in ``.venv/plots``, beside the environment and off its path (see ``_import_matplotlib``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
OUT = REPO / "docs" / "img"
DPI = 100

POLICY_STYLE = {"belady": ("C0", "o"), "lru": ("C3", "s"), "window": ("C2", "^")}


def _load(results: Path, name: str) -> Dict[str, Any]:
    return json.loads((results / name).read_text())


def _finish(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def rows_fetched(results: Path, out: Path) -> Path:
    """Rows fetched against cache size per policy: the oracle's policies on the synthetic Kaggle-shaped stream,
    and FAE against the lookahead cache on the default job."""
    import matplotlib.pyplot as plt

    traffic = _load(results, "cache_traffic.json")
    fae = _load(results, "fae_cache.json")
    d = traffic["datasets"]["synthetic criteo-shaped"]
    r = d["results"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    fractions = [k for k in ("1pct", "5pct", "10pct") if k in r]
    for policy, (color, marker) in POLICY_STYLE.items():
        pts = [
            (r[f]["capacity_rows"], r[f][policy]["fetch_per_step"])
            for f in fractions
            if "error" not in r[f][policy]
        ]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, color=color, marker=marker, label=policy)
    ax.plot([r["ttl"]["peak_rows"]], [r["ttl"]["fetch_per_step"]], "kD", label="ttl (at its peak rows)")
    ax.axhline(r["none"]["fetch_per_step"], color="grey", ls=":", label="no cache")
    ax.axhline(r["compulsory"]["fetch_per_step"], color="grey", ls="--", label="compulsory (first touch)")
    for f in fractions:
        if "error" not in r[f]["belady"]:
            ax.annotate(f.replace("pct", " %"), (r[f]["capacity_rows"], r[f]["belady"]["fetch_per_step"]),
                        textcoords="offset points", xytext=(-4, -14), ha="right", fontsize=8, color="C0")  # fmt: skip
    ax.set_xscale("log")
    ax.set_ylim(0, r["none"]["fetch_per_step"] * 1.08)
    ax.set_xlabel("cache rows (all tables)")
    ax.set_ylabel("rows fetched per step")
    syn = traffic["synthetic"]
    ax.set_title(f"Oracle policies: Kaggle sizes x {syn['scale']:g}, batch {syn['batch']:,}", fontsize=10)
    ax.legend(fontsize=8, loc="upper right", bbox_to_anchor=(1, 0.9))

    runs = fae["details"]["cache"]["runs"]
    labels = {
        "lookahead": "lookahead-only",
        "lookahead_same_memory": "lookahead-only,\nFAE's rows",
        "fae": "FAE",
    }
    kinds = [k for k in labels if k in runs]
    xs = list(range(len(kinds)))
    bars = bx.bar(
        xs, [runs[k]["rows_fetched_per_sample"] for k in kinds], color=["C0", "C9", "C1"][: len(kinds)]
    )
    for b, k in zip(bars, kinds):
        bx.annotate(f"{runs[k]['device_cache_rows']:,} rows", (b.get_x() + b.get_width() / 2, b.get_height()),
                    textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)  # fmt: skip
    bx.axhline(fae["compulsory_rows_per_sample"], color="grey", ls="--", label="compulsory (distinct rows)")
    bx.set_xticks(xs, [labels[k] for k in kinds], fontsize=9)
    bx.set_ylabel("rows fetched per sample")
    bx.set_title(f"FAE: {fae['fae_over_lookahead_rows_fetched']:.3f}x lookahead-only's fetches", fontsize=10)
    bx.legend(fontsize=8)
    return _finish(fig, out / "rows_fetched.png")


def step_time(results: Path, out: Path) -> Path:
    """Cached / resident step time per job and machine, each run's ratio beside the headline figure."""
    import matplotlib.pyplot as plt

    data = _load(results, "step_time.json")
    jobs = data["jobs"]
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(jobs) + 1.2))
    ys = list(range(len(jobs)))[::-1]
    colors = ["C2" if j["ratio"] <= data["target"] else "C3" for j in jobs]
    ax.barh(ys, [j["ratio"] for j in jobs], color=colors, alpha=0.6)
    for y, j in zip(ys, jobs):
        ax.plot(j["runs"], [y] * len(j["runs"]), "k.", ms=5)
        ax.annotate(f"{j['ratio']:.3g}", (0, y), textcoords="offset points", xytext=(4, -3), fontsize=9)
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.axvline(data["target"], color="C3", ls="--", label=f"target {data['target']:g}")
    ax.set_yticks(ys, [f"{j['job']}\n{j['machine']}" for j in jobs], fontsize=8)
    ax.set_xlabel("cached / resident step time (bar: headline figure; dots: runs)")
    ax.set_xlim(0, max(max(j["runs"]) for j in jobs) * 1.12)
    ax.legend(fontsize=8, loc="lower right")
    return _finish(fig, out / "step_time.png")


def fae_hot_share(results: Path, out: Path) -> Path:
    """The hot set's share of accesses and samples, as the calibrator expects it and as held-out batches
    measure it; and on time-ordered data, the calibrated hot set kept against recalibrated each epoch."""
    import matplotlib.pyplot as plt

    data = _load(results, "fae_hot_share.json")
    rows = data["budgets"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [3, 1]})
    xs = list(range(len(rows)))
    w = 0.2
    series = [
        ("expected_access_share", "accesses, expected", "C0", 0.35),
        ("measured_access_share", "accesses, measured", "C0", 1.0),
        ("expected_sample_share", "samples, expected", "C1", 0.35),
        ("measured_sample_share", "samples, measured", "C1", 1.0),
    ]
    for i, (key, label, color, alpha) in enumerate(series):
        ax.bar(
            [x + (i - 1.5) * w for x in xs],
            [100 * r[key] for r in rows],
            w,
            color=color,
            alpha=alpha,
            label=label,
        )
    ax.set_xticks(
        xs, [f"{r['data']}\n{r['budget_mib']:g} MiB, {r['hot_rows']:,} rows" for r in rows], fontsize=8
    )
    ax.set_ylabel("hot share (%)")
    ax.set_ylim(0, 125)
    ax.set_yticks(range(0, 101, 20))
    ax.set_title("FAE hot set at a budget", fontsize=10)
    ax.legend(fontsize=8, ncol=2, loc="upper center")
    rc = data["recalibration"]
    kinds = [("fixed", "kept"), ("recalibrated", "recalibrated")]
    for i, (k, _) in enumerate(kinds):
        bx.bar([i - 0.2], [100 * rc[f"{k}_hot_access_share"]], 0.4, color="C0")
        bx.bar([i + 0.2], [100 * rc[f"{k}_hot_sample_share"]], 0.4, color="C1")
    bx.set_xticks([0, 1], [label for _, label in kinds], fontsize=8)
    bx.set_ylim(0, 125)
    bx.set_yticks(range(0, 101, 20))
    bx.set_title(f"{rc['data']}:\nepochs 2-3", fontsize=9)
    return _finish(fig, out / "fae_hot_share.png")


def sync_volume(results: Path, out: Path) -> Path:
    """Rows synchronised per step by W data-parallel ranks: a replicated cache's all-reduce of every touched row
    against LRPP's shared rows, split into critical (needed next step) and delayed."""
    import matplotlib.pyplot as plt

    data = _load(results, "sync_volume.json")
    per = data["rows_per_step"]
    ws = sorted(per, key=int)
    xs = list(range(len(ws)))
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.38
    ax.bar(
        [x - w / 2 for x in xs], [per[k]["replicated"] for k in ws], w, color="grey", label="replicated cache"
    )
    crit = [per[k]["critical"] for k in ws]
    ax.bar([x + w / 2 for x in xs], crit, w, color="C3", label="LRPP, critical (needed next step)")
    ax.bar([x + w / 2 for x in xs], [per[k]["delayed"] for k in ws], w, bottom=crit, color="C1",
           label="LRPP, delayed (background)")  # fmt: skip
    for x, k in zip(xs, ws):
        ax.annotate(f"{data['lrpp_over_replicated'][k]:.2f}x", (x + w / 2, per[k]["lrpp"]),
                    textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)  # fmt: skip
    ax.set_xticks(xs, [f"W = {k}" for k in ws])
    ax.set_ylim(0, max(per[k]["replicated"] for k in ws) * 1.3)
    ax.set_ylabel("rows synchronised per step")
    cfg = data["config"]
    ax.set_title(
        f"{cfg['rows']:,} rows, global batch {cfg['global_batch']:,}, mean of {cfg['steps']} steps",
        fontsize=10,
    )
    ax.legend(fontsize=8, ncol=2, loc="upper center")
    return _finish(fig, out / "sync_volume.png")


PLOTS: Dict[str, Callable[[Path, Path], Path]] = {
    "rows_fetched": rows_fetched,
    "step_time": step_time,
    "fae_hot_share": fae_hot_share,
    "sync_volume": sync_volume,
}


def _import_matplotlib() -> Any:
    """matplotlib, from the interpreter's path, or from the folder beside the environment where
    ``scripts/setup_env.sh`` installs it (``<venv>/plots``, off the path: once matplotlib is importable,
    torchmetrics imports ``matplotlib.pyplot`` in every process that imports Lightning)."""
    try:
        import matplotlib
    except ImportError:
        folder = Path(sys.prefix) / "plots"
        if not folder.is_dir():
            raise ImportError("benchmarks/plots.py draws with matplotlib: pip install matplotlib") from None
        sys.path.append(str(folder))  # after site-packages: the environment's numpy and pillow stay first
        import matplotlib
    return matplotlib


def main(argv: Optional[List[str]] = None) -> List[Path]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS, help="the JSON inputs")
    p.add_argument("--out", type=Path, default=OUT, help="where the PNGs go")
    args = p.parse_args(argv)
    _import_matplotlib().use("Agg")
    args.out.mkdir(parents=True, exist_ok=True)
    written = [plot(args.results, args.out) for plot in PLOTS.values()]
    for path in written:
        print(f"{path} ({math.ceil(path.stat().st_size / 1024)} KiB)")
    return written


if __name__ == "__main__":
    main()
