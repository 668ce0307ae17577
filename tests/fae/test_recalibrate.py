"""``recalibrate="epoch"``: the next epoch's hot set from the exact counts of the epoch just read.

Anchors: the stream's counts equal a naive recount of the epoch's ids; the recalibrated hot set equals the
calibrator run on every batch of the epoch under the same budget; the next epoch regroups by it (its hot
batches read only new hot rows, every sample once); the hot sets travel in the DataModule's state; bad values
of ``recalibrate`` and a conflicting loader reload are refused with typed errors.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Dict

import lightning.pytorch as pl
import pytest
import torch

from torchrec_lookahead.data import CriteoSyntheticDataModule
from torchrec_lookahead.errors import CheckpointError, ConfigError
from torchrec_lookahead.fae import BatchKind, HotColdDataModule, calibrate

from ..conftest import tiny_data_args

FAE = dict(hot_budget_bytes=40_000, sample_fraction=0.5, small_table_bytes=1024, num_chunks=4, chunk_rows=16)


def _dm(**kw: Any) -> HotColdDataModule:
    return HotColdDataModule(
        CriteoSyntheticDataModule(**tiny_data_args()),
        **{**FAE, "embedding_dim": 8, "optimizer": "rowwise_adagrad", "recalibrate": "epoch", **kw},
    )


def _naive_counts(dm: HotColdDataModule) -> Dict[str, torch.Tensor]:
    counts: Dict[str, Counter[int]] = {}
    for b in dm.datamodule.train_dataloader():
        for f, jt in b.sparse_features.to_dict().items():
            counts.setdefault(f, Counter()).update(int(i) for i in jt.values())
    sizes = dm.num_embeddings_per_feature
    out = {}
    for f, c in counts.items():
        t = torch.zeros(sizes[f], dtype=torch.int64)
        for i, k in c.items():
            t[i] = k
        out[f] = t
    return out


def test_recalibrated_hot_set_equals_a_naive_recount_under_the_same_budget() -> None:
    dm = _dm()
    dm.setup("fit")
    first = dm.hot_set
    assert first is not None and dm.next_hot_set is None
    loader = dm.train_dataloader()
    n = len(list(loader))
    assert n == len(loader) and dm.next_hot_set is not None
    naive = _naive_counts(dm)
    assert set(loader.stream.access_counts) == set(naive)
    for f, c in naive.items():
        assert torch.equal(loader.stream.access_counts[f], c), f
    assert loader.stream.samples_read == 12 * 64

    # The calibrator's own path over every batch of the epoch (ids kept, sample_fraction 1) gives the same rows.
    config = dataclasses.replace(dm.calibration_config(), sample_fraction=1.0)
    reference = calibrate(list(dm.datamodule.train_dataloader()), dm.num_embeddings_per_feature, config)
    new = dm.next_hot_set
    assert new.threshold == reference.threshold and new.hot_bytes <= FAE["hot_budget_bytes"]
    for name, table in reference.tables.items():
        assert torch.equal(new.tables[name].hot_ids, table.hot_ids), name
    moved = dm.recalibrations[-1]
    for name, table in new.tables.items():
        old, now = set(first.tables[name].hot_ids.tolist()), set(table.hot_ids.tolist())
        assert moved["tables"][name] == {
            "hot_rows": len(now),
            "promoted": len(now - old),
            "demoted": len(old - now),
        }
    assert moved["promoted"] > 0 and moved["demoted"] > 0  # the sampled and the exact hot sets differ here

    # The next epoch regroups by the new hot set: hot batches read only new hot rows; every sample once.
    second = dm.train_dataloader()
    assert dm.hot_set is new and dm.next_hot_set is None
    assert new.hot_sample_share == pytest.approx(
        second.batches_per_epoch()[BatchKind.HOT] * 64 / (12 * 64), abs=64 / (12 * 64)
    )
    masks = new.masks()
    labels = []
    for kind, batch in second.kinds():
        labels.append(batch.labels)
        if kind is BatchKind.HOT:
            for f, jt in batch.sparse_features.to_dict().items():
                assert bool(masks[f][jt.values()].all()), f
    assert sum(len(x) for x in labels) == 12 * 64
    ref_labels = torch.cat([b.labels for b in dm.datamodule.train_dataloader()])
    assert torch.equal(torch.sort(torch.cat(labels)).values, torch.sort(ref_labels).values)


def test_hot_sets_travel_in_the_datamodule_state() -> None:
    dm = _dm()
    dm.setup("fit")
    list(dm.train_dataloader())
    state = dm.state_dict()
    assert set(state) >= {"hot_set", "next_hot_set"}
    other = _dm()
    other.load_state_dict(state)
    assert other.hot_set is not None and other.next_hot_set is not None
    assert dm.hot_set is not None and dm.next_hot_set is not None
    for mine, theirs in ((dm.hot_set, other.hot_set), (dm.next_hot_set, other.next_hot_set)):
        for name, table in mine.tables.items():
            assert torch.equal(theirs.tables[name].hot_ids, table.hot_ids)
    with pytest.raises(CheckpointError, match="checkpoint's hot_set is not a hot set"):
        _dm().load_state_dict({**state, "hot_set": {"format": "other"}})
    assert "hot_set" not in _dm(recalibrate=None).state_dict()  # a fixed hot set is not checkpointed


@pytest.mark.parametrize("bad", ["batch", "Epoch", True, 1, ""])
def test_bad_recalibrate_values_are_refused(bad: Any) -> None:
    with pytest.raises(ConfigError, match=r"Expected recalibrate None .* or 'epoch'"):
        _dm(recalibrate=bad)


def test_recalibration_sets_or_refuses_the_trainers_loader_reload() -> None:
    dm = _dm()
    dm.trainer = pl.Trainer(logger=False, enable_checkpointing=False, reload_dataloaders_every_n_epochs=2)
    with pytest.raises(ConfigError, match="reload_dataloaders_every_n_epochs=2; set it to 1"):
        dm.setup("fit")
    dm = _dm()
    dm.trainer = pl.Trainer(logger=False, enable_checkpointing=False)
    dm.setup("fit")
    assert dm.trainer.reload_dataloaders_every_n_epochs == 1


def test_resume_after_the_leftover_batch_was_served_early() -> None:
    # The scheduler may ask for a cold batch once the cold samples are used up while hot batches remain: the
    # leftover batch (last cold samples + last hot ones) is then served before the last hot batches, and a
    # resume after it must skip exactly those samples.
    dm = _dm(recalibrate=None)
    dm.setup("fit")
    loader = dm.train_dataloader()
    stream = loader.stream
    per = stream.batches_per_epoch()
    order = [BatchKind.COLD] * per[BatchKind.COLD] + [BatchKind.HOT] * per[BatchKind.HOT]
    assert per[BatchKind.HOT] >= 2

    def run(state: Any = None, start: int = 0) -> list:
        if state is not None:
            stream.load_state_dict(state)
        out = []
        it = iter(stream)
        for want in order[start:]:
            stream.request(want)
            kind, batch = next(it)
            out.append((kind, batch.labels.tolist(), batch.sparse_features.values().tolist()))
        assert next(it, None) is None
        return out

    full = run()
    assert [k for k, _, _ in full] == order
    cut = per[BatchKind.COLD] + 1  # the leftover batch and one hot batch served
    state = {"hot_served": 1, "cold_served": per[BatchKind.COLD]}
    assert run(state, cut) == full[cut:]
