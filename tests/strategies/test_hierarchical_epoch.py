"""One group of two gloo ranks with split layers, against synchronous DMP, in one torchrun launch:

* a whole epoch (200 steps of 64 rows per rank) with the dense arch split as a co-partitioned pair and no
  compression ends with the validation log-loss of synchronous DMP within 0.1 % (the weights drift apart: a row
  split sums its partial products in another order, and this training amplifies any difference);
* a run whose every dense layer is split (nothing left for DDP) names its state the way synchronous DMP does,
  and its checkpoint loads into synchronous training and into a hierarchical run with a replicated layer (which
  goes on from the checkpoint's weights: its own per-rank layout differs).
"""

from __future__ import annotations

import json
from typing import Dict, List

import pytest
import torch

from .test_hierarchical_anchors import _launch, _max_diff

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

EPOCH = {
    "steps": -1,
    "epochs": 1,
    "validate": True,
    "data": {"num_train_batches": 400, "num_val_batches": 20},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, List[Dict[str, torch.Tensor]]]:
    tmp = tmp_path_factory.mktemp("hierarchical_epoch")
    ckpt = str(tmp / "all_split" / "epoch=0-step=2.ckpt")
    specs: List[Dict[str, object]] = [
        {"name": "sync_epoch", "strategy": "torchrec", **EPOCH},
        {"name": "pair_epoch", "strategy": {"placement": "pair"}, **EPOCH},
        {"name": "sync_4", "strategy": "torchrec", "steps": 4},
        {
            "name": "all_split",
            "strategy": {"placement": "all_split"},
            "steps": 4,
            "ckpt_dir": str(tmp / "all_split"),
            "ckpt_every": 2,
        },  # fmt: skip
        {"name": "sync_from_all_split", "strategy": "torchrec", "steps": 4, "resume": ckpt},
        {"name": "split_from_all_split", "strategy": {"placement": "split"}, "steps": 4, "resume": ckpt},
    ]
    return _launch(tmp, 2, json.loads(json.dumps(specs)))


def test_split_layers_end_a_whole_epoch_within_0_1_percent_of_synchronous_dmp(runs) -> None:  # type: ignore[no-untyped-def]
    sync = runs["sync_epoch"][0].pop("val/logloss").item()
    split = runs["pair_epoch"][0].pop("val/logloss").item()
    assert abs(split / sync - 1) <= 1e-3, (split, sync)
    # it trained (the synthetic clicks are learnable: an untrained model scores about 0.69)
    assert sync < 0.6, sync


def test_an_all_split_checkpoint_has_synchronous_names_and_loads_into_other_layouts(runs) -> None:  # type: ignore[no-untyped-def]
    assert runs["all_split"][0].keys() == runs["sync_4"][0].keys()
    assert not any(k.startswith("model.model.") for k in runs["all_split"][0])
    # one group with splits stays within 1e-5 of synchronous DMP; so do both runs resumed at step 2 from it
    assert _max_diff(runs["sync_4"], runs["all_split"]) <= 1e-5
    for name in ("sync_from_all_split", "split_from_all_split"):
        assert _max_diff(runs["all_split"], runs[name]) <= 1e-5, name
