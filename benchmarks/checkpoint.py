"""What a checkpoint of the cached tables costs: incremental (a delta over the chain of the previous ones) against
full, in RAM and on disk, in one run over the same state.

Tables of Criteo Kaggle's sizes x ``--scale`` (``--terabyte``: Criteo Terabyte's, 204 M rows), dimension
``--dim``, row-wise Adagrad's state (one column), in the stores a checkpoint of ``TorchRecStrategy`` writes pieces
of (``docs/disk_tier.md``, Checkpoints):

* ``ram``: :class:`~torchrec_lookahead.store.TensorStore` with ``keep_files()`` (``incremental_ram_stores``);
* ``disk``: :class:`~torchrec_lookahead.store.DiskStore` under a host tier of ``--host-frac`` of its bytes.

Every row is written once first (a fully trained table set; the first checkpoint is full). Then, ``--checkpoints``
times: ``--interval`` steps each write back the distinct ids of a batch of ``--batch`` samples per table (bounded
Zipf, ``benchmarks/_zipf.py``) with new values, the host tiers' dirty rows are flushed, and the stores are
checkpointed twice over the same state: incrementally (a delta over the chain) and in full (``max_chain=1``; the
next delta extends it, so each delta holds one interval's writes). Per checkpoint: bytes written (the pieces' own
count: header, index and units of a full piece; header, rows and their ids of a delta), the seconds the
training thread stops (a checkpoint written on it: the flush, timed once and counted in both, and the writing,
which is also the time until durable), and the bytes of the rows written back in the interval
(distinct rows x row bytes). An incremental checkpoint is taken as ``async_checkpoints`` takes it: the training
thread stops for the flush and the copy of the delta's rows (``incremental_stall_s``), the rest is written after
(``incremental_s``: until durable, as with the default, synchronous checkpoints). A full checkpoint is taken the
same way: ``full_stall_s``, the flush and the piece's snapshot (a disk store's index copied and its units held,
an in-memory store's rows held, copied on write), then ``full_s`` until durable, which is also what a full
checkpoint written on the training thread stops it for. Reported: medians over the checkpoints;
``incremental_bytes_over_full`` and ``stall_s_over_full`` (background writing, against a full checkpoint written
on the training thread; ``sync_stall_s_over_full``: both written on it) and ``full_stall_s`` per store kind;
``incremental_bytes_over_written`` (the target is at most 1.5);
``chain_disk_over_full``, the disk a chain of one full piece and every delta of the run uses against one full
checkpoint; and ``full_rows_over_written_rows`` (at least 10 for the ratios to mean what a long run's do:
``--quick`` is sized for it).

    python benchmarks/checkpoint.py [--quick] [--json PATH] [--scale 1.0] [--checkpoints 5] [--interval 50]
    python benchmarks/checkpoint.py --terabyte --store-dir /big/disk --kinds disk --interval 500
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._report import machine, parser, table, write_json  # noqa: E402
from benchmarks._zipf import KAGGLE_ROWS, zipf_ids  # noqa: E402
from torchrec_lookahead._arrays import sorted_unique  # noqa: E402
from torchrec_lookahead.store import DiskStore, EmbeddingStore, TensorStore  # noqa: E402

WIDTHS = {"momentum1": 1}


def _make(kind: str, name: str, rows: int, dim: int, directory: Path, host_frac: float) -> EmbeddingStore:
    if kind == "ram":
        store = TensorStore(rows, dim, WIDTHS, name=name, seed=0)
        store.keep_files()
        return store
    budget = max(int(rows * (dim + 1) * 4 * host_frac), (dim + 1) * 4 * 4096)
    return DiskStore(directory / f"{name}.rows", rows, dim, WIDTHS, name=name, seed=0, host_budget_bytes=budget,
                     preallocate=False, io_threads=4)  # fmt: skip


def _write_all(store: EmbeddingStore, dim: int, rng: np.random.Generator) -> None:
    block = 1 << 18
    for a in range(0, store.num_embeddings, block):
        ids = torch.arange(a, min(a + block, store.num_embeddings))
        w = torch.from_numpy(rng.standard_normal((ids.numel(), dim), dtype=np.float32))
        store.write_back(ids, w, {"momentum1": torch.ones(ids.numel(), 1)})


def _piece_bytes(chains: List[List[str]]) -> int:
    """The bytes of the newest pieces (their own count, from their lists)."""
    import json

    total = 0
    for chain in chains:
        if chain:
            with np.load(chain[-1] + ".npz") as data:
                total += int(json.loads(str(data["info"]))["bytes"])
    return total


def _disk_used(chains: List[List[str]]) -> int:
    return sum(os.stat(p).st_blocks * 512 for chain in chains for p in chain)


def run_kind(kind: str, sizes: List[int], args: Any, base: Path) -> Dict[str, Any]:
    rng = np.random.default_rng(0)
    stores = [
        _make(kind, f"t_cat_{i}", n, args.dim, base / "stores", args.host_frac) for i, n in enumerate(sizes)
    ]
    row_bytes = (args.dim + 1) * 4
    try:
        t0 = time.perf_counter()
        for s in stores:
            _write_all(s, args.dim, rng)
        fill_s = time.perf_counter() - t0
        for s in stores:  # the chain's full piece
            s.save_files(str(base / "pieces" / s.name), max_chain=1)
        per: List[Dict[str, float]] = []
        for _ in range(args.checkpoints):
            written = [np.zeros(n, dtype=bool) for n in sizes]
            for _ in range(args.interval):
                for i, s in enumerate(stores):
                    ids = sorted_unique(zipf_ids(rng, sizes[i], args.batch))
                    written[i][ids] = True
                    w = torch.from_numpy(rng.standard_normal((ids.size, args.dim), dtype=np.float32))
                    s.write_back(torch.from_numpy(ids), w, {"momentum1": torch.ones(ids.size, 1)})
            t0 = time.perf_counter()
            for s in stores:  # the host tier's dirty rows: both checkpoints of this state need them written
                s.flush()
            flush_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            snaps = [s.snapshot_files(str(base / "pieces" / s.name), max_chain=1 << 30) for s in stores]
            inc_stall_s = flush_s + time.perf_counter() - t0  # async_checkpoints: the rest is written behind
            for _, write in snaps:
                if write is not None:
                    write()
            inc_s = flush_s + time.perf_counter() - t0
            inc = [chain for chain, _ in snaps]
            inc_used = _disk_used([c[-1:] for c in inc])
            t0 = time.perf_counter()
            snaps = [s.snapshot_files(str(base / "pieces" / s.name), max_chain=1) for s in stores]
            full_stall_s = flush_s + time.perf_counter() - t0  # async_checkpoints: the rest is written behind
            for _, write in snaps:
                if write is not None:
                    write()
            full_s = flush_s + time.perf_counter() - t0
            full = [chain for chain, _ in snaps]
            rows = int(sum(w.sum() for w in written))
            per.append({"inc_bytes": _piece_bytes(inc), "full_bytes": _piece_bytes(full), "inc_s": inc_s,
                        "inc_stall_s": inc_stall_s, "full_s": full_s, "full_stall_s": full_stall_s,
                        "written_rows": rows,
                        "written_bytes": rows * row_bytes, "inc_used": inc_used,
                        "full_used": _disk_used(full)})  # fmt: skip
            for s, c in zip(stores, full):  # the next delta extends this full piece: the rest goes
                for p in (base / "pieces" / s.name).glob("*.rows"):
                    if str(p) not in c:
                        p.unlink()
                        Path(str(p) + ".npz").unlink(missing_ok=True)
    finally:
        for s in stores:
            close = getattr(s, "close", None)
            if close is not None:
                close()

    def med(k: str) -> float:
        return float(statistics.median(p[k] for p in per))

    return {
        "rows": sum(sizes),
        "fill_s": fill_s,
        "checkpoints": per,
        "incremental_bytes": med("inc_bytes"),
        "full_bytes": med("full_bytes"),
        "written_rows": med("written_rows"),
        "incremental_s": med("inc_s"),
        "full_s": med("full_s"),
        "full_stall_s": med("full_stall_s"),
        "incremental_bytes_over_full": med("inc_bytes") / med("full_bytes"),
        "incremental_stall_s": med("inc_stall_s"),
        "stall_s_over_full": med("inc_stall_s") / med("full_s"),
        "sync_stall_s_over_full": med("inc_s") / med("full_s"),
        "incremental_bytes_over_written": med("inc_bytes") / med("written_bytes"),
        "full_rows_over_written_rows": sum(sizes) / med("written_rows"),
        # the disk a chain of one full piece and every delta of the run holds, against one full checkpoint's
        "chain_disk_bytes": med("full_used") + sum(p["inc_used"] for p in per),
        "full_disk_bytes": med("full_used"),
        "chain_disk_over_full": (med("full_used") + sum(p["inc_used"] for p in per))
        / max(med("full_used"), 1),
    }


def main() -> None:
    p = parser("incremental against full checkpoints of the cached tables, in RAM and on disk")
    p.add_argument("--scale", type=float, default=1.0, help="Kaggle's table sizes x this")
    p.add_argument("--terabyte", action="store_true", help="Criteo Terabyte's table sizes (x --scale)")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=2048, help="samples per step (one id per table each)")
    p.add_argument("--interval", type=int, default=50, help="steps between two checkpoints")
    p.add_argument("--checkpoints", type=int, default=5)
    p.add_argument("--host-frac", type=float, default=0.25, help="the disk stores' host tier, of their bytes")
    p.add_argument("--kinds", nargs="+", default=["ram", "disk"], choices=["ram", "disk"])
    p.add_argument(
        "--store-dir", default=None, help="where the stores and checkpoints go (default: a temp dir)"
    )
    args = p.parse_args()
    if args.quick:
        args.scale, args.checkpoints, args.interval = min(args.scale, 0.02), min(args.checkpoints, 3), 10
    if args.terabyte:
        from benchmarks.scale import TERABYTE_ROWS

        rows = TERABYTE_ROWS
    else:
        rows = KAGGLE_ROWS
    sizes = [max(3, int(r * args.scale)) for r in rows]
    torch.manual_seed(0)
    results: Dict[str, Any] = {}
    for kind in args.kinds:
        base = Path(tempfile.mkdtemp(prefix=f"ckpt_bench_{kind}_", dir=args.store_dir))
        try:
            results[kind] = run_kind(kind, sizes, args, base)
        finally:
            shutil.rmtree(base, ignore_errors=True)
    cols = ["kind", "rows", "written_rows", "incremental_bytes", "full_bytes", "incremental_bytes_over_full",
            "incremental_bytes_over_written", "incremental_stall_s", "incremental_s", "full_stall_s", "full_s",
            "stall_s_over_full", "chain_disk_over_full", "full_rows_over_written_rows"]  # fmt: skip
    print(table([{"kind": k, **r} for k, r in results.items()], cols))
    write_json(
        args.json,
        {
            "scale": args.scale,
            "terabyte": args.terabyte,
            "dim": args.dim,
            "batch": args.batch,
            "interval": args.interval,
            "checkpoints": args.checkpoints,
            "incremental_bytes_over_full": {k: r["incremental_bytes_over_full"] for k, r in results.items()},
            "stall_s_over_full": {k: r["stall_s_over_full"] for k, r in results.items()},
            "sync_stall_s_over_full": {k: r["sync_stall_s_over_full"] for k, r in results.items()},
            "full_stall_s": {k: r["full_stall_s"] for k, r in results.items()},
            "incremental_bytes_over_written": {
                k: r["incremental_bytes_over_written"] for k, r in results.items()
            },
            "full_rows_over_written_rows": {k: r["full_rows_over_written_rows"] for k, r in results.items()},
            "runs": results,
            "host": machine()["cpu"],
        },
    )


if __name__ == "__main__":
    main()
