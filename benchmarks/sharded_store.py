"""Rows per second of a row-sharded store (2 gloo ranks, collectives) against a local in-RAM store.

Two processes on 127.0.0.1 each hold half of a table (``RowShardedStore`` over ``TensorStore`` shards, rows of
``D = 16`` weights plus one row-wise Adagrad state column) and, per trial, gather ``--batch`` uniformly random
ids (half of them on the other rank) and scatter as many distinct ids (each rank its own half of a random
permutation), as the lookahead stager and the write-back do per step. The same calls on an unsharded
``TensorStore`` in the same process give the local reference. Figures are per rank, medians over trials.

    python benchmarks/sharded_store.py [--quick] [--json PATH] [--rows 2000000] [--batch 16384]

JSON keys: ``local_gather_rows_per_s``, ``sharded_gather_rows_per_s``, ``local_scatter_rows_per_s``,
``sharded_scatter_rows_per_s``, ``gather_slowdown`` (local / sharded rows/s), ``scatter_slowdown``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import free_port, machine, median, parser, table, write_json  # noqa: E402
from torchrec_lookahead.store import RowShardedStore, TensorStore, row_bounds  # noqa: E402

D = 16
WIDTHS = {"momentum1": 1}


def _worker(rank: int, port: int, rows: int, batch: int, trials: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        bounds = row_bounds(rows, 2)
        lo, hi = bounds[rank], bounds[rank + 1]
        shard = TensorStore(hi - lo, D, WIDTHS, name="t", row_offset=lo, table_rows=rows)
        sharded = RowShardedStore(shard, rows, bounds, [0, 1])
        local = TensorStore(rows, D, WIDTHS, name="t")
        local.full_weights()  # initialise every row of both, outside the timings
        sharded.full_weights()
        gen = torch.Generator().manual_seed(rank)
        times: Dict[str, List[float]] = {k: [] for k in ("lg", "sg", "ls", "ss")}
        for trial in range(trials + 1):
            ids = torch.randint(0, rows, (batch,), generator=gen)
            perm = torch.randperm(rows, generator=torch.Generator().manual_seed(trial))[: 2 * batch]
            mine = perm[rank::2]
            w = torch.randn(mine.numel(), D, generator=gen)
            s = {"momentum1": torch.rand(mine.numel(), 1, generator=gen)}
            calls = {
                "lg": (local.gather, (ids,)),
                "sg": (sharded.gather, (ids,)),
                "ls": (local.scatter, (mine, w, s)),
                "ss": (sharded.scatter, (mine, w, s)),
            }
            for key, (fn, call_args) in calls.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn(*call_args)  # type: ignore[operator]
                if trial:  # the first trial warms up
                    times[key].append(time.perf_counter() - t0)
        if rank == 0:
            queue.put({k: median(v) for k, v in times.items()})
    finally:
        dist.destroy_process_group()


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=None, help="table rows (default 2,000,000; --quick 200,000)")
    p.add_argument("--batch", type=int, default=16_384)
    p.add_argument("--trials", type=int, default=None, help="timed trials (default 20; --quick 8)")
    args = p.parse_args(argv)
    rows = args.rows or (200_000 if args.quick else 2_000_000)
    trials = args.trials or (8 if args.quick else 20)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_worker, args=(free_port(), rows, args.batch, trials, queue), nprocs=2, join=True)
    t = queue.get()
    b = args.batch
    figures = {
        "rows": rows,
        "batch": b,
        "local_gather_rows_per_s": b / t["lg"],
        "sharded_gather_rows_per_s": b / t["sg"],
        "local_scatter_rows_per_s": b / t["ls"],
        "sharded_scatter_rows_per_s": b / t["ss"],
        "gather_slowdown": t["sg"] / t["lg"],
        "scatter_slowdown": t["ss"] / t["ls"],
    }
    print(table([{k: v for k, v in figures.items()}]))
    print(machine())
    write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
