import logging

import pytest
from lightning.pytorch.utilities.model_summary import summarize

from torchrec_lookahead.callbacks import EmbeddingModelSummary
from torchrec_lookahead.callbacks.model_summary import _TableAwareSummary, table_summaries
from torchrec_lookahead.models import DLRMModule


def test_unsharded_tables_are_counted_once():
    m = DLRMModule({"a": 30, "b": 5}, 2, embedding_dim=4, dense_arch_layer_sizes=[4])
    m.configure_model()
    tables = table_summaries(m)
    assert [(t.name, t.rows, t.dim) for t in tables] == [("t_a", 30, 4), ("t_b", 5, 4)]
    ours, lightnings = _TableAwareSummary(m, 1, tables), summarize(m, 1)
    assert ours.total_parameters == lightnings.total_parameters == sum(p.numel() for p in m.parameters())
    assert ours.param_nums == lightnings.param_nums
    assert _TableAwareSummary(m, -1, tables).param_nums == summarize(m, -1).param_nums  # every depth


def _fit_one_step(config: str, caplog: pytest.LogCaptureFixture) -> EmbeddingModelSummary:
    from torchrec_lookahead.launch import build_cli

    args = [
        "--config",
        config,
        "--trainer.max_steps=1",
        "--trainer.limit_val_batches=0",
        "--trainer.logger=false",
    ]
    args += ["--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false"]
    cli = build_cli(args)
    with caplog.at_level(logging.INFO):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    (summary,) = [c for c in cli.trainer.callbacks if isinstance(c, EmbeddingModelSummary)]
    summary.total = _TableAwareSummary(cli.model, 1, summary.tables).total_parameters  # type: ignore[attr-defined]
    summary.lightning_total = summarize(cli.model, 1).total_parameters  # type: ignore[attr-defined]
    return summary


@pytest.mark.slow
def test_the_cli_summary_counts_cached_tables_as_the_resident_model_has_them(caplog):
    resident = _fit_one_step("configs/dlrm_tiny.yaml", caplog)
    # TorchRec's resident shards are parameters: Lightning's count is right there, and ours agrees
    assert resident.total == resident.lightning_total == 16769  # 1,329 rows x 8 + 6,137 dense
    caplog.clear()
    cached = _fit_one_step("configs/dlrm_tiny_lookahead.yaml", caplog)
    assert cached.lightning_total < 6200  # the dense layers only: cached and resident tables both missing
    assert cached.total == resident.total
    where = {t.name: t.where for t in cached.tables}
    assert where["t_cat_2"] == "host store (TensorStore), device cache of 140 rows"
    assert where["t_cat_0"].startswith("device, TorchRec table_wise")
    assert len(where) == 26
    text = caplog.text
    assert "16.8 K    Total params" in text and "t_cat_2   300 x 8   2.4 K  host store" in text
