"""Batch adapters: reading batches that are not TorchRec ``Batch`` es, and handing them back with cache slots."""

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch
from torchrec import KeyedJaggedTensor
from torchrec.datasets.utils import Batch

from torchrec_lookahead.errors import ConfigError, DataError
from torchrec_lookahead.runtime import BatchAdapter, DictBatchAdapter, LookaheadBatch
from torchrec_lookahead.runtime.adapter import as_torchrec_batch, replace_by_identity


def kjt(*values: int) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=["f"], values=torch.tensor(values), lengths=torch.ones(len(values), dtype=torch.long)
    )


@dataclass
class Record:
    features: dict
    y: torch.Tensor


class Pair(NamedTuple):
    x: torch.Tensor
    ids: KeyedJaggedTensor


def test_a_torchrec_batch_passes_unchanged_and_needs_no_adapter():
    b = Batch(torch.zeros(2, 1), kjt(1, 2), torch.ones(2))
    assert as_torchrec_batch(b, None) is b


def test_a_dict_batch_without_an_adapter_is_refused_saying_what_to_pass():
    with pytest.raises(
        DataError, match=r"dict batches with keys \['ids', 'x'\].*batch_adapter=.*DictBatchAdapter"
    ):
        as_torchrec_batch({"x": torch.zeros(1), "ids": kjt(1)}, None)


def test_dict_adapter_reads_its_keys_and_the_model_gets_its_own_dict_back_with_slots():
    ids, slots = kjt(7, 9), kjt(0, 1)
    batch = {"x": torch.zeros(2, 1), "ids": ids, "y": torch.ones(2), "extra": "kept"}
    adapter = DictBatchAdapter(dense_key="x", sparse_key="ids", labels_key="y")
    read = as_torchrec_batch(batch, adapter)
    assert isinstance(read, LookaheadBatch) and read.source is batch
    assert read.sparse_features is ids and read.labels is batch["y"]
    planned = LookaheadBatch(
        read.dense_features, slots, read.labels, source=read.source, adapter=read.adapter
    )
    out = planned.user_batch()
    assert out["ids"] is slots and out["extra"] == "kept" and out["x"] is batch["x"]
    assert batch["ids"] is ids  # the loader's batch is not modified
    assert planned.to(torch.device("cpu")).user_batch()["ids"].values().tolist() == [0, 1]


def test_dict_adapter_names_missing_keys():
    with pytest.raises(DataError, match=r"no key\(s\) \['labels'\].*set dense_key"):
        DictBatchAdapter().split({"dense": torch.zeros(1), "sparse": kjt(1)})
    with pytest.raises(DataError, match="reads dict batches but got a tuple"):
        DictBatchAdapter().split((1, 2))


def test_a_function_adapter_finds_the_kjt_by_identity_in_tuples_named_tuples_and_dataclasses():
    ids, slots = kjt(3), kjt(0)
    rec = Record({"pair": Pair(torch.zeros(1, 2), ids)}, torch.ones(1))
    adapter = BatchAdapter(lambda r: (r.features["pair"].x, r.features["pair"].ids, r.y))
    out = adapter.with_sparse(rec, *[adapter.split(rec)[1], slots])
    assert isinstance(out, Record) and isinstance(out.features["pair"], Pair)
    assert out.features["pair"].ids is slots and rec.features["pair"].ids is ids
    found, same = replace_by_identity(OrderedDict(a=[1, (2, 3)]), ids, slots)
    assert not found and same == OrderedDict(a=[1, (2, 3)])
    found, od = replace_by_identity(OrderedDict(a=[1, ids]), ids, slots)
    assert found and type(od) is OrderedDict and od["a"][1] is slots


def test_an_adapter_that_builds_a_new_kjt_must_say_how_to_put_one_back():
    batch = {"ids": [7, 9], "y": torch.ones(2)}
    build = BatchAdapter(lambda b: (torch.zeros(2, 1), kjt(*b["ids"]), b["y"]))
    with pytest.raises(ConfigError, match="not an element of the dict batch.*replace_sparse"):
        build.with_sparse(batch, build.split(batch)[1], kjt(0, 1))
    back = BatchAdapter(build._split, replace_sparse=lambda b, k: {**b, "ids": k.values().tolist()})
    assert back.with_sparse(batch, back.split(batch)[1], kjt(0, 1))["ids"] == [0, 1]


def test_malformed_adapters_are_refused():
    with pytest.raises(ConfigError, match="must be callable"):
        BatchAdapter("not a function")  # type: ignore[arg-type]
    with pytest.raises(DataError, match="KeyedJaggedTensor in the middle but returned list"):
        BatchAdapter(lambda b: (b, [1], b)).split(torch.zeros(1))
    with pytest.raises(DataError, match="returned 'Tensor'"):
        BatchAdapter(lambda b: b).split(torch.zeros(1))


def test_lookahead_datamodule_takes_only_an_adapter_object():
    from torchrec_lookahead.data import CriteoSyntheticDataModule, LookaheadDataModule

    inner = CriteoSyntheticDataModule(batch_size=8, num_train_batches=2, scale=0.0001, min_rows=10)
    with pytest.raises(
        ConfigError, match=r"batch_adapter to be a torchrec_lookahead.runtime.BatchAdapter.*function"
    ):
        LookaheadDataModule(inner, batch_adapter=lambda b: b)  # type: ignore[arg-type]
    assert LookaheadDataModule(inner, batch_adapter=DictBatchAdapter()).batch_adapter.sparse_key == "sparse"
