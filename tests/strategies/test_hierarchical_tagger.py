"""The tagger: HT's rules, the greedy refinement against the cost model, determinism, user overrides and the
placement table."""

from __future__ import annotations

import pytest
from torch import nn

from torchrec_lookahead.strategies._splits import LayerPlacement, consecutive_pairs, dense_linears
from torchrec_lookahead.strategies._tagger import CostModel, _costs, _total, layer_cost, tag

C, R, P = LayerPlacement.COLWISE, LayerPlacement.ROWWISE, LayerPlacement.REPLICATE


def _mlp() -> nn.Module:
    # widen then narrow (a co-partitioned pair), then a big square layer, then a tiny head
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 1))


def _tag(model: nn.Module, **kw):  # type: ignore[no-untyped-def]
    return tag(model, dense_linears(model), CostModel(**{"batch_size": 32, "group_size": 2, **kw}))


def test_rules_copartition_a_widening_layer_followed_by_a_narrowing_one() -> None:
    t = tag(_mlp(), dense_linears(_mlp()), CostModel(batch_size=32, group_size=2), refine=False)
    assert (t.placement["0"], t.placement["2"]) == (C, R)
    assert t.placement["4"] is P  # 64 -> 1: nothing worth splitting, and 1 column cannot be split


def test_greedy_refinement_never_raises_the_cost_and_is_deterministic() -> None:
    m = _mlp()
    lin = dense_linears(m)
    pairs = consecutive_pairs(m, lin)
    for kw in ({}, {"batch_size": 4096}, {"num_groups": 4, "cross_bytes_per_s": 1e8}):
        cm = CostModel(**{"batch_size": 32, "group_size": 2, **kw})
        rules = tag(m, lin, cm, refine=False)
        refined = tag(m, lin, cm)
        assert _total(_costs(lin, refined.placement, pairs, cm), cm) <= _total(
            _costs(lin, rules.placement, pairs, cm), cm
        )
        assert tag(m, lin, cm).placement == refined.placement


def test_large_batches_make_splitting_too_expensive() -> None:
    # activations outweigh the weights: every layer stays replicated
    assert set(_tag(_mlp(), batch_size=1 << 16).placement.values()) == {P}


def test_a_memory_budget_forces_splits() -> None:
    m = nn.Sequential(nn.Linear(256, 256))
    free = _tag(m, batch_size=1 << 14)
    assert free.placement["0"] is P
    tight = _tag(m, batch_size=1 << 14, memory_bytes=256 * 256 * 4 * 3 // 4)
    assert tight.placement["0"] in (C, R)


def test_user_placements_are_kept() -> None:
    m = _mlp()
    t = tag(m, dense_linears(m), CostModel(batch_size=32, group_size=2), fixed={"0": P, "4": P})
    assert t.placement["0"] is P and t.placement["4"] is P


def test_without_copartitioning_a_pair_pays_its_gathers() -> None:
    cm = CostModel(batch_size=32, group_size=2)
    lin = nn.Linear(64, 512)
    assert layer_cost(lin, C, False, cm).group_bytes > layer_cost(lin, C, True, cm).group_bytes


def test_table_lists_every_layer_like_the_planner() -> None:
    table = _tag(_mlp()).table().splitlines()
    assert table[0].split(" | ")[0].strip() == "module" and "bytes sent/step" in table[0]
    assert len(table) == 2 + 3 and "512x64" in table[2]


@pytest.mark.parametrize("g", [1, 3])
def test_group_sizes_that_divide_nothing_replicate(g: int) -> None:
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert set(_tag(m, group_size=g).placement.values()) == {P}
