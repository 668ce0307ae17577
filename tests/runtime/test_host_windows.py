"""The host-tier capacity check: per-shard window counts against a naive reference, the pre-scan's refusal of a
window a disk store's host tier cannot hold (after the device check, the same facts), and a stream with pinned
rows over a read-ahead host tier."""

from typing import Dict, List

import numpy as np
import pytest
import torch

from torchrec_lookahead import CapacityError, ConfigError
from torchrec_lookahead.runtime._host_windows import HostWindowCheck
from torchrec_lookahead.runtime.capacity import check_stream
from torchrec_lookahead.store.types import HostWindow


def _naive(stream: List[np.ndarray], depth: int, bounds: List[int]) -> List[List[int]]:
    """Per batch, the distinct ids of the window ending there (it and the ``depth`` before it) on each shard."""
    out = []
    for step in range(len(stream)):
        window = set(np.concatenate(stream[max(step - depth, 0) : step + 1]).tolist())
        out.append([sum(lo <= i < hi for i in window) for lo, hi in zip(bounds, bounds[1:])])
    return out


@pytest.mark.parametrize("depth", [0, 1, 3])
@pytest.mark.parametrize("bounds", [[0, 500], [0, 170, 340, 500]])
def test_window_counts_equal_a_naive_reference(depth: int, bounds: List[int]) -> None:
    rng = np.random.default_rng(depth + len(bounds))
    stream = [rng.integers(0, 500, rng.integers(0, 80)) for _ in range(30)]  # repeats, empty batches
    expected = _naive(stream, depth, bounds)
    rows = tuple(max(e[s] for e in expected) - 1 for s in range(len(bounds) - 1))
    check = HostWindowCheck({"t": HostWindow(depth, tuple(bounds), rows)})
    first = None
    for step, ids in enumerate(stream):
        short = check.push({"t": ids})
        assert check._tables["t"].inside.tolist() == expected[step], step
        over = [s for s, n in enumerate(expected[step]) if n > rows[s]]
        assert [(f.shard, f.needed, f.available) for f in short] == [
            (s, expected[step][s], rows[s]) for s in over[:1]
        ]
        if short and first is None:
            first = short[0]
    assert first is not None and first.hi == first.lo + min(depth, first.hi)
    assert check.largest == {"t": max(max(e) for e in expected)}


def _stream() -> List[Dict[str, torch.Tensor]]:
    return [{"f": torch.tensor(ids)} for ids in ([1, 2, 3], [3, 4], [5, 6, 7, 8], [1])]


def test_the_pre_scan_refuses_a_host_window_naming_tier_table_batch_and_rows() -> None:
    lookahead = HostWindow(1, (0, 100), (5,), "lookahead", row_bytes=36)
    with pytest.raises(
        CapacityError, match=r"batches 1\.\.2 need 6 rows in the host tier .* holds 5"
    ) as info:
        check_stream(_stream(), {"t": 10}, {"f": "t"}, {"t": 100}, 1, {"t": lookahead})
    assert info.value.facts == {"table": "t", "batch": 2, "needed": 6, "available": 5, "tier": "host"}
    assert "at least 6 rows (216 bytes)" in str(info.value) and "disk_prefetch_depth=1" in str(info.value)
    # at the need it passes, and the device capacities' answer is unchanged
    assert check_stream(
        _stream(), {"t": 10}, {"f": "t"}, {"t": 100}, 1, {"t": HostWindow(1, (0, 100), (6,))}
    ) == {"t": 6}
    lru = HostWindow(0, (0, 100), (3,), "lru")
    with pytest.raises(CapacityError, match=r"batch 2 needs 4 rows .*every row a step fetches") as info:
        check_stream(_stream(), {"t": 10}, {"f": "t"}, {"t": 100}, 1, {"t": lru})
    assert (info.value.batch, info.value.needed, info.value.available, info.value.tier) == (2, 4, 3, "host")


def test_a_short_device_cache_is_reported_first_with_its_message_unchanged() -> None:
    with pytest.raises(CapacityError, match=r"need 6 cache rows but capacity\['t'\] is 5") as info:
        check_stream(_stream(), {"t": 5}, {"f": "t"}, {"t": 100}, 1, {"t": HostWindow(0, (0, 100), (1,))})
    assert info.value.tier == "device"


def test_the_shard_of_a_sharded_host_tier_is_named() -> None:
    window = HostWindow(0, (0, 4, 100), (10, 1))
    with pytest.raises(CapacityError, match=r"shard 1 of 2, rows \[4, 100\)\) but it holds 1") as info:
        check_stream(_stream(), {"t": 10}, {"f": "t"}, {"t": 100}, 1, {"t": window})
    assert (info.value.batch, info.value.needed) == (2, 4)  # batch 1's ids 3 and 4: only 4 on shard 1


def test_fae_pinned_rows_over_a_disk_tier_read_ahead_train_as_resident(tmp_path) -> None:
    """The host windows of a stream with pinned rows were renumbered below the hot ids while the cold batches keep
    the tables' own ids: an IndexError in the planner's check (the read-ahead tier's window counts) once a cold id
    passed the renumbered table's end."""
    from torchrec_lookahead.verify import verify

    from ..conftest import REPO

    disk = tmp_path / "disk.yaml"
    disk.write_text(
        "trainer:\n  strategy:\n    class_path: torchrec_lookahead.strategies.TorchRecStrategy\n"
        "    init_args:\n      sharders:\n"
        "        - class_path: torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder\n"
        "          init_args:\n            capacity: {t_cat_2: 200, t_cat_11: 160, t_cat_15: 150}\n"
        f"            store: disk\n            store_dir: {tmp_path / 'stores'}\n"
        "            host_budget_bytes: 60000\n"
        "            disk_options: {host_policy: lookahead, disk_prefetch_depth: 1}\n"
    )
    out = verify(
        str(REPO / "configs" / "dlrm_tiny_fae_lookahead.yaml"), steps=12, overrides=["--config", str(disk)]
    )
    assert out["passed"] and out["max_abs_weight_diff"] == 0.0 and out["max_abs_loss_diff"] == 0.0, out


def test_a_host_window_is_validated() -> None:
    with pytest.raises(ConfigError, match="host window needs"):
        HostWindow(0, (0, 10), (1, 2))
    with pytest.raises(ConfigError, match="host window needs"):
        HostWindow(-1, (0, 10), (1,))


def test_a_one_int_host_budget_is_quoted_as_the_int_that_holds_every_short_table() -> None:
    """With one ``host_budget_bytes`` split over the tables by size (``budget_split``: the tables' bytes and this
    table's), the refusal quotes the int whose shares hold every short table's largest window."""
    stream = [
        {"f": torch.tensor(a), "g": torch.tensor(b)} for a, b in (([1, 2, 3], [1]), ([4], [2, 3, 4, 5, 6]))
    ]
    windows = {  # t: a third of the int, 2 rows; u: two thirds, 1 row; 10 bytes a row
        "t": HostWindow(0, (0, 100), (2,), "lru", row_bytes=10, budget_split=(3000, 1000)),
        "u": HostWindow(0, (0, 200), (1,), "lru", row_bytes=10, budget_split=(3000, 2000)),
    }
    with pytest.raises(CapacityError, match="needs 3 rows") as info:
        check_stream(stream, {"t": 10, "u": 10}, {"f": "t", "g": "u"}, {"t": 100, "u": 200}, 1, windows)
    # t needs 3 rows (30 bytes, 90 of the int), u needs 5 (50 bytes, 75 of the int): 90 holds both
    assert "one int for all tables: host_budget_bytes >= 90" in str(info.value), str(info.value)
    per_table = {t: HostWindow(0, w.bounds, w.rows, "lru", row_bytes=10) for t, w in windows.items()}
    with pytest.raises(CapacityError) as info:
        check_stream(stream, {"t": 10, "u": 10}, {"f": "t", "g": "u"}, {"t": 100, "u": 200}, 1, per_table)
    assert "one int" not in str(info.value)
