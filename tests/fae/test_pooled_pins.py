"""FAE's pinned hot rows in a shared cache (the default pooled layout: one cache per kernel group, shared by its
tables): the room, the capacity report and the refusals speak of the shared cache against the sum of its tables'
capacities, in the words of the non-FAE report, and a table whose hot rows exceed its own share trains exactly."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, List

import pytest
import torch

from torchrec_lookahead.errors import CapacityError
from torchrec_lookahead.fae import PinnedRows
from torchrec_lookahead.verify import verify

from .test_lookahead import CAPACITY, TINY, _fit

SHARED = "tables t_cat_2, t_cat_11, t_cat_15 (one shared cache)"


def test_a_shared_caches_room_is_the_sum_of_its_tables() -> None:
    """Table a pins 3 hot rows with a capacity of 2: its cache, shared with b, has room (it was refused as 'pins
    3 hot rows in a cache of 2 rows'); every table keeps a dynamic slot, the cache's total kept."""
    hot = {"a": torch.tensor([1, 2, 3]), "b": torch.tensor([0])}
    pins = PinnedRows(hot, {"fa": "a", "fb": "b"}, {"a": 2, "b": 5}, {"a": 9, "b": 9}, {"s": ("a", "b")})
    dyn = pins.dynamic_capacity()
    assert dyn == {"a": 1, "b": 2} and sum(dyn.values()) == 7 - 4
    assert pins.summary() == [
        "tables a, b (one shared cache): 4 pinned + 3 dynamic slots",
        "  each table's pinned rows: a 3, b 1",
    ]
    with pytest.raises(CapacityError) as err:
        PinnedRows(hot, {"fa": "a", "fb": "b"}, {"a": 2, "b": 3}, {"a": 9, "b": 9}, {"s": ("a", "b")})
    msg = str(err.value)
    assert msg.startswith(
        "the cache shared by tables ['a', 'b'] (the sum of their capacities, 5 rows) pins 4 hot rows (a 3, b 1), "
        "which leaves no room for the cold rows"
    ), msg
    assert (err.value.table, err.value.needed, err.value.available) == ("s", 6, 5)


def _reports(monkeypatch: Any) -> List[str]:
    from torchrec_lookahead.fae import lookahead as module

    seen: List[str] = []
    real = module.report_text

    def record(trainer: Any, tag: str, text: str) -> None:
        seen.append(text)
        real(trainer, tag, text)

    monkeypatch.setattr(module, "report_text", record)
    return seen


def test_the_cold_capacity_report_gives_the_shared_caches_need(tmp_path: Path, monkeypatch: Any) -> None:
    """It printed each table's cold need as a dict against nothing ("need {'t_cat_2': 45, ...} dynamic cache
    rows", t_cat_2 with 3 dynamic slots of its own)."""
    seen = _reports(monkeypatch)
    _fit(tmp_path, max_steps=2)
    pinned, check = seen
    assert re.fullmatch(rf"Pinned hot rows in the lookahead cache:\n  {re.escape(SHARED)}: (\d+) pinned \+ (\d+) "
                        r"dynamic slots\n    each table's pinned rows: t_cat_2 \d+, t_cat_11 \d+, t_cat_15 \d+",
                        pinned), pinned  # fmt: skip
    lines = check.splitlines()
    assert lines[0].endswith("the largest windows read need, of each cache's rows:"), check
    total = sum(CAPACITY.values())
    m = re.fullmatch(rf"  {re.escape(SHARED)}: (\d+) of {total} cache rows \((\d+) pinned hot rows and the "
                     r"windows' (\d+)\)", lines[1])  # fmt: skip
    assert m and int(m[1]) == int(m[2]) + int(m[3]), check
    assert re.fullmatch(r"    each table's own windows: t_cat_2 \d+ \(and \d+ pinned\), .*", lines[2]), check


def test_a_shared_cache_too_small_for_the_cold_windows_names_what_it_needs(tmp_path: Path) -> None:
    """The refusal spoke of the dynamic rows as the tables' capacities ("the sum of their capacities, 22 rows"
    for capacities of 180) and of a need without the pinned rows: raising the capacities to it failed again."""
    small = {t: 60 for t in CAPACITY}
    with pytest.raises(CapacityError) as err:
        _fit(tmp_path / "a", max_steps=2, capacity=small)
    msg = str(err.value)
    assert msg.startswith("the cache shared by tables ['t_cat_2', 't_cat_11', 't_cat_15'] (the sum of their "
                          "capacities, 180 rows): batch 0 needs "), msg  # fmt: skip
    assert "cache rows besides their " in msg and "but it holds 180" in msg, msg
    need = err.value.needed
    assert f"need {need} rows for tables ['t_cat_2', 't_cat_11', 't_cat_15'] together (pinned hot rows" in msg
    # one retry with the capacity it names suffices
    _fit(tmp_path / "b", max_steps=2, capacity={**small, "t_cat_2": need - 120})


def test_a_table_pinning_more_than_its_share_trains_exactly(tmp_path: Path) -> None:
    """t_cat_2 pins more hot rows than its own capacity of 40; the shared cache has room: cached FAE equals
    resident training bit for bit."""
    import yaml

    override = tmp_path / "small.yaml"
    sharder = {
        "class_path": "torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder",
        "init_args": {"capacity": {**CAPACITY, "t_cat_2": 40}},
    }
    strategy = {
        "class_path": "torchrec_lookahead.strategies.TorchRecStrategy",
        "init_args": {"sharders": [sharder]},
    }
    override.write_text(yaml.safe_dump({"trainer": {"strategy": strategy}}))
    out = verify(TINY, steps=12, overrides=["--config", str(override)])
    assert out["passed"] and out["max_abs_weight_diff"] == 0.0 and out["steps"] == 12, out


@pytest.mark.parametrize("policy", ["belady", "ttl"])
def test_the_oracles_refusal_of_a_cold_window_speaks_of_the_whole_cache(
    tmp_path: Path, monkeypatch: Any, policy: str
) -> None:
    """Without the pre-scan (capacity_check="lookahead") the oracle refuses as it plans, in its dynamic slots: it
    said "the sum of their capacities, 22 rows" of capacities summing to 180, and asked for the dynamic need."""
    import functools

    from torchrec_lookahead.data import LookaheadDataModule

    from . import test_lookahead

    lookahead = functools.partial(LookaheadDataModule, capacity_check="lookahead", policy=policy)
    monkeypatch.setattr(test_lookahead, "LookaheadDataModule", lookahead)
    with pytest.raises(CapacityError) as err:
        _fit(tmp_path, max_steps=2, capacity={t: 60 for t in CAPACITY})
    msg = str(err.value)
    m = re.match(r"the cache shared by tables \['t_cat_2', 't_cat_11', 't_cat_15'\] \(the sum of their capacities, "
                 r"180 rows\): cold batch 0 \(counted among the cold batches\) needs (\d+) cache rows besides their "
                 r"(\d+) pinned hot rows but it holds 180; raise the capacities of these tables to at least (\d+) "
                 "together", msg)  # fmt: skip
    assert m and int(m[1]) + int(m[2]) == int(m[3]) == err.value.needed, msg
    assert err.value.available == 180, msg
