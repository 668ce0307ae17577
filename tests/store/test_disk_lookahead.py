"""DiskStore's lookahead host policy: equal to TensorStore whatever the hints (right, wrong, extra, late) and under
a device cache's traffic, the host budget respected, no more rows read from disk than the LRU policy under a
cache and fewer re-reads where keeping the host tier exclusive of the device cache wins, options refused."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch

from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.store import DiskStore, TensorStore
from torchrec_lookahead.store._disk_lookahead import NEVER
from torchrec_lookahead.store.init import INIT_BLOCK_ROWS

N, D = 20000, 4
WIDTHS = {"momentum1": D, "momentum2": 1}
ROW_BYTES = (D + D + 1) * 4


def _disk(path: Path, budget_rows: int, **kwargs: Any) -> DiskStore:
    return DiskStore(
        path, N, D, WIDTHS, name="t", seed=5, host_budget_bytes=budget_rows * ROW_BYTES, **kwargs
    )


def _stream(steps: int, seed: int = 0) -> List[torch.Tensor]:
    """Each step's ids: a reused head, a tail, and rows of the step before (reuse at every distance)."""
    gen = torch.Generator().manual_seed(seed)
    out: List[torch.Tensor] = []
    for _ in range(steps):
        n = int(torch.randint(50, 300, (1,), generator=gen))
        hot = torch.randint(0, 600, (n,), generator=gen)
        tail = torch.randint(0, N, (n,), generator=gen)
        ids = torch.where(torch.rand(n, generator=gen) < 0.6, hot, tail)
        if out:
            ids = torch.cat([ids, out[-1][: n // 3]])
        out.append(ids)
    return out


def _wait_idle(store: DiskStore, hang_s: float = 120.0) -> None:
    """Until the background thread has read every step it may read now (a test's determinism): woken by the
    store's condition when a read ends, and checking again every 10 ms (the thread may find nothing to read
    without notifying). ``hang_s`` only bounds a hang; reaching it fails the test instead of going on."""
    deadline = time.monotonic() + hang_s
    with store._wake:
        while not (store._next_prefetch() is None and store._written is None):
            assert time.monotonic() < deadline, (
                f"the store's background reads did not end within {hang_s:g} s"
            )
            store._wake.wait(timeout=0.01)


@pytest.mark.parametrize("budget_rows", [1, 64, 400, N])
@pytest.mark.parametrize("hints", ["right", "wrong", "extra", "none"])
def test_equals_tensor_store_whatever_the_hints(tmp_path: Path, budget_rows: int, hints: str) -> None:
    disk = _disk(tmp_path / "t.rows", budget_rows, host_policy="lookahead", disk_prefetch_depth=4)
    ref = TensorStore(N, D, WIDTHS, name="t", seed=5, chunk_rows=INIT_BLOCK_ROWS)
    gen = torch.Generator().manual_seed(1)
    stream = _stream(40)
    for step, ids in enumerate(stream):
        for ahead in range(step, min(step + 6, len(stream))):  # hints arrive ahead, some repeatedly
            if hints == "right":
                disk.plan_reads(ahead, stream[ahead])
            elif hints == "wrong":
                disk.plan_reads(ahead, torch.randint(0, N, (200,), generator=gen))
            elif hints == "extra":
                disk.plan_reads(
                    ahead, torch.cat([stream[ahead], torch.randint(-5, N + 5, (100,), generator=gen)])
                )
        disk.at_step(step)
        w, s = disk.gather(ids)
        rw, rs = ref.gather(ids)
        assert torch.equal(w, rw) and all(torch.equal(s[k], rs[k]) for k in rs), step
        upd = torch.unique(ids)
        weights = torch.randn(upd.numel(), D, generator=gen)
        states = {
            "momentum1": torch.rand(upd.numel(), D, generator=gen),
            "momentum2": torch.rand(upd.numel()),
        }
        (disk.scatter if step % 2 else disk.write_back)(upd, weights, states)
        ref.scatter(upd, weights, states)
        assert disk.stats()["host_rows"] <= disk.host_capacity
    assert torch.equal(disk.full_weights(), ref.full_weights())
    sa, sb = disk.full_states(), ref.full_states()
    assert all(torch.equal(sa[k], sb[k]) for k in sb)
    disk.close()
    again = DiskStore.open(tmp_path / "t.rows", host_budget_bytes=64 * ROW_BYTES)
    assert torch.equal(again.full_weights(), ref.full_weights())
    again.close()


def _device_plans(stream: List[torch.Tensor], capacity: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Per step, the (fetched, evicted) ids of an LRU device cache of ``capacity`` rows over ``stream``: the
    traffic a host tier sees under a cache (every row the cache evicts is written back)."""
    cached: Dict[int, None] = {}  # insertion order: least recently used first
    plans = []
    for ids in stream:
        uniq = torch.unique(ids).tolist()
        now = set(uniq)
        for i in uniq:
            if i in cached:
                cached[i] = cached.pop(i)
        fetch = [i for i in uniq if i not in cached]
        over = len(cached) + len(fetch) - capacity
        evict = [i for i in cached if i not in now][: max(over, 0)]
        for i in evict:
            del cached[i]
        cached.update(dict.fromkeys(fetch))
        plans.append((torch.tensor(fetch, dtype=torch.long), torch.tensor(evict, dtype=torch.long)))
    return plans


def _run_cache(
    tmp_path: Path,
    policy: str,
    budget_rows: int,
    plans: List[Tuple[torch.Tensor, torch.Tensor]],
    lead: int = 8,
    uses: Optional[List[torch.Tensor]] = None,
    uses_lead: int = 0,
) -> Dict[str, int]:
    """Drive a disk store as a device cache does (write-backs of step ``t``'s evictions, then its gather; hints
    ``lead`` steps ahead, and with ``uses`` each step's looked-up ids ``uses_lead`` steps ahead, as the planner
    reads batches; every row updated at every step it is cached for), checking every gathered value and the
    final tables against a TensorStore driven alike. Returns the disk store's counters."""
    disk = _disk(tmp_path / f"{policy}.rows", budget_rows, host_policy=policy, disk_prefetch_depth=lead)
    ref = TensorStore(N, D, WIDTHS, name="t", seed=5, chunk_rows=INIT_BLOCK_ROWS)
    device: Dict[int, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def write_back(store: Any, ids: torch.Tensor) -> None:
        w = torch.stack([device[i][0] for i in ids.tolist()])
        m1 = torch.stack([device[i][1] for i in ids.tolist()])
        m2 = torch.stack([device[i][2] for i in ids.tolist()])
        store.write_back(ids, w, {"momentum1": m1, "momentum2": m2})

    for ahead in range(min(lead, len(plans))):
        disk.plan_reads(ahead, plans[ahead][0])
    for ahead in range(1, min(uses_lead, len(plans))) if uses else ():
        disk.plan_uses(ahead, uses[ahead])
    for step, (fetch, evict) in enumerate(plans):
        if step + lead < len(plans):
            disk.plan_reads(step + lead, plans[step + lead][0])
        if uses and step + uses_lead < len(plans):
            disk.plan_uses(step + uses_lead, uses[step + uses_lead])
        if evict.numel():
            write_back(disk, evict)
            write_back(ref, evict)
            for i in evict.tolist():
                del device[i]
        disk.at_step(step)
        if policy == "lookahead":
            _wait_idle(disk)
        if fetch.numel():
            (w, s), (rw, rs) = disk.gather(fetch), ref.gather(fetch)
            assert torch.equal(w, rw) and all(torch.equal(s[k], rs[k]) for k in rs), step
            for j, i in enumerate(fetch.tolist()):
                device[i] = (w[j].clone(), s["momentum1"][j].clone(), s["momentum2"][j].clone())
        for i, (w_i, m1, m2) in device.items():  # a training step: every cached row changes
            device[i] = (w_i + 0.5 * (i % 7) - 1.0, m1 + 0.25, m2 * 0.5 + step)
        assert disk.stats()["host_rows"] <= disk.host_capacity
    ids = torch.tensor(sorted(device), dtype=torch.long)
    write_back(disk, ids)
    write_back(ref, ids)
    assert torch.equal(disk.full_weights(), ref.full_weights())
    sa, sb = disk.full_states(), ref.full_states()
    assert all(torch.equal(sa[k], sb[k]) for k in sb)
    stats = disk.stats()
    disk.close()
    return stats


def test_lookahead_reads_no_more_rows_than_lru_under_a_cache(tmp_path: Path) -> None:
    plans = _device_plans(_stream(80, seed=3), capacity=500)
    lru = _run_cache(tmp_path, "lru", 800, plans)
    ahead = _run_cache(tmp_path, "lookahead", 800, plans)
    # a row is computed at its first fetch under both (then the device cache writes it back)
    assert lru["rows_initialised"] == ahead["rows_initialised"] and lru["rows_first_read"] == 0
    assert ahead["rows_read"] <= lru["rows_read"], (ahead, lru)
    assert ahead["rows_reread"] < lru["rows_reread"], (ahead, lru)


def _next_use_by_step(store: DiskStore) -> np.ndarray:
    """``_next_use`` by its definition, one hinted step at a time (the nearest last, so it wins): per slot of the
    host tier, the first step from the gathered one whose read hint names its row (not counting the gathered
    step's own read of a row the device cache holds), or after it whose use hint names a row the device cache
    does not hold."""
    tier, now = store._tier, store._step
    nxt = np.full(tier.capacity, NEVER, dtype=np.int64)
    for s in sorted(set(store._hints) | set(store._uses), reverse=True):
        if s in store._uses and s > now:
            slots = tier.find(store._uses[s])
            slots = slots[slots >= 0]
            nxt[slots[~tier.dead[slots]]] = s
        if s in store._hints and s >= now:
            slots = tier.find(store._hints[s])
            slots = slots[slots >= 0]
            nxt[slots[~tier.dead[slots]] if s == now else slots] = s
    return nxt


def _next_use_of_by_step(store: DiskStore, ids: np.ndarray) -> np.ndarray:
    """``_next_use_of`` by its definition: the first step after the gathered one whose read or use hint names
    each of ``ids``."""
    nxt = np.full(ids.size, NEVER, dtype=np.int64)
    for s in sorted(set(store._hints) | set(store._uses), reverse=True):
        if s > store._step:
            for hinted in (store._hints.get(s), store._uses.get(s)):
                if hinted is not None:
                    nxt[np.isin(ids, hinted)] = s
    return nxt


def test_next_uses_from_the_merged_hints_equal_their_definition(tmp_path: Path, monkeypatch) -> None:
    """The lookahead policy ranks rows by their next use from one index of the hints per gathered step, kept
    current as hints arrive, and a background read counts the rows needed by its step from those steps' hints alone:
    at every call over a cache's traffic (read and use hints, background reads, write-backs of rows the tier lacks)
    each equals its definition, step by step."""
    checked = {"slots": 0, "written": 0, "room": 0}
    next_use, next_use_of, needed_by = DiskStore._next_use, DiskStore._next_use_of, DiskStore._needed_by

    def checked_next_use(self: DiskStore) -> np.ndarray:
        out = next_use(self)
        assert np.array_equal(out, _next_use_by_step(self)), self._step
        checked["slots"] += 1
        occupied = self._tier.id_of >= 0
        for step in range(self._step, self._step + 6):  # the rows needed by each coming step, this one's too
            assert needed_by(self, step) == int((occupied & (out <= step)).sum()), (self._step, step)
        return out

    def checked_next_use_of(self: DiskStore, ids: np.ndarray) -> np.ndarray:
        out = next_use_of(self, ids)
        assert np.array_equal(out, _next_use_of_by_step(self, ids)), self._step
        checked["written"] += 1
        return out

    def checked_needed_by(self: DiskStore, step: int) -> int:
        out = needed_by(self, step)
        occupied = self._tier.id_of >= 0
        assert out == int((occupied & (_next_use_by_step(self) <= step)).sum()), (self._step, step)
        checked["room"] += 1
        return out

    monkeypatch.setattr(DiskStore, "_next_use", checked_next_use)
    monkeypatch.setattr(DiskStore, "_needed_by", checked_needed_by)
    monkeypatch.setattr(DiskStore, "_next_use_of", checked_next_use_of)
    stream = _stream(60, seed=7)
    plans = _device_plans(stream, capacity=400)
    _run_cache(tmp_path, "lookahead", 600, plans, lead=3, uses=stream, uses_lead=12)
    assert checked["slots"] > 20 and checked["written"] > 20 and checked["room"] > 20, checked


def test_lookahead_keeps_the_rows_the_device_cache_does_not_hold(tmp_path: Path) -> None:
    """A cycle over 500 rows, 50 a step, under a device cache of two steps' rows and a host tier of 460: LRU
    keeps the rows the device cache holds too and re-reads nearly every row of every cycle; exclusive of the device
    cache, the host tier holds every other row of the cycle and re-reads none."""
    steps, rows = 40, 50
    stream = [torch.arange((s % 10) * rows, (s % 10 + 1) * rows) for s in range(steps)]
    plans = _device_plans(stream, capacity=2 * rows)
    lru = _run_cache(tmp_path, "lru", 460, plans)
    ahead = _run_cache(tmp_path, "lookahead", 460, plans)
    assert lru["rows_initialised"] == ahead["rows_initialised"] == 500  # first fetches: computed
    assert lru["rows_reread"] >= 0.9 * (steps - 10) * rows, lru  # a cycle longer than the tier: LRU misses
    assert ahead["rows_reread"] == 0, ahead


def test_use_hints_keep_the_rows_a_batch_past_the_read_hints_looks_up(tmp_path: Path) -> None:
    """Group x is fetched again and again (popular), group y once; then fresh groups flow through a host tier of
    four groups (two of them for the rows read ahead), and y is looked up again, past the read hints (2 steps) but
    within the use hints (30 steps): ranked by popularity the host tier keeps x, which is never used again, and
    re-reads y; told the uses, it keeps y and re-reads nothing."""
    rows = 50
    group = {name: torch.arange(i * rows, (i + 1) * rows) for i, name in enumerate(("x", "y"))}
    fresh = [torch.arange((2 + i) * rows, (3 + i) * rows) for i in range(40)]
    stream = []
    for i in range(
        6
    ):  # x every third step: evicted from the two-group device cache and fetched again each time
        stream += [group["x"], fresh[2 * i], fresh[2 * i + 1]]
    stream += [group["y"], *fresh[12:24], group["y"]]
    plans = _device_plans(stream, capacity=2 * rows)
    without = _run_cache(tmp_path / "a", "lookahead", 4 * rows, plans, lead=2)
    told = _run_cache(tmp_path / "b", "lookahead", 4 * rows, plans, lead=2, uses=stream, uses_lead=30)
    assert without["rows_initialised"] == told["rows_initialised"]
    assert told["rows_reread"] + rows <= without["rows_reread"], (told, without)


def _written(path: Path, rows: torch.Tensor, budget_rows: int, depth: int) -> DiskStore:
    """A lookahead store at ``path`` whose ``rows`` are on disk (written, then reopened with an empty host tier of
    ``budget_rows`` reading ``depth`` steps ahead)."""
    disk = _disk(path, rows.numel())
    n = rows.numel()
    disk.scatter(rows, torch.ones(n, D), {k: torch.zeros(n, w) for k, w in WIDTHS.items()})
    disk.close()
    return DiskStore.open(
        path, host_budget_bytes=budget_rows * ROW_BYTES, host_policy="lookahead", disk_prefetch_depth=depth
    )


def test_prefetched_rows_are_host_hits(tmp_path: Path) -> None:
    disk = _written(tmp_path / "t.rows", torch.arange(100, 400), budget_rows=1000, depth=2)
    disk.at_step(0)
    disk.plan_reads(2, torch.arange(100, 500))  # rows 400.. were never written: not read in the background
    _wait_idle(disk)
    assert disk.stats()["rows_prefetched"] == 300
    disk.at_step(2)
    disk.gather(torch.arange(100, 500))
    st = disk.stats()
    assert st["host_hits"] == 300 and st["rows_read"] == 300 and st["rows_initialised"] == 100
    disk.close()


def test_a_prefetch_never_evicts_rows_needed_sooner(tmp_path: Path) -> None:
    disk = _written(tmp_path / "t.rows", torch.arange(0, 2000), budget_rows=100, depth=3)
    disk.at_step(0)
    disk.gather(torch.arange(0, 100))  # the tier is full
    disk.plan_reads(1, torch.arange(0, 60))  # needed next: kept
    disk.plan_reads(3, torch.arange(1000, 1040))  # room: the 40 rows no step needs
    _wait_idle(disk)
    assert disk.stats()["rows_prefetched"] == 40
    disk.at_step(1)
    before = disk.stats()["rows_read"]
    disk.gather(torch.arange(0, 60))
    assert disk.stats()["rows_read"] == before
    disk.close()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"host_policy": "fifo"}, "host_policy must be one of"),
        ({"host_policy": "lookahead", "disk_prefetch_depth": -1}, "disk_prefetch_depth must be an int >= 0"),
        ({"disk_prefetch_depth": 1.5}, "disk_prefetch_depth must be an int >= 0"),
    ],
)
def test_bad_policy_options_are_refused(tmp_path: Path, kwargs: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _disk(tmp_path / "t.rows", 10, **kwargs)


@pytest.mark.parametrize(
    "kwargs, depth", [({}, 0), ({"host_policy": "lookahead", "disk_prefetch_depth": 3}, 3)]
)
def test_the_host_window_is_one_step_under_lru_and_the_prefetch_window_under_lookahead(
    tmp_path: Path, kwargs: Any, depth: int
) -> None:
    store = _disk(tmp_path / "t.rows", 10, **kwargs)
    window = store.host_window
    assert (window.depth, window.bounds, window.rows) == (depth, (0, store.num_embeddings), (10,))
    assert window.policy == store.host_policy and window.row_bytes == store.row_width * 4
    store.close()
