"""Contract 4 (nothing lost) and checkpoints: flush, state_dict / load_state_dict resume, memory-mapped stores."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from torchrec_lookahead.modules import CachedEmbeddingBagCollection, CacheOptimizerConfig
from torchrec_lookahead.store import MmapStore

from .cache_helpers import (
    SEED,
    cached_tables,
    loss_weights,
    make_batches,
    make_tables,
    max_table_diff,
    min_capacity,
    naive_plans,
    train_steps,
)

CONFIGS = [
    CacheOptimizerConfig("exact_row_wise_adagrad", learning_rate=0.1),
    CacheOptimizerConfig("adam", learning_rate=0.05),
]


def _setup(steps: int, cfg: CacheOptimizerConfig):
    tables = make_tables()
    batches = make_batches(tables, steps)
    probe = CachedEmbeddingBagCollection(tables, {"t0": 1, "t1": 1}, cfg)
    ids = [probe.table_ids(b) for b in batches]
    capacity = min_capacity(ids, ["t0", "t1"])
    return tables, batches, ids, capacity, loss_weights(steps, 24)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.optim.value)
def test_checkpoint_resume_equals_uninterrupted(cfg: CacheOptimizerConfig) -> None:
    steps, cut = 24, 11
    tables, batches, ids, capacity, weights = _setup(steps, cfg)
    full = CachedEmbeddingBagCollection(tables, capacity, cfg, seed=SEED)
    list(train_steps(full, batches, weights, naive_plans(ids, capacity)))

    first = CachedEmbeddingBagCollection(tables, capacity, cfg, seed=SEED)
    list(train_steps(first, batches[:cut], weights[:cut], naive_plans(ids[:cut], capacity)))
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = CachedEmbeddingBagCollection(
        tables, capacity, cfg, seed=SEED + 1
    )  # other init: all overwritten
    resumed.load_state_dict(torch.load(buf))
    assert all(bool((resumed.slot_ids(t) < 0).all()) for t in capacity)  # load leaves the cache empty
    plans = naive_plans(ids[cut:], capacity)  # a fresh planner: the plan stream restarts from an empty cache
    list(train_steps(resumed, batches[cut:], weights[cut:], plans))
    dw, ds = max_table_diff(cached_tables(full), cached_tables(resumed))
    assert dw == 0.0 and ds == 0.0, (dw, ds)


def test_flush_writes_every_cached_row_and_keeps_training() -> None:
    cfg = CONFIGS[0]
    tables, batches, ids, capacity, weights = _setup(10, cfg)
    ebc = CachedEmbeddingBagCollection(tables, capacity, cfg, seed=SEED)
    plans = naive_plans(ids, capacity)
    list(train_steps(ebc, batches[:6], weights[:6], plans[:6]))
    ebc.flush()
    for name, store in ebc.stores.items():
        slots = ebc.slot_ids(name)
        held = (slots >= 0).nonzero().flatten()
        w, s = store.gather(slots[held])
        assert torch.equal(w, ebc.cache_weights(name)[held])
        assert torch.equal(s["momentum1"], ebc.cache_states(name)["momentum1"][held])
        assert ebc.stats()[name]["rows_flushed"] == held.numel()
    list(train_steps(ebc, batches[6:], weights[6:], plans[6:]))  # the cache is still valid after flush


def test_mmap_store_training_equals_tensor_store_and_survives_reopen(tmp_path: Path) -> None:
    cfg = CONFIGS[0]
    tables, batches, ids, capacity, weights = _setup(20, cfg)
    plans = naive_plans(ids, capacity)
    widths = cfg.state_widths(8)
    store = MmapStore(tmp_path / "t0.bin", 200, 8, widths, name="t0", seed=SEED, chunk_rows=8192)
    mm = CachedEmbeddingBagCollection(tables, capacity, cfg, stores={"t0": store}, seed=SEED)
    ram = CachedEmbeddingBagCollection(tables, capacity, cfg, seed=SEED)
    for a, b in zip(train_steps(mm, batches, weights, plans), train_steps(ram, batches, weights, plans)):
        assert torch.equal(a, b)
    want = cached_tables(ram)
    assert max_table_diff(cached_tables(mm), want) == (0.0, 0.0)
    store.close()
    again = MmapStore.open(tmp_path / "t0.bin")
    assert torch.equal(again.full_weights(), want["t0"][0])
    assert torch.equal(again.full_states()["momentum1"], want["t0"][1]["momentum1"])
    again.close()


def test_load_state_dict_with_wrong_shape_changes_nothing() -> None:
    cfg = CONFIGS[0]
    tables, batches, ids, capacity, weights = _setup(4, cfg)
    ebc = CachedEmbeddingBagCollection(tables, capacity, cfg, seed=SEED)
    list(train_steps(ebc, batches, weights, naive_plans(ids, capacity)))
    before = cached_tables(ebc)
    slots = ebc.slot_ids("t0")
    sd = {k: v.clone() for k, v in ebc.state_dict().items()}
    sd["embedding_bags.t0.weight"] = torch.zeros(199, 8)
    with pytest.raises(RuntimeError, match="embedding_bags.t0.weight"):
        ebc.load_state_dict(sd)
    assert torch.equal(ebc.slot_ids("t0"), slots)
    assert max_table_diff(cached_tables(ebc), before) == (0.0, 0.0)
