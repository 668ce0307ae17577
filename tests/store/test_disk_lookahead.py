"""DiskStore's lookahead host policy: equal to TensorStore whatever the hints (right, wrong, extra, late), the
host budget respected, fewer rows read from disk than the LRU policy on a stream with reuse, options refused."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, List

import pytest
import torch

from torchrec_lookahead.errors import ConfigError
from torchrec_lookahead.store import DiskStore, TensorStore
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


def _reads(tmp_path: Path, policy: str, budget_rows: int) -> int:
    """Rows read from disk over a stream with reuse, gathers and write-backs as a cache makes them."""
    disk = _disk(tmp_path / f"{policy}.rows", budget_rows, host_policy=policy, disk_prefetch_depth=8)
    stream = _stream(80, seed=3)
    depth = 8
    for ahead in range(min(depth + 1, len(stream))):
        disk.plan_reads(ahead, stream[ahead])
    for step, ids in enumerate(stream):
        if step + depth + 1 < len(stream):
            disk.plan_reads(step + depth + 1, stream[step + depth + 1])
        disk.at_step(step)
        if policy == "lookahead":
            _wait_idle(disk)
        disk.gather(ids)
    reads = disk.stats()["rows_read"]
    assert disk.stats()["host_rows"] <= disk.host_capacity
    disk.close()
    return reads


def test_lookahead_reads_fewer_rows_than_lru_at_the_same_memory(tmp_path: Path) -> None:
    lru = _reads(tmp_path, "lru", 800)
    ahead = _reads(tmp_path, "lookahead", 800)
    assert ahead <= 0.9 * lru, (ahead, lru)  # 7835 against 9027 rows


def test_prefetched_rows_are_host_hits(tmp_path: Path) -> None:
    disk = _disk(tmp_path / "t.rows", 1000, host_policy="lookahead", disk_prefetch_depth=2)
    disk.at_step(0)
    disk.plan_reads(2, torch.arange(100, 400))
    _wait_idle(disk)
    assert disk.stats()["rows_prefetched"] == 300
    disk.at_step(2)
    disk.gather(torch.arange(100, 400))
    st = disk.stats()
    assert st["host_hits"] == 300 and st["rows_read"] == 300
    disk.close()


def test_a_prefetch_never_evicts_rows_needed_sooner(tmp_path: Path) -> None:
    disk = _disk(tmp_path / "t.rows", 100, host_policy="lookahead", disk_prefetch_depth=3)
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
    from torchrec_lookahead.distributed.lrpp import WriterFilteredStore

    store = _disk(tmp_path / "t.rows", 10, **kwargs)
    window = store.host_window
    assert (window.depth, window.bounds, window.rows) == (depth, (0, store.num_embeddings), (10,))
    assert window.policy == store.host_policy and window.row_bytes == store.row_width * 4
    assert WriterFilteredStore(store).host_window == window
    store.close()
