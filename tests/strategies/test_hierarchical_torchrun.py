"""configs/dlrm_hierarchical.yaml on four gloo ranks under torchrun (two groups of two, the lookahead cache for
the large tables, bf16 compression, background EASGD), shortened: it trains and logs the averaging metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from .test_torchrun import torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_four_rank_fit_of_the_hierarchical_config_logs_its_metrics(tmp_path: Path) -> None:
    out = torchrun(4, "fit", "--config", "configs/dlrm_hierarchical.yaml", f"--trainer.default_root_dir={tmp_path}",
                   "--trainer.max_steps=8", "--trainer.log_every_n_steps=4", "--trainer.limit_val_batches=0",
                   "--trainer.enable_progress_bar=false",
                   "--data.init_args.datamodule.init_args.num_train_batches=64",
                   "--data.init_args.datamodule.init_args.batch_size=128", timeout=400)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert "Hierarchical placement (group_size=2)" in out.stdout + out.stderr
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(tmp_path.glob("lightning_logs/version_*"))))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"hierarchical/distance_to_center/group0", "hierarchical/distance_to_center/group1"} <= tags
    assert events.Scalars("hierarchical/rounds")[-1].value >= 1
    assert events.Scalars("hierarchical/cross_bytes_per_step")[-1].value > 0
