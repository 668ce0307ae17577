import importlib.util

from ..conftest import REPO


def _load(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_dlrm_example_runs(tmp_path):
    metrics = _load("train_dlrm").main(["--steps", "4", "--batch-size", "64", "--root", str(tmp_path)])
    assert "train/loss" in metrics and "val/auc" in metrics


def test_swap_sharder_example_streams_and_equals_torchrec_resident_loop_bit_for_bit():
    example = _load("swap_sharder")
    cached = example.main(["--steps", "8", "--batch-size", "256"])
    resident = example.main(["--steps", "8", "--batch-size", "256", "--resident"])
    assert len(cached["losses"]) == 8
    assert cached["losses"] == resident["losses"]
