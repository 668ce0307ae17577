import importlib.util

import pytest

from ..conftest import REPO


def _load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_dlrm_example_runs_through_the_cache(tmp_path):
    metrics = _load("train_dlrm").main(
        ["--steps", "4", "--batch-size", "64", "--log-every", "2", "--root", str(tmp_path)]
    )
    assert "train/loss" in metrics and "val/auc" in metrics
    # the cache's statistics: the planner cached tables within the budget and the callback logged them
    fetched = {k: v for k, v in metrics.items() if k.endswith("/rows_fetched")}
    assert fetched and all(v > 0 for v in fetched.values()) and 0.0 <= metrics["cache/hit_rate"] <= 1.0
    assert 0 < metrics["cache/device_bytes"] < metrics["cache/host_bytes"]


@pytest.mark.slow
def test_train_dlrm_example_cached_equals_its_resident_baseline(tmp_path):
    args = ["--steps", "6", "--batch-size", "64", "--log-every", "3"]
    cached = _load("train_dlrm").main([*args, "--root", str(tmp_path / "cached")])
    resident = _load("train_dlrm").main([*args, "--resident", "--root", str(tmp_path / "resident")])
    assert not any(k.startswith("cache/") for k in resident)
    assert cached["train/loss"] == resident["train/loss"] and cached["val/auc"] == resident["val/auc"]


def test_the_readme_python_snippet_adopts_the_cache(monkeypatch):
    """The README's snippet builds what it says (the run itself is the example's, above): the lookahead sharder
    in the torchrec strategy, the wrapped DataModule and the callback."""
    import re

    import lightning.pytorch as pl

    from torchrec_lookahead.callbacks import CacheMonitor
    from torchrec_lookahead.data import LookaheadDataModule
    from torchrec_lookahead.distributed import LookaheadEmbeddingBagCollectionSharder
    from torchrec_lookahead.strategies import TorchRecStrategy

    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    (snippet,) = [b for b in blocks if ".fit(" in b]
    seen = {}

    def fit(trainer, model, datamodule=None):
        seen.update(trainer=trainer, model=model, datamodule=datamodule)

    monkeypatch.setattr(pl.Trainer, "fit", fit)
    exec(compile(snippet, "README.md", "exec"), {})
    assert isinstance(seen["datamodule"], LookaheadDataModule)
    strategy = seen["trainer"].strategy
    assert isinstance(strategy, TorchRecStrategy)
    assert any(isinstance(s, LookaheadEmbeddingBagCollectionSharder) for s in strategy._sharders)
    assert any(isinstance(c, CacheMonitor) for c in seen["trainer"].callbacks)


def test_swap_sharder_example_streams_and_equals_torchrec_resident_loop_bit_for_bit():
    example = _load("swap_sharder")
    cached = example.main(["--steps", "8", "--batch-size", "256"])
    resident = example.main(["--steps", "8", "--batch-size", "256", "--resident"])
    assert len(cached["losses"]) == 8
    assert cached["losses"] == resident["losses"]


@pytest.mark.parametrize(
    "name, args, flag",
    [
        ("train_dlrm", ["--steps", "0"], "--steps"),
        ("train_dlrm", ["--cache-mb", "0"], "--cache-mb"),
        ("train_dlrm", ["--horizon", "-1"], "--horizon"),
        ("swap_sharder", ["--steps", "0"], "--steps"),
        ("swap_sharder", ["--batch-size", "0"], "--batch-size"),
    ],
)
def test_the_examples_refuse_a_value_that_is_not_positive_as_a_usage_error(name, args, flag, capsys):
    with pytest.raises(SystemExit) as e:
        _load(name).main(args)
    assert e.value.code == 2
    assert f"error: {flag} must be" in capsys.readouterr().err
