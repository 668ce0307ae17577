"""LRPP bookkeeping against a naive reference, on random multi-rank traces."""

import numpy as np
import pytest
import torch
from torchrec import KeyedJaggedTensor

from torchrec_lookahead.distributed.lrpp import LRPPTracker, lowest_rank, slice_samples
from torchrec_lookahead.oracle import LookaheadOracle, OracleConfig
from torchrec_lookahead.store import TensorStore


def _trace(seed, steps, batch, rows):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = (torch.rand(batch, generator=g) ** 3 * rows).long()  # skewed: hot rows shared by ranks
        out.append({"t": (ids, torch.ones(batch, dtype=torch.int64))})
    return out


@pytest.mark.parametrize("world, capacity", [(2, 24), (3, 40), (4, 64)])
def test_tracker_matches_a_naive_replica_simulation(world, capacity):
    batch, rows = 12, 60
    trace = _trace(world, 40, batch, rows)
    oracle = LookaheadOracle(OracleConfig(capacity={"t": capacity}, horizon=6, num_ranks=world))
    tracker = LRPPTracker({"t": capacity}, world)
    # naive: per rank, the version of every slot it holds; the true version of each slot
    true_version = {}
    held = [dict() for _ in range(world)]
    seen = {"single": 0, "shared": 0, "refresh": 0, "delayed": 0}
    for step, (batch_in, plan) in enumerate(zip(trace, oracle.plan_stream(trace))):
        ids = batch_in["t"][0]
        tp = plan.tables["t"]
        sync = tracker.step(plan, {"t": ids}).tables["t"]
        for slot, writer in zip(tp.evict_slots.tolist(), sync.evict_writer.tolist()):
            assert held[writer].get(slot) == true_version[slot], "writer must hold the current row"
            del true_version[slot]
            for h in held:
                h.pop(slot, None)
        for slot in tp.fetch_slots.tolist():
            true_version[slot] = (step, "fetch")
            for h in held:
                h[slot] = true_version[slot]
        # ranks own contiguous slices of the global batch, split like torch.tensor_split
        ends = np.cumsum([len(x) for x in np.array_split(np.arange(batch), world)])
        readers = {}
        for i, slot in enumerate(tp.slots.tolist()):
            readers.setdefault(slot, set()).add(int(np.searchsorted(ends, i, side="right")))
        expected_refresh = sorted(
            s for s, rs in readers.items() if any(held[r].get(s) != true_version[s] for r in rs)
        )
        assert sync.refresh_slots.tolist() == expected_refresh
        for s, src in zip(sync.refresh_slots.tolist(), sync.refresh_source.tolist()):
            assert held[src].get(s) == true_version[s]
            for h in held:
                h[s] = true_version[s]
        assert sync.shared_slots.tolist() == sorted(s for s, rs in readers.items() if len(rs) > 1)
        # delayed: shared and not read by any rank at the next step (a slot keeps its id until evicted, and
        # an id read at t + 1 is never evicted at t + 1)
        nxt = set(trace[step + 1]["t"][0].tolist()) if step + 1 < len(trace) else set()
        slot_id = dict(zip(tp.slots.tolist(), ids.tolist()))
        assert sync.delayed_slots.tolist() == sorted(
            s for s, rs in readers.items() if len(rs) > 1 and slot_id[s] not in nxt
        )
        seen["delayed"] += int(sync.delayed_slots.numel())
        for s, rs in readers.items():
            true_version[s] = (step, "update")
            for r in rs:
                held[r][s] = true_version[s]
            seen["shared" if len(rs) > 1 else "single"] += 1
        seen["refresh"] += len(expected_refresh)
        for s in range(capacity):
            w = int(sync.writer[s])
            if s in true_version:
                assert held[w].get(s) == true_version[s]
            else:
                assert w == -1
    assert all(v > 0 for v in seen.values()), seen  # the trace exercises every kind of row
    assert seen["delayed"] < seen["shared"]


def test_horizon_zero_labels_every_shared_row_critical():
    """With horizon 0 a step is planned before the next batch is read: nothing may be delayed."""
    trace = _trace(3, 12, 8, 20)
    for horizon in (0, 1):
        oracle = LookaheadOracle(
            OracleConfig(capacity={"t": 40}, horizon=horizon, prefetch_depth=0, num_ranks=2)
        )
        tracker = LRPPTracker({"t": 40}, 2)
        delayed = shared = 0
        for step, plan in enumerate(oracle.plan_stream(trace)):
            ann = plan.tables["t"].ranks
            assert torch.equal(ann.shared_next | ann.shared_delayed, ~ann.single_rank)
            assert not bool((ann.shared_next & ann.shared_delayed).any())
            lrpp = tracker.step(plan, {"t": trace[step]["t"][0]})
            counters = lrpp.counters(delayed_sync=True)
            assert counters["rows_synced_delayed"] == int(lrpp.tables["t"].delayed_slots.numel())
            assert (
                counters["rows_synced_critical"] + counters["rows_synced_delayed"]
                == (lrpp.counters()["rows_synced_critical"])
            )
            delayed += int(ann.shared_delayed.sum())
            shared += int((~ann.single_rank).sum())
        assert shared > 0
        assert (delayed == 0) if horizon == 0 else (0 < delayed < shared)


def test_delayed_sync_needs_its_own_process_group():
    from torchrec import EmbeddingBagConfig

    from torchrec_lookahead.distributed import ShardedLookaheadEmbeddingBagCollection
    from torchrec_lookahead.errors import SetupError
    from torchrec_lookahead.modules import CachedEmbeddingBagCollection

    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])]
    cache = CachedEmbeddingBagCollection(tables, {"t": 4})
    with pytest.raises(SetupError, match="delayed_group"):
        ShardedLookaheadEmbeddingBagCollection(tables, None, cache, rank=0, world_size=2)


def test_lowest_rank_and_sample_slicing():
    assert lowest_rank(np.array([0, 5, 12, 1 << 40])).tolist() == [-1, 0, 2, 40]
    kjt = KeyedJaggedTensor(
        keys=["a", "b"], values=torch.arange(8), lengths=torch.tensor([1, 2, 0, 1, 1, 1, 1, 1])
    )
    part = slice_samples(kjt, 2, 4)
    assert part["a"].values().tolist() == [3] and part["b"].values().tolist() == [6, 7]
    assert part.lengths().tolist() == [0, 1, 1, 1]


def test_a_cache_of_shared_stores_writes_back_and_flushes_only_the_rows_named():
    from torchrec import EmbeddingBagConfig

    from torchrec_lookahead.modules import CachedEmbeddingBagCollection
    from torchrec_lookahead.oracle.types import BatchPlan, TablePlan

    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])]
    store = TensorStore(10, 4, {"momentum1": 1}, name="t")
    cache = CachedEmbeddingBagCollection(tables, {"t": 4}, stores={"t": store})
    cache.share_stores()
    before, _ = store.gather(torch.arange(10))
    e = torch.empty(0, dtype=torch.long)
    cache.apply_plan(
        BatchPlan(0, {"t": TablePlan(e, e, torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), e)})
    )
    for slot in range(3):
        cache.cache_weights("t")[slot] = 7.0
    cache.flush()  # names no rows: writes none
    assert torch.equal(store.gather(torch.arange(10))[0], before)
    evict = TablePlan(torch.tensor([1, 2]), torch.tensor([0, 1]), e, e, e)
    cache.apply_plan(BatchPlan(1, {"t": evict}), writes={"t": torch.tensor([2])})
    after, _ = store.gather(torch.tensor([1, 2, 3]))
    assert (
        torch.equal(after[0], before[1]) and bool((after[1] == 7).all()) and torch.equal(after[2], before[3])
    )
    cache.flush(writes={"t": torch.tensor([3])})
    assert bool((store.gather(torch.tensor([3]))[0] == 7).all())
    assert cache.stats()["t"]["rows_flushed"] == 3 + 1  # counted whether written here or by another rank


def test_a_collective_store_is_written_by_every_rank_even_with_no_rows_of_its_own():
    from torchrec_lookahead.modules._moves import write_rows

    class Collective(TensorStore):
        @property
        def collective(self) -> bool:
            return True

    store, calls = Collective(10, 4, name="t"), []

    def write(ids, weights, states):
        calls.append(ids.tolist())

    for allowed in (torch.tensor([2]), torch.tensor([], dtype=torch.int64)):
        write_rows(write, store, torch.tensor([1, 2]), torch.ones(2, 4), {}, allowed)
    write_rows(
        write, TensorStore(10, 4, name="u"), torch.tensor([1]), torch.ones(1, 4), {}, torch.tensor([2])
    )
    assert calls == [[2], []]  # a local store is not written without a row of this rank


def test_gather_global_kjt_keeps_weights_on_one_rank():
    import torch.distributed as dist

    from torchrec_lookahead.distributed.lockstep import gather_global_kjt

    from ..conftest import free_port

    already = dist.is_initialized()
    if not already:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        kjt = KeyedJaggedTensor(
            keys=["a"],
            values=torch.tensor([1, 2, 3]),
            lengths=torch.tensor([1, 2]),
            weights=torch.tensor([0.5, 2.0, 3.0]),
        )
        out = gather_global_kjt(kjt, 1, None)
        assert out.values().tolist() == [1, 2, 3] and out.weights().tolist() == [0.5, 2.0, 3.0]
    finally:
        if not already:  # leave no global process group behind for the tests that follow
            dist.destroy_process_group()
    assert dist.is_initialized() == already
