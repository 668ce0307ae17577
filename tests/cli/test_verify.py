import json
import subprocess
import sys

import pytest

from ..conftest import REPO, TINY_TABLES, free_port
from .test_cli import clean_env, cli_in_process


@pytest.mark.slow
def test_verify_passes_on_the_tiny_cached_config_and_a_failed_comparison_exits_1(capsys, monkeypatch):
    import torchrec_lookahead.verify as verify_command

    code, out, err = cli_in_process(
        capsys, ["verify", "--config", "configs/dlrm_tiny_lookahead.yaml", "--steps", "20"]
    )
    assert code == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["passed"] and result["steps"] == 20
    assert result["max_abs_weight_diff"] == result["tolerance"] == 0.0  # bit-exact by default
    assert {"max_abs_loss_diff", "tensors"} <= result.keys()
    failed = {**result, "max_abs_weight_diff": 1e-7, "passed": False}
    monkeypatch.setattr(verify_command, "verify", lambda *args: failed)
    code, out, _ = cli_in_process(capsys, ["verify", "--config", "configs/dlrm_tiny_lookahead.yaml"])
    assert code == 1 and json.loads(out.strip().splitlines()[-1]) == failed


@pytest.mark.parametrize("tolerance", ["-1", "nan", "inf"])
def test_a_negative_or_non_finite_tolerance_is_refused_before_anything_trains(capsys, monkeypatch, tolerance):
    import torchrec_lookahead.verify as verify_command

    def never(*args: object) -> None:
        raise AssertionError("built a run before checking the tolerance")

    monkeypatch.setattr(verify_command, "_build", never)
    code, out, err = cli_in_process(
        capsys, ["verify", "--config", "configs/dlrm_tiny_lookahead.yaml", f"--tolerance={tolerance}"]
    )
    assert code == 1 and not out, out
    assert err.strip() == (
        f"ConfigError: tolerance must be a finite number >= 0 but got {float(tolerance)!r}; give the largest "
        "absolute difference that passes (0, the default: bit-exact)"
    ), err


def test_verify_refuses_a_config_without_the_torchrec_strategy(capsys, tmp_path):
    cfg = tmp_path / "plain.yaml"
    cfg.write_text("trainer:\n  strategy: auto\n")
    code, _, err = cli_in_process(
        capsys, ["verify", "--config", "configs/dlrm_tiny.yaml", "--config", str(cfg), "--steps", "1"]
    )
    assert code != 0 and "strategy='torchrec'" in err


def test_an_optimizer_the_resident_side_lacks_on_the_cpu_is_refused_before_the_cached_side_trains(
    capsys, monkeypatch, tmp_path
):
    """Every table cached with Adam trains on the CPU (the cache's kernel has Adam), but the resident side's
    FBGEMM CPU kernel has none: that was found only after the cached side had trained."""
    import torchrec_lookahead.verify as verify_command

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("trained a side before finding that the resident side cannot train")

    monkeypatch.setattr(verify_command, "_train", never)
    rows = TINY_TABLES
    capacity = ", ".join(f"t_cat_{i}: {r if r < 100 else r // 2}" for i, r in enumerate(rows))
    cfg = tmp_path / "adam.yaml"
    cfg.write_text(
        "trainer:\n  strategy:\n    class_path: torchrec_lookahead.strategies.TorchRecStrategy\n"
        "    init_args:\n      sharders:\n"
        "        - class_path: torchrec_lookahead.distributed.LookaheadEmbeddingBagCollectionSharder\n"
        f"          init_args: {{capacity: {{{capacity}}}}}\n"
        "model:\n  init_args:\n    embedding_optimizer: {name: adam, lr: 0.01}\n"
    )
    code, out, err = cli_in_process(
        capsys,
        ["verify", "--config", "configs/dlrm_tiny_lookahead.yaml", "--config", str(cfg), "--steps", "2"],
    )
    assert code == 1 and not out, out
    assert err.strip().splitlines()[-1] == (
        "ConfigError: verify cannot compare this config on the CPU: its resident side trains every table with "
        "FBGEMM's fused kernel, which has no Adam on CPU; run verify on CUDA, or with an embedding optimizer "
        "FBGEMM's CPU kernel has (sgd, rowwise_adagrad, adagrad)"
    ), err


def test_verify_notes_caches_trained_with_the_pytorch_kernel_where_fbgemm_has_the_optimizer():
    from types import SimpleNamespace

    import torch

    from torchrec_lookahead.modules import CacheOptimizerConfig
    from torchrec_lookahead.verify import _inexact_notes

    def strategy(cfg: CacheOptimizerConfig, average_every: object = None) -> SimpleNamespace:
        cache = SimpleNamespace(optimizer_config=cfg, device=torch.device("cpu"))
        module = SimpleNamespace(cache=cache, average_every=average_every)
        return SimpleNamespace(cached_modules=lambda: [module])

    assert _inexact_notes(strategy(CacheOptimizerConfig("exact_row_wise_adagrad"))) == []
    assert _inexact_notes(strategy(CacheOptimizerConfig("adam"))) == []  # no FBGEMM kernel: nothing to match
    (note,) = _inexact_notes(strategy(CacheOptimizerConfig("exact_row_wise_adagrad", kernel="torch")))
    assert "PyTorch kernel" in note and "kernel='auto'" in note
    (note,) = _inexact_notes(strategy(CacheOptimizerConfig("exact_sgd"), average_every=4))
    assert "cDLRM" in note and "approximate" in note


def test_verify_takes_any_lightning_module_with_dict_batches_bit_exact(capsys, tmp_path):
    """A user's two-tower LightningModule (not a TorchRecModule, its model under its own attribute name), dict
    batches read through a DictBatchAdapter, both tables cached: cached and resident training are identical."""
    from tests.two_tower import two_tower_config

    cfg = tmp_path / "two_tower.yaml"
    cfg.write_text(two_tower_config())
    code, out, err = cli_in_process(capsys, ["verify", "--config", str(cfg), "--steps", "12"])
    assert code == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["passed"] and result["steps"] == 12
    assert result["max_abs_weight_diff"] == result["max_abs_loss_diff"] == 0.0
    assert result["tensors"] == 10  # both tables and the two towers' eight dense tensors
    assert "args parameter" not in err  # the CLI does not warn about its own argument passing


def test_dict_batches_without_an_adapter_and_modules_without_tables_are_refused(capsys, tmp_path):
    from tests.two_tower import two_tower_config

    cfg = tmp_path / "no_adapter.yaml"
    cfg.write_text(two_tower_config(adapter=False))
    code, _, err = cli_in_process(capsys, ["verify", "--config", str(cfg), "--steps", "2"])
    assert code == 1 and err.strip().splitlines()[-1].startswith("DataError: the training loader yields dict")
    assert "batch_adapter=" in err and "DictBatchAdapter" in err
    cfg.write_text(two_tower_config(model="tests.two_tower.DenseOnlyModule"))
    code, _, err = cli_in_process(capsys, ["verify", "--config", str(cfg), "--steps", "2"])
    assert code == 1 and "ConfigError: DenseOnlyModule holds no TorchRec embedding collection" in err


@pytest.mark.distributed
@pytest.mark.slow
def test_verify_of_dict_batches_on_two_ranks_is_bit_exact(tmp_path):
    from tests.two_tower import two_tower_config

    cfg = tmp_path / "two_tower.yaml"
    cfg.write_text(two_tower_config(rows=90))  # the global batch of two ranks needs up to 76 rows
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "torchrec_lookahead", "verify", "--config", str(cfg), "--trainer.devices=2",
           "--steps", "6"]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400, env=clean_env())
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["passed"] and result["max_abs_weight_diff"] == 0.0 and result["steps"] == 6


def test_verify_notes_that_hierarchical_training_with_several_groups_is_approximate_by_design():
    """Two groups (group_size 1 on 2 ranks) differ from synchronous training by design (0.44 after 12 steps in a
    run): verify said only `"passed": false`."""
    import torch

    from torchrec_lookahead.strategies import HierarchicalStrategy
    from torchrec_lookahead.verify import _inexact_notes

    two = HierarchicalStrategy(group_size=1, sync_every=2)
    two.parallel_devices = [torch.device("cpu")] * 2
    (note,) = _inexact_notes(two)
    assert note.startswith(
        "hierarchical training with 2 groups averages the groups' dense replicas (easgd, every 2"
    )
    assert "approximate by design" in note
    one = HierarchicalStrategy()  # one group of both ranks: exact, no note
    one.parallel_devices = [torch.device("cpu")] * 2
    assert _inexact_notes(one) == []
    # one group, its traffic compressed: 0.051 from synchronous training after a few steps, without a word
    bf16 = HierarchicalStrategy(compression="bf16")
    bf16.parallel_devices = [torch.device("cpu")] * 2
    (note,) = _inexact_notes(bf16)
    assert (
        note.startswith("hierarchical compression: bf16 rounds the group's gradients")
        and "approximate" in note
    )


def test_verify_notes_no_compression_when_every_group_has_one_rank():
    """Groups of one rank send nothing, so compression rounds nothing (exact): verify still noted "hierarchical
    compression ... approximate by design" because it looked at the world size, not the group size."""
    import torch

    from torchrec_lookahead.strategies import HierarchicalStrategy
    from torchrec_lookahead.verify import _inexact_notes

    alone = HierarchicalStrategy(group_size=1, compression="int8")
    alone.parallel_devices = [torch.device("cpu")] * 2
    notes = _inexact_notes(alone)
    assert not [n for n in notes if n.startswith("hierarchical compression")], notes
    assert [n for n in notes if n.startswith("hierarchical training with 2 groups")]  # the averaging still is
    single = HierarchicalStrategy(compression="bf16")  # one rank: one group of one
    single.parallel_devices = [torch.device("cpu")]
    assert _inexact_notes(single) == []


def test_verify_trains_both_sides_with_the_configs_precision_and_notes_a_planner_chosen_kernel(capsys):
    """verify built its Trainer from the accelerator and devices only: `--trainer.precision=16-true`, which fit
    refuses with cached tables, passed as 0.0 (both sides trained in fp32); and compute_kernel: null, under which
    TorchRec trains the resident side's small tables data-parallel with the dense optimizer, failed without a
    word."""
    code, out, err = cli_in_process(
        capsys,
        [
            "verify",
            "--config",
            "configs/dlrm_tiny_lookahead.yaml",
            "--steps",
            "2",
            "--trainer.precision=16-true",
        ],
    )
    assert code == 1 and err.strip().splitlines()[-1].startswith("ConfigError: precision=16-true converts"), (
        err
    )
    from torchrec_lookahead.strategies import TorchRecStrategy
    from torchrec_lookahead.verify import _inexact_notes

    (note,) = _inexact_notes(TorchRecStrategy(compute_kernel=None))
    assert note.startswith("compute_kernel: null lets TorchRec's planner choose the resident side's kernels")


def test_a_sharder_optimizer_unlike_the_models_is_warned_and_noted_by_verify(caplog):
    """The sharder's ``optimizer`` replaces the one the model declares on its cached tables: the cached tables
    trained at another learning rate than resident training of the same model would (0.33 apart after 6 steps),
    and verify said only `"passed": false`."""
    import logging

    from torchrec_lookahead.verify import verify

    sharder = (
        "--trainer.strategy.init_args.sharders=[{class_path: torchrec_lookahead.distributed."
        "LookaheadEmbeddingBagCollectionSharder, init_args: {capacity: {t_cat_2: 140, t_cat_11: 120, t_cat_15: 110}, "
        "optimizer: {optimizer: rowwise_adagrad, learning_rate: %s}}}]"
    )
    with caplog.at_level(logging.WARNING, logger="torchrec_lookahead"):
        out = verify("configs/dlrm_tiny_lookahead.yaml", steps=3, overrides=[sharder % 0.1])
    assert not out["passed"] and out["notes"] == [
        "the sharder's optimizer replaces the one the model declares on the cached tables, which the resident side "
        "trains with (learning_rate 0.1, not 0.05): drop one of the two for a bit-exact comparison"
    ], out
    assert (
        "replaces the one the model declares on its cached tables (learning_rate 0.1, not 0.05)"
        in caplog.text
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchrec_lookahead"):
        same = verify("configs/dlrm_tiny_lookahead.yaml", steps=3, overrides=[sharder % 0.05])
    assert same["passed"] and "notes" not in same and "replaces" not in caplog.text


@pytest.mark.parametrize(
    "override",
    [
        ["--trainer.limit_train_batches=3"],
        ["--trainer.overfit_batches=3"],
        ["--trainer.callbacks+=GradientAccumulationScheduler", "--trainer.callbacks.scheduling={0: 2}"],
    ],
    ids=["limit_train_batches", "overfit_batches", "GradientAccumulationScheduler"],
)
def test_verify_trains_the_epochs_and_accumulation_the_config_sets(override):
    """verify took only the precision, accumulation and clipping of the config's Trainer: with
    `--trainer.limit_train_batches=3` (or overfit_batches, or a GradientAccumulationScheduler) it compared 12-batch
    epochs without accumulation and passed, though the option it was asked about never trained."""
    from torchrec_lookahead.verify import _build, _train, verify

    config = "configs/dlrm_tiny_lookahead.yaml"
    plain = _train(_build(config, ["--seed_everything=0"]), resident=True, steps=6, seed=0)[1]
    asked = _train(_build(config, [*override, "--seed_everything=0"]), resident=True, steps=6, seed=0)[1]
    assert asked[3:6] != plain[3:6]  # the losses of batches, 12 of them when accumulating
    result = verify(config, steps=6, overrides=override)
    assert result["passed"] and result["steps"] == len(asked) and result["max_abs_weight_diff"] == 0.0
