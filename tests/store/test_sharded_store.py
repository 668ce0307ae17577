"""RowShardedStore on real gloo ranks: equal to one unsharded store, typed errors on every rank, concurrent
stager gathers and training-thread writes on separate groups, and shards served by several ranks (hosts)."""

from __future__ import annotations

import os
import threading
import traceback
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchrec_lookahead.errors import ConfigError, DataError, InvalidIdError
from torchrec_lookahead.store import MmapStore, RowShardedStore, TensorStore, row_bounds
from torchrec_lookahead.store.channels import STAGE_CHANNEL, collective_channel
from torchrec_lookahead.store.sharded_store import EmptyShardStore

from ..conftest import free_port, start_method

pytestmark = [pytest.mark.distributed, pytest.mark.beside_launches]

D = 4
WIDTHS = {"momentum1": 1}


def _shard(name: str, n: int, shards: int, shard: int, seed: int = 3) -> Any:
    lo, hi = row_bounds(n, shards)[shard : shard + 2]
    if hi == lo:
        return EmptyShardStore(name, D, WIDTHS)
    return TensorStore(hi - lo, D, WIDTHS, name=name, seed=seed, chunk_rows=8192, row_offset=lo, table_rows=n)


def _sharded(n: int, rank: int, world: int, groups: Dict[str, Any], name: str = "t") -> RowShardedStore:
    return RowShardedStore(
        _shard(name, n, world, rank),
        n,
        row_bounds(n, world),
        list(range(world)),
        group=groups["default"],
        channel_groups={STAGE_CHANNEL: groups["stage"]},
    )


def _entry(rank: int, world: int, port: int, body: Callable[..., None], errors: Any, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        groups = {"default": dist.new_group(backend="gloo"), "stage": dist.new_group(backend="gloo")}
        body(rank, world, groups, *args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(body: Callable[..., None], world: int = 2, *args: Any) -> None:
    ctx = mp.get_context(start_method())
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, body, errors, args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    msgs: List[str] = []
    while not errors.empty():
        msgs.append(errors.get())
    assert not alive, "a rank hung"
    assert not msgs and all(p.exitcode == 0 for p in procs), "\n".join(msgs)


# ------------------------------------------------------------------------------------------------ bodies
def _round_trip(rank: int, world: int, groups: Dict[str, Any]) -> None:
    for n in (23, 1):  # 1 row: one of the shards is empty
        store = _sharded(n, rank, world, groups)
        ref = TensorStore(n, D, WIDTHS, name="t", seed=3, chunk_rows=8192)  # the unsharded table
        assert torch.equal(store.full_weights(), ref.full_weights())
        gen = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, n, (17,), generator=gen)  # duplicates, both shards, different per rank
        w, s = store.gather(ids)
        rw, rs = ref.gather(ids)
        assert torch.equal(w, rw) and torch.equal(s["momentum1"], rs["momentum1"])
        # a rank with nothing to read still takes part
        w, s = store.gather(ids if rank == 0 else ids[:0])
        assert w.shape == ((17 if rank == 0 else 0), D) and s["momentum1"].shape[1] == 1
        # each rank writes its own rows (disjoint), crossing shards; the other rank's rows reach it too
        mine = torch.arange(rank, n, world)
        for r in range(world):
            theirs = torch.arange(r, n, world)
            vals = (theirs.float() * 10 + r).unsqueeze(1).expand(-1, D).contiguous()
            ref.scatter(theirs, vals, {"momentum1": theirs.float().unsqueeze(1) + 0.5})
        vals = (mine.float() * 10 + rank).unsqueeze(1).expand(-1, D).contiguous()
        store.scatter(mine, vals, {"momentum1": mine.float() + 0.5})  # (n,) state accepted for width 1
        every = torch.arange(n)
        assert torch.equal(store.gather(every)[0], ref.gather(every)[0])
        assert torch.equal(store.full_states()["momentum1"], ref.full_states()["momentum1"])
        # a single row sent to the other rank's shard
        last = torch.tensor([n - 1]) if rank == 0 else torch.zeros(0, dtype=torch.long)
        store.scatter(last, torch.full((last.numel(), D), -1.0), {"momentum1": torch.zeros(last.numel(), 1)})
        ref.scatter(torch.tensor([n - 1]), torch.full((1, D), -1.0), {"momentum1": torch.zeros(1, 1)})
        assert torch.equal(store.full_weights(), ref.full_weights())
        # reads of one's own shard only: no messages, same values
        lo, hi = store.local_rows
        assert torch.equal(store.gather(torch.arange(lo, hi))[0], ref.gather(torch.arange(lo, hi))[0])
        # load writes each rank's shard from the whole table
        fresh = torch.randn(n, D, generator=torch.Generator().manual_seed(9))  # the same on every rank
        store.load(fresh, {"momentum1": torch.ones(n, 1)})
        assert torch.equal(store.full_weights(), fresh)
        assert torch.equal(store.full_states()["momentum1"], torch.ones(n, 1))
        store.flush()


def _errors(rank: int, world: int, groups: Dict[str, Any]) -> None:
    n = 23
    store = _sharded(n, rank, world, groups)
    before = store.full_weights()
    ok = torch.arange(rank, n, world)
    # an id out of range on rank 1 only: both ranks raise, nothing written
    bad = torch.tensor([0, n]) if rank == 1 else torch.tensor([1])
    with pytest.raises(InvalidIdError, match="out of range" if rank == 1 else "rank 1 refused"):
        store.gather(bad)
    with pytest.raises(InvalidIdError):
        store.scatter(bad if rank == 1 else ok, torch.zeros(bad.numel() if rank == 1 else ok.numel(), D),
                      {"momentum1": torch.zeros(bad.numel() if rank == 1 else ok.numel(), 1)})  # fmt: skip
    # a wrong shape on rank 0 only: DataError everywhere, nothing written
    rows = ok.numel() + (1 if rank == 0 else 0)
    with pytest.raises(DataError):
        store.scatter(ok, torch.ones(rows, D), {"momentum1": torch.ones(ok.numel(), 1)})
    with pytest.raises(InvalidIdError, match="1-D integer"):
        store.gather(torch.zeros(2) if rank == 0 else torch.tensor([1]))
    assert torch.equal(store.full_weights(), before)
    # ranks that disagree on the sharding: ConfigError on every rank
    bounds = [0, 12, 23] if rank == 0 else [0, 10, 23]
    local = TensorStore(bounds[rank + 1] - bounds[rank], D, WIDTHS, name="t", seed=3,
                        row_offset=bounds[rank], table_rows=n)  # fmt: skip
    with pytest.raises(ConfigError, match="differently"):
        RowShardedStore(local, n, bounds, [0, 1], group=groups["default"])
    # a local shard of the wrong size or initial values
    lo, hi = row_bounds(n, world)[rank : rank + 2]
    wrong = TensorStore(hi - lo, D, WIDTHS, name="t", seed=3) if rank == 1 else _shard("t", n, world, rank)
    with pytest.raises(ConfigError, match="row_offset"):
        RowShardedStore(wrong, n, row_bounds(n, world), [0, 1], group=groups["default"])
    with pytest.raises(ConfigError, match="no rank serving"):
        RowShardedStore(_shard("t", n, 2, 0), n, row_bounds(n, 2), [0, 0], group=groups["default"])


def _concurrent(rank: int, world: int, groups: Dict[str, Any]) -> None:
    """A stager thread gathers rows [n/2, n) under the stage channel while the training thread rewrites rows
    [0, n/2): collectives on the two groups never mix, and every read sees the right values."""
    n, steps = 64, 40
    store = _sharded(n, rank, world, groups)
    ref = TensorStore(n, D, WIDTHS, name="t", seed=3, chunk_rows=8192)
    upper = torch.arange(n // 2, n)
    expected = ref.gather(upper)[0]
    failures: List[str] = []

    def stager() -> None:
        try:
            with collective_channel(STAGE_CHANNEL):
                for step in range(steps):
                    ids = upper[torch.randperm(upper.numel(), generator=torch.Generator().manual_seed(step))][
                        :9
                    ]
                    w, _ = store.gather(ids)
                    if not torch.equal(w, ref.gather(ids)[0]):
                        failures.append(f"step {step}: stale or foreign rows")
        except BaseException:
            failures.append(traceback.format_exc())

    thread = threading.Thread(target=stager)
    thread.start()
    for step in range(steps):
        mine = torch.arange(rank, n // 2, world)
        store.scatter(
            mine, torch.full((mine.numel(), D), float(step)), {"momentum1": torch.zeros(mine.numel(), 1)}
        )
    thread.join(60)
    assert not thread.is_alive() and not failures, failures
    assert torch.equal(store.gather(torch.arange(n // 2))[0], torch.full((n // 2, D), float(steps - 1)))
    assert torch.equal(store.gather(upper)[0], expected)


def _hosts(rank: int, world: int, groups: Dict[str, Any], directory: str) -> None:
    """4 ranks as 2 hosts of 2: one shard per host in a memory-mapped file its two ranks share; a request
    goes to the same local rank on the owning host."""
    n, local = 37, 2
    host = rank // local
    bounds = row_bounds(n, 2)
    lo, hi = bounds[host : host + 2]
    path = os.path.join(directory, f"host{host}.bin")
    if rank % local == 0:
        MmapStore(path, hi - lo, D, WIDTHS, name="t", seed=3, row_offset=lo, table_rows=n).close()
    dist.barrier()
    store = RowShardedStore(MmapStore.open(path), n, bounds, [r // local for r in range(world)],
                            group=groups["default"], channel_groups={STAGE_CHANNEL: groups["stage"]})  # fmt: skip
    ref = TensorStore(n, D, WIDTHS, name="t", seed=3, chunk_rows=8192)
    assert torch.equal(store.full_weights(), ref.full_weights())
    mine = torch.arange(rank, n, world)
    store.scatter(
        mine, torch.full((mine.numel(), D), float(rank)), {"momentum1": torch.ones(mine.numel(), 1)}
    )
    dist.barrier()
    w, s = store.gather(torch.arange(n))
    assert torch.equal(w[:, 0], (torch.arange(n) % world).float())
    assert bool((s["momentum1"] == 1).all())


def _host_windows(rank: int, world: int, groups: Dict[str, Any], directory: str) -> None:
    """Each rank's disk shard has a host tier of its own size; every rank learns every shard's."""
    from torchrec_lookahead.runtime._host_windows import HostWindowCheck
    from torchrec_lookahead.store import DiskStore

    n = 1000
    bounds = row_bounds(n, world)
    lo, hi = bounds[rank : rank + 2]
    local = DiskStore(os.path.join(directory, f"t{rank}.rows"), hi - lo, D, WIDTHS, name="t", seed=3,
                      host_budget_bytes=(10 + rank) * 20, row_offset=lo, table_rows=n, host_policy="lookahead",
                      disk_prefetch_depth=2)  # fmt: skip
    store = RowShardedStore(local, n, bounds, list(range(world)), group=groups["default"])
    window = store.host_window
    assert window is not None and local.host_window.rows == (10 + rank,)
    assert (window.depth, window.bounds, window.rows, window.policy) == (
        2,
        (0, 500, 1000),
        (10, 11),
        "lookahead",
    )
    check = HostWindowCheck({"t": window})  # the same on every rank: every rank refuses the same window
    assert check.push({"t": torch.arange(495, 506).numpy()}) == []  # 5 and 6 rows
    (short,) = check.push({"t": torch.arange(600, 606).numpy()})
    assert (short.shard, short.needed, short.available, short.hi) == (1, 12, 11, 1)
    plain = RowShardedStore(
        _shard("u", n, world, rank), n, bounds, list(range(world)), group=groups["default"]
    )
    assert plain.host_window is None
    local.close()


# ------------------------------------------------------------------------------------------------- tests
def test_row_sharded_store_equals_the_unsharded_store():
    _spawn(_round_trip)


def test_refused_calls_raise_typed_errors_on_every_rank_and_write_nothing():
    _spawn(_errors)


def test_stager_gathers_and_training_writes_run_concurrently_on_separate_groups():
    _spawn(_concurrent)


def test_every_rank_knows_every_shard_s_host_tier(tmp_path):
    _spawn(_host_windows, 2, str(tmp_path))


@pytest.mark.slow
def test_one_shard_per_host_served_by_every_rank_of_the_host(tmp_path):
    _spawn(_hosts, 4, str(tmp_path))


def test_row_bounds_and_shard_init_values_match_the_whole_table():
    assert row_bounds(23, 2) == [0, 12, 23]
    with pytest.raises(ConfigError):
        row_bounds(0, 2)
    whole = TensorStore(23, D, WIDTHS, name="t", seed=3).full_weights()
    shard = TensorStore(11, D, WIDTHS, name="t", seed=3, row_offset=12, table_rows=23)
    assert torch.equal(shard.full_weights(), whole[12:])
    with pytest.raises(ConfigError, match="does not fit"):
        TensorStore(12, D, WIDTHS, name="t", row_offset=12, table_rows=23)
