"""The Python snippets of README.md and docs/*.md run as written against the current API (a snippet that is a
continuation of an earlier one gets that one's names; inputs a snippet leaves to the reader are built here)."""

from __future__ import annotations

import re
from typing import Any, Dict, List

import torch

from .conftest import REPO


def _snippets(doc: str) -> List[str]:
    return re.findall(r"```python\n(.*?)```", (REPO / doc).read_text(), flags=re.S)


def _run(doc: str, code: str, names: Dict[str, Any]) -> Dict[str, Any]:
    exec(compile(code, doc, "exec"), names)
    return names


def test_the_oracle_page_snippet_plans_a_stream():
    gen = torch.Generator().manual_seed(0)
    batches = [
        {
            "t0": torch.randint(0, 10_000, (512,), generator=gen),
            "t1": torch.randint(0, 300, (64,), generator=gen),
        }
        for _ in range(8)
    ]
    (code,) = _snippets("docs/oracle.md")
    names = _run("docs/oracle.md", code, {"batches": batches})
    assert names["tp"].slots.numel() == 512


def test_the_planner_page_snippet_plans_a_budget(capsys):
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=n, feature_names=[f"f{i}"])
        for i, n in enumerate([200_000, 300])
    ]
    gen = torch.Generator().manual_seed(0)
    sample = [
        {
            "t0": torch.randint(0, 200_000, (256,), generator=gen),
            "t1": torch.randint(0, 300, (256,), generator=gen),
        }
        for _ in range(8)
    ]
    (code,) = _snippets("docs/planner.md")
    code = code.replace("feature_to_table=...", "feature_to_table={'f0': 't0', 'f1': 't1'}")
    names = _run("docs/planner.md", code, {"tables": tables, "sample_batches": sample})
    assert names["plan"].device_bytes <= 64 << 20
    assert "Lookahead planner: device cache plan" in capsys.readouterr().out


def test_the_hierarchical_page_snippet_builds_its_trainer():
    from torchrec_lookahead.strategies import HierarchicalStrategy

    (code,) = _snippets("docs/hierarchical.md")
    names = _run("docs/hierarchical.md", code, {})
    assert isinstance(names["trainer"].strategy, HierarchicalStrategy)


def test_the_getting_started_snippet_selects_the_torchrec_strategy():
    from torchrec_lookahead.strategies import TorchRecStrategy

    code = next(c for c in _snippets("docs/getting_started.md") if 'strategy="torchrec"' in c)
    names = _run("docs/getting_started.md", code, {})
    assert isinstance(names["trainer"].strategy, TorchRecStrategy)


def test_the_configuration_page_scheduler_snippet_defines_a_model():
    from torchrec_lookahead.models import DLRMModule

    (code,) = _snippets("docs/configuration.md")
    names = _run("docs/configuration.md", code, {"torch": torch, "DLRMModule": DLRMModule})
    assert issubclass(names["ScheduledDLRM"], DLRMModule)


def test_the_readme_batch_adapter_snippet_wraps_a_datamodule():
    from torchrec_lookahead.data import CriteoSyntheticDataModule, LookaheadDataModule

    code = next(c for c in _snippets("README.md") if "DictBatchAdapter(" in c)
    data = CriteoSyntheticDataModule(batch_size=64, num_train_batches=2)
    _run("README.md", code, {"data": data, "LookaheadDataModule": LookaheadDataModule})


def test_the_plain_loop_snippet_is_the_swap_sharder_example():
    """docs/getting_started.md's plain-loop snippet is a fragment; examples/swap_sharder.py runs it
    (tests/examples): the lines it shows must be the example's."""
    (code,) = [c for c in _snippets("docs/getting_started.md") if "LookaheadTrainPipeline(" in c]
    example = (REPO / "examples" / "swap_sharder.py").read_text()
    for name in (
        "LookaheadEmbeddingBagCollectionSharder(capacity=",
        "lookahead_sharding_plan(model, sharders, ",
    ):
        assert name in code and name in example
    assert "LookaheadTrainPipeline(dmp, optimizer, device)" in code and "pipeline.progress(" in example
