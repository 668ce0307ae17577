"""Whole training runs on a CUDA device, cached against resident: TorchRec's FBGEMM CUDA tables on both sides.

* ``LookaheadTrainPipeline`` (a plain TorchRec loop) equals TorchRec's ``TrainPipelineBase`` bit for bit;
* FAE's pinned hot rows with Adam (``configs/dlrm_tiny_fae_lookahead.yaml`` through ``verify``);
* ``verify`` of the tiny cached job;
* ``export``: a checkpoint of cached training on the GPU, served by the plain resident model on the GPU,
  gives the cached model's predictions.

Skipped where torch sees no GPU. ``TRL_TEST_DEVICE=cpu`` runs them on the CPU (a check of the tests; FAE runs
row-wise Adagrad there: FBGEMM has no CPU kernel for Adam).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, List

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from torchrec_lookahead.verify import verify

from .conftest import REPO, free_port
from .pipeline_runs import compare, train

DEVICE = torch.device(os.environ.get("TRL_TEST_DEVICE", "cuda"))
ACCELERATOR = "gpu" if DEVICE.type == "cuda" else "cpu"
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]
TINY_FAE = str(REPO / "configs" / "dlrm_tiny_fae_lookahead.yaml")
TINY = str(REPO / "configs" / "dlrm_tiny_lookahead.yaml")


@pytest.fixture(scope="module")
def pg():
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def test_lookahead_pipeline_equals_torchrec_resident_pipeline_on_the_device(pg, record_property) -> None:
    resident = train(cached=False, device=DEVICE)
    cached = train(cached=True, device=DEVICE)
    result = compare(cached, resident)
    record_property("max_abs_weight_diff", result["max_dw"])
    assert result["steps"] == 12 and result["losses_equal"], (cached["losses"], resident["losses"])
    assert any(".embedding_bags.t_cat_2." in k for k in result["keys"])
    assert result["max_dw"] == 0.0


def test_fae_pinned_rows_with_adam_cached_equals_resident_on_the_device(record_property) -> None:
    # FBGEMM has no CPU Adam kernel (the resident job's fused tables): on the CPU, row-wise Adagrad
    optimizer = "adam" if DEVICE.type == "cuda" else "rowwise_adagrad"
    overrides = [
        f"--model.init_args.embedding_optimizer.name={optimizer}",
        f"--trainer.accelerator={ACCELERATOR}",
    ]
    out = verify(TINY_FAE, steps=30, overrides=overrides)
    record_property("max_abs_weight_diff", out["max_abs_weight_diff"])
    record_property("max_abs_loss_diff", out["max_abs_loss_diff"])
    assert out["passed"] and out["max_abs_weight_diff"] == 0.0 and out["max_abs_loss_diff"] == 0.0, out
    assert out["steps"] == 30


def test_verify_tiny_job_on_the_device(record_property) -> None:
    out = verify(TINY, steps=20, overrides=[f"--trainer.accelerator={ACCELERATOR}"])
    record_property("max_abs_weight_diff", out["max_abs_weight_diff"])
    record_property("max_abs_loss_diff", out["max_abs_loss_diff"])
    assert out["passed"] and out["max_abs_weight_diff"] == 0.0 and out["max_abs_loss_diff"] == 0.0, out


def test_checkpoint_of_cached_training_on_the_device_exported_and_served_resident(
    tmp_path: Path, record_property
) -> None:
    from torchrec_lookahead.export import export_checkpoint
    from torchrec_lookahead.launch import build_cli
    from torchrec_lookahead.models import DLRMModule

    cli = build_cli(["--config", TINY, "--trainer.max_steps=7", "--trainer.logger=false",
                     f"--trainer.accelerator={ACCELERATOR}", "--trainer.enable_checkpointing=false",
                     "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={tmp_path}"])  # fmt: skip
    inner = cli.datamodule.datamodule
    predicted: List[Any] = []

    class Predict(pl.Callback):
        """The cached model's predictions at the end of training, on the device (Lightning's teardown moves
        the LightningModule back to the CPU after the fit)."""

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            inner.setup("validate")
            batch = next(iter(inner.val_dataloader()))
            pl_module.eval()
            with torch.no_grad():
                dense, sparse = batch.dense_features.to(DEVICE), batch.sparse_features.to(DEVICE)
                predicted.append(pl_module(dense, sparse).cpu())
            pl_module.train()
            predicted.append(batch)

    cli.trainer.callbacks.append(Predict())
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    ckpt = tmp_path / "cached.ckpt"
    cli.trainer.save_checkpoint(ckpt)
    cli.trainer.strategy.teardown()
    cached, batch = predicted

    out = tmp_path / "served.ckpt"
    summary = export_checkpoint(ckpt, out, config=[TINY])
    assert summary["embedding_tables"] == 26
    served = DLRMModule.load_from_checkpoint(out, map_location="cpu")
    served.configure_model()
    served.load_state_dict(torch.load(out, weights_only=False, map_location="cpu")["state_dict"])
    served.eval().to(DEVICE)
    with torch.no_grad():
        resident = served(batch.dense_features.to(DEVICE), batch.sparse_features.to(DEVICE)).cpu()
    diff = (cached - resident).abs().max().item()
    record_property("max_abs_prediction_diff", diff)
    assert diff <= 1e-6, diff
