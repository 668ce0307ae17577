"""Two gloo ranks (spawned processes) running the lookahead loader's planner: the id all-gathers stop in
lockstep whether the epoch ends, a rank's loader is ragged or empty, or a rank stops training early; over a
row-sharded store, the stager's row gathers (collectives too) stop in lockstep as well.

Where a scenario needs one rank to act after the other, a barrier on a group of their own orders them (no sleep),
and the checks are about how each close ended (an error, or none), never how long it took: a wait that was
abandoned at ``stop_timeout_s`` is a ``SetupError`` that says so. Where no timeout is expected, the timeout
(``HANG_S``) only bounds a hang."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..conftest import free_port, start_method

pytestmark = [pytest.mark.distributed, pytest.mark.beside_launches]

ROWS = 40
HANG_S = 120.0  # stop_timeout_s where no wait may time out, and the bound of the waits for a thread's event


def _batch(ids: List[int]) -> Any:
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor(ids, dtype=torch.int64),
                            lengths=torch.ones(len(ids), dtype=torch.int32))  # fmt: skip
    return Batch(torch.zeros(len(ids), 1), kjt, torch.zeros(len(ids)))


def _batches(rank: int, n: int, size: int = 2) -> List[Any]:
    g = torch.Generator().manual_seed(rank)
    return [_batch(torch.randint(0, ROWS, (size,), generator=g).tolist()) for _ in range(n)]


def _loader(rank: int, batches: List[Any], group: Any, stop_timeout_s: float = HANG_S) -> Any:
    from torchrec_lookahead.oracle import LookaheadSettings
    from torchrec_lookahead.runtime import CacheSession, CacheTarget, LookaheadLoader
    from torchrec_lookahead.store import TensorStore

    target = CacheTarget(capacity={"t": 16}, feature_to_table={"f": "t"}, num_embeddings={"t": ROWS},
                         stores={"t": TensorStore(ROWS, 4, name="t")}, num_ranks=2, rank=rank, group=group)  # fmt: skip
    return LookaheadLoader(batches, CacheSession(target), LookaheadSettings(horizon=2), queue_depth=3,
                           stop_timeout_s=stop_timeout_s)  # fmt: skip


def _sharded_loader(rank: int, batches: List[Any], group: Any, stop_timeout_s: float = HANG_S) -> Any:
    """The loader over a row-sharded store: each rank holds half of the rows, the stager's gathers are
    collectives on a group of their own."""
    from torchrec_lookahead.oracle import LookaheadSettings
    from torchrec_lookahead.runtime import CacheSession, CacheTarget, LookaheadLoader
    from torchrec_lookahead.store import RowShardedStore, TensorStore, row_bounds
    from torchrec_lookahead.store.channels import STAGE_CHANNEL

    bounds = row_bounds(ROWS, 2)
    lo, hi = bounds[rank : rank + 2]
    groups = {"default": dist.new_group(backend="gloo"), STAGE_CHANNEL: dist.new_group(backend="gloo")}
    store = RowShardedStore(TensorStore(hi - lo, 4, name="t", row_offset=lo, table_rows=ROWS), ROWS, bounds,
                            [0, 1], group=groups["default"],
                            channel_groups={STAGE_CHANNEL: groups[STAGE_CHANNEL]})  # fmt: skip
    target = CacheTarget(capacity={"t": 16}, feature_to_table={"f": "t"}, num_embeddings={"t": ROWS},
                         stores={"t": store}, num_ranks=2, rank=rank, group=group)  # fmt: skip
    return LookaheadLoader(batches, CacheSession(target), LookaheadSettings(horizon=2), queue_depth=3,
                           stop_timeout_s=stop_timeout_s)  # fmt: skip


def _staged_diff(loader: Any, b: Any) -> float:
    """Max |staged - initial| of a batch's fetched rows (nothing is written back in these scenarios)."""
    from torchrec_lookahead.store import TensorStore

    rows = loader.staged_rows(b.plan, b.staged)
    ids = b.plan.tables["t"].fetch_ids
    if not ids.numel():
        return 0.0
    want = TensorStore(ROWS, 4, name="t").gather(ids)[0]
    return float((rows.tables["t"].weights - want).abs().max())


def _consume(loader: Any, it: Any, n: int) -> int:
    """Train ``n`` steps of ``it`` (an iteration of ``loader``): each batch applied through the loader's session
    (no cached module: the apply gate and the staged rows only)."""
    done = 0
    for _ in range(n):
        loader.session.apply(next(it))
        done += 1
    return done


def _wait_for(event: threading.Event, what: str) -> None:
    """Wait until a background thread sets ``event`` (``HANG_S`` only bounds a hang)."""
    if not event.wait(HANG_S):
        raise AssertionError(f"no thread signalled, within {HANG_S:g} s, that {what}")


def _close(loader: Any, out: Dict[str, Any], key: str = "close_error") -> None:
    """Close ``loader``, recording its error (a wait abandoned at ``stop_timeout_s`` is a SetupError) in ``out``."""
    try:
        loader.close()
    except Exception as e:
        out[key] = f"{type(e).__name__}: {e}"


def _stop_after_peer_stopping(rank: int, loader: Any, side: Any, out: Dict[str, Any]) -> None:
    """Close ``loader`` on both ranks, rank 1 only once rank 0's loader is stopping: rank 0's first
    ``LockstepGathers.stop`` (its background thread, while rank 0's close waits for it) meets rank 1 at a barrier
    on ``side`` before it exchanges its stop, and rank 1 closes after that barrier."""
    from torchrec_lookahead.distributed.lockstep import LockstepGathers

    if rank == 1:
        dist.barrier(group=side)
        _close(loader, out)
        return
    stop, lock = LockstepGathers.stop, threading.Lock()

    def stop_after_telling_the_peer(gathers: Any, *args: Any, **kwargs: Any) -> None:
        with lock:
            if "stopped_first" not in out:
                out["stopped_first"] = True
                dist.barrier(group=side)
        stop(gathers, *args, **kwargs)

    LockstepGathers.stop = stop_after_telling_the_peer  # type: ignore[method-assign]
    try:
        _close(loader, out)
    finally:
        LockstepGathers.stop = stop  # type: ignore[method-assign]


def _scenario(rank: int, name: str, group: Any, side: Any) -> Dict[str, Any]:
    """One scenario on one rank. ``group``: the loader's planner group; ``side``: a group of its own that orders
    the ranks' steps where a scenario needs one rank to act after the other (a barrier, not a sleep)."""
    out: Dict[str, Any] = {}
    if name == "equal":  # two epochs of 6 batches each: both end at the same gather
        loader = _loader(rank, _batches(rank, 6), group)
        out["steps"] = [_consume(loader, iter(loader), 6) for _ in range(2)]
        loader.close()
    elif name in ("ragged", "empty"):
        batches = _batches(rank, 6)
        if rank == 1:  # a missing final batch, or an empty final slice
            batches = batches[:5] if name == "ragged" else batches[:5] + [_batch([])]
        loader = _loader(rank, batches, group)
        try:
            for b in loader:
                loader.session.apply(b)
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
        loader.close()
    elif name == "stop":  # both stop after 3 of 40 batches, rank 1 once rank 0 is stopping
        loader = _loader(rank, _batches(rank, 40), group)
        it = iter(loader)
        out["steps"] = _consume(loader, it, 3)
        _stop_after_peer_stopping(rank, loader, side, out)
    elif name == "peer_stops":  # rank 1 stops after 2 batches, rank 0 keeps asking
        loader = _loader(rank, _batches(rank, 40), group)
        it = iter(loader)
        try:
            _consume(loader, it, 2 if rank == 1 else 40)
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
        loader.close()
    elif name == "peer_gone":  # rank 1 stops; rank 0's planner never joins (its queue is full for 8 s)
        from torchrec_lookahead.runtime import _threads

        blocked = threading.Event()
        put = _threads._Run.put

        def put_noting_a_full_queue(run: Any, item: Any) -> bool:
            if run.out.full():  # the planner gathers nothing more until the training thread takes a batch
                blocked.set()
            return put(run, item)

        _threads._Run.put = put_noting_a_full_queue  # type: ignore[method-assign]
        try:
            loader = _loader(rank, _batches(rank, 40), group, stop_timeout_s=1.0)
            it = iter(loader)
            _consume(loader, it, 2)
            _wait_for(blocked, "the planner waits in put() with a full queue")
        finally:
            _threads._Run.put = put  # type: ignore[method-assign]
        dist.barrier(group=side)  # both planners wait in put(), out of the gathers
        if rank == 1:
            _close(loader, out, "error")
            dist.barrier(group=side)
        else:
            dist.barrier(group=side)  # rank 0's planner joins only once rank 1 gave up
            _close(loader, out)
    elif name == "sharded_equal":  # two epochs over a row-sharded store: rows as the unsharded table's
        loader = _sharded_loader(rank, _batches(rank, 6), group)
        out["steps"], out["diff"] = [], 0.0
        for _ in range(2):
            n = 0
            for b in loader:
                loader.progress.begin(b.plan.step)
                out["diff"] = max(out["diff"], _staged_diff(loader, b))
                n += 1
            out["steps"].append(n)
        loader.close()
    elif name == "sharded_stop":  # both stop after 3 of 40 batches, rank 1 once rank 0 is stopping
        loader = _sharded_loader(rank, _batches(rank, 40), group)
        it = iter(loader)  # held: an iterator collected before close() would stop the loader itself
        out["steps"] = _consume(loader, it, 3)
        _stop_after_peer_stopping(rank, loader, side, out)
    elif name == "stager_peer_stops":
        # Rank 0 starts step 2 (plan 1 applied on rank 0), so its stager goes on to gather plan 3's rows; rank 1
        # stops after step 1, before its stager reaches plan 3. Rank 0's stager must not be left inside a row
        # gather rank 1 never joins: it learns that rank 1 stopped, and plan 3's rows fail with a SetupError.
        loader = _sharded_loader(rank, _batches(rank, 40), group)
        it = iter(loader)
        _consume(loader, it, 3 if rank == 0 else 2)
        dist.barrier(group=side)  # rank 0 has plan 2's rows (rank 1's stager joined their gather)
        if rank == 1:
            _close(loader, out)
            dist.barrier(group=side)
        else:
            dist.barrier(group=side)  # rank 1 has stopped: plan 3's rows can no longer be gathered
            try:
                b = next(it)
                out["plan"] = b.plan.step
                loader.staged_rows(b.plan, b.staged)
            except Exception as e:
                out["error"] = f"{type(e).__name__}: {e}"
            _close(loader, out)
    elif name == "stager_peer_gone":
        # Rank 1's stager waits in the row gather of plan 2 for rank 0's, which never starts (rank 0 reads
        # batches without starting their steps); once rank 1 stopped, it gives up within its timeout.
        from torchrec_lookahead.distributed.lockstep import StageGathers

        at_plan_2 = threading.Event()
        begin = StageGathers.begin

        def begin_noting_plan_2(gathers: Any) -> bool:
            if gathers.count >= 2:  # the exchanges of plans 0 and 1 are done: this is plan 2's
                at_plan_2.set()
            return begin(gathers)

        StageGathers.begin = begin_noting_plan_2  # type: ignore[method-assign]
        try:
            loader = _sharded_loader(rank, _batches(rank, 40), group, stop_timeout_s=1.0)
            it = iter(loader)
            if rank == 1:
                _consume(loader, it, 2)
                _wait_for(at_plan_2, "the stager waits in plan 2's row gather")
        finally:
            StageGathers.begin = begin  # type: ignore[method-assign]
        if rank == 1:
            dist.barrier(group=side)  # rank 0 has read its 6 batches
            _close(loader, out, "error")
            dist.barrier(group=side)
        else:
            for _ in range(6):
                next(it)
            dist.barrier(group=side)
            dist.barrier(group=side)  # close only once rank 1 gave up
            _close(loader, out, "error")
    elif name in ("scan", "scan_fails"):  # the capacity pre-scan: rank 1's loader fails at batch 3
        from torchrec_lookahead.runtime import prescan

        batches: Any = _batches(rank, 6)
        if name == "scan_fails" and rank == 1:

            def failing(first: List[Any]) -> Any:
                yield from first
                raise OSError("disk gone")

            batches = failing(batches[:3])
        target = _loader(rank, [], group).target
        try:
            out["need"] = prescan(batches, target, prefetch_depth=1, stop_timeout_s=20.0).need
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
    elif (
        name == "scan_bounded"
    ):  # rank 0 bounds the scan at 4 batches, rank 1 not at all: rank 0's bound holds
        from torchrec_lookahead.runtime.scan import prescan

        target = _loader(rank, [], group).target
        scan = prescan(_batches(rank, 6), target, 1, 20.0, max_batches=4 if rank == 0 else None)
        out.update(need=scan.need, batches=scan.batches, ended=scan.ended)
    elif name == "scan_timed":
        # Rank 0's clock moves one second per reading and its bound is 3.5 s: it stops after 3 batches. Rank 1
        # has no bound and a real clock; it stops where rank 0's clock says so.
        import itertools
        from types import SimpleNamespace

        import torchrec_lookahead.runtime.scan as scan_module

        target = _loader(rank, [], group).target
        real = scan_module.time
        if rank == 0:
            clock = itertools.count()
            scan_module.time = SimpleNamespace(perf_counter=lambda: float(next(clock)))  # type: ignore[assignment]
        try:
            scan = scan_module.prescan(
                _batches(rank, 6), target, 1, 20.0, max_seconds=3.5 if rank == 0 else None
            )
        finally:
            scan_module.time = real  # type: ignore[assignment]
        out.update(need=scan.need, batches=scan.batches, ended=scan.ended)
    elif name == "scan_signalled":
        # Rank 1 receives SIGTERM once it has read 2 batches (no bound, no clock): both ranks stop before batch 3.
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        from torchrec_lookahead.runtime.scan import prescan

        target = _loader(rank, [], group).target
        read: List[int] = []
        try:
            prescan(
                _batches(rank, 6), target, 1, 20.0, on_batch=lambda: read.append(1),
                signalled=lambda: rank == 1 and len(read) >= 2,
            )  # fmt: skip
            out["error"] = "no SIGTERMException"
        except SIGTERMException:
            out["batches"] = len(read)
    out["alive"] = [t.name for t in threading.enumerate() if t.name.startswith("lookahead-")]
    return out


SCENARIOS = ["equal", "ragged", "empty", "stop", "peer_stops", "peer_gone", "sharded_equal", "sharded_stop",
             "stager_peer_stops", "stager_peer_gone", "scan", "scan_fails", "scan_bounded", "scan_timed",
             "scan_signalled"]  # fmt: skip


def _worker(rank: int, port: int, outdir: str) -> None:
    os.environ["PYTHONWARNINGS"] = "ignore"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    side = dist.new_group(backend="gloo")
    for name in SCENARIOS:  # one pair of processes for all scenarios, a fresh planner group for each
        results[name] = _scenario(rank, name, dist.new_group(backend="gloo"), side)
        dist.barrier()
    Path(outdir, f"{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, List[Dict[str, Any]]]:
    outdir = tmp_path_factory.mktemp("lockstep")
    mp.start_processes(_worker, args=(free_port(), str(outdir)), nprocs=2, start_method=start_method())
    per_rank = [json.loads((outdir / f"{r}.json").read_text()) for r in range(2)]
    return {name: [per_rank[0][name], per_rank[1][name]] for name in SCENARIOS}


@pytest.mark.parametrize("name", SCENARIOS)
def test_no_lookahead_thread_outlives_its_loader(results, name):
    for r in results[name]:
        assert not r["alive"], r


def test_ranks_that_read_the_same_number_of_batches_end_every_epoch_together(results):
    a, b = results["equal"]
    assert a["steps"] == b["steps"] == [6, 6]


@pytest.mark.parametrize("name", ["ragged", "empty"])
def test_a_ragged_or_empty_final_slice_is_a_data_error_on_every_rank(results, name):
    a, b = results[name]
    for r in (a, b):
        assert r.get("error", "").startswith("DataError"), r
    match = "different lengths" if name == "ragged" else "different sizes"
    assert match in a["error"] and match in b["error"]


def test_ranks_stopping_mid_epoch_end_their_gathers_together(results):
    a, b = results["stop"]
    assert a["steps"] == b["steps"] == 3
    # rank 0 stopped first and waited for rank 1 to join the last all-gather, then both ended: neither close
    # gave up waiting (that is a SetupError) or met another error
    assert a.get("stopped_first") and "stopped_first" not in b
    assert "close_error" not in a and "close_error" not in b, (a, b)


def test_a_rank_asking_for_batches_after_its_peer_stopped_gets_a_setup_error(results):
    a, b = results["peer_stops"]
    assert "error" not in b
    assert a["error"].startswith("SetupError") and "rank(s) [1] stopped" in a["error"]


def test_a_stopped_rank_whose_peer_never_joins_gives_up_within_its_timeout(results):
    a, b = results["peer_gone"]
    assert b["error"].startswith("SetupError") and "within 1 s" in b["error"], b
    assert "id all-gather of the lookahead planner" in b["error"] and "close_error" not in a, (a, b)


def test_row_gathers_over_a_sharded_store_end_every_epoch_together_with_the_unsharded_rows(results):
    a, b = results["sharded_equal"]
    assert a["steps"] == b["steps"] == [6, 6]
    assert a["diff"] == b["diff"] == 0.0


def test_ranks_stopping_mid_epoch_end_their_row_gathers_together(results):
    a, b = results["sharded_stop"]
    assert a["steps"] == b["steps"] == 3
    assert a.get("stopped_first") and "stopped_first" not in b
    assert "close_error" not in a and "close_error" not in b, (a, b)


def test_a_stager_whose_peer_stopped_ends_its_row_gathers_with_a_setup_error(results):
    a, b = results["stager_peer_stops"]
    assert "error" not in b, b
    assert a["plan"] == 3 and a["error"].startswith("SetupError"), a
    assert "rank(s) [1] stopped gathering rows before plan 3" in a["error"], a
    assert "close_error" not in a and "close_error" not in b, (a, b)  # neither waited out stop_timeout_s


def test_a_stopped_stager_whose_peer_never_joins_gives_up_within_its_timeout(results):
    a, b = results["stager_peer_gone"]
    assert b["error"].startswith("SetupError") and "row gather of the lookahead stager" in b["error"], b
    assert "within 1 s" in b["error"], b


def test_the_capacity_pre_scan_checks_the_global_batches_and_a_rank_failing_in_it_fails_every_rank(results):
    a, b = results["scan"]
    assert a["need"] == b["need"] and 2 < a["need"]["t"] <= 8, (a, b)  # windows of 2 global batches of 4 ids
    a, b = results["scan_fails"]
    assert b["error"] == "OSError: disk gone", b
    assert (
        a["error"].startswith("SetupError") and "rank(s) [1] failed during the capacity check" in a["error"]
    )


@pytest.mark.parametrize("name", ["scan_bounded", "scan_timed"])
def test_ranks_stop_a_bounded_pre_scan_at_rank_0s_bound_together(results, name):
    a, b = results[name]
    assert "error" not in a and "error" not in b, (a, b)
    want = 4 if name == "scan_bounded" else 3
    assert a["batches"] == b["batches"] == want and not a["ended"] and not b["ended"], (a, b)
    assert a["need"] == b["need"] and 2 < a["need"]["t"] <= 8, (a, b)  # windows of 2 global batches of 4 ids


def test_sigterm_on_one_rank_stops_every_rank_s_pre_scan_before_the_same_batch(results):
    a, b = results["scan_signalled"]
    assert "error" not in a and "error" not in b, (a, b)
    assert a["batches"] == b["batches"] == 2, (a, b)  # of 6: the signal did not wait for the scan's end
