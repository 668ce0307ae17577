"""Compression is of the in-group traffic: groups of one rank send nothing, and train as without compression."""

import json
from pathlib import Path

import pytest

from .test_torchrun import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _verify(tmp_path: Path, compression: str) -> dict:
    cfg = tmp_path / f"ht_{compression}.yaml"
    cfg.write_text(
        "trainer:\n  strategy:\n    class_path: torchrec_lookahead.strategies.HierarchicalStrategy\n"
        "    init_args:\n      group_size: 1\n      averaging: mean\n      sync_every: 1\n"
        f"      compression: {compression}\n      sharders:\n"
        "        - class_path: torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder\n"
        "          init_args: {capacity: {t_cat_2: 140, t_cat_11: 120, t_cat_15: 110}}\n"
    )
    sgd = ["--model.init_args.embedding_optimizer.name=sgd", "--model.init_args.dense_optimizer.name=sgd"]
    done = torchrun(2, "verify", "--config", "configs/dlrm_tiny_lookahead.yaml", "--config", str(cfg),
                    "--trainer.devices=2", "--steps=4", f"--trainer.default_root_dir={tmp_path / compression}",
                    *sgd)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stderr[-3000:]
    return json.loads(lines[-1])


def test_groups_of_one_rank_are_not_rounded_by_compression(tmp_path: Path) -> None:
    """Two groups of one rank (SGD, mean averaging every step): bf16 and int8 leave the weights as without
    compression (they rounded every gradient to bf16 though no rank received it)."""
    plain = _verify(tmp_path, "none")
    for compression in ("bf16", "int8"):
        compressed = _verify(tmp_path, compression)
        assert compressed["max_abs_weight_diff"] == plain["max_abs_weight_diff"], compression
        assert compressed["max_abs_loss_diff"] == plain["max_abs_loss_diff"], compression
